"""The inner loop's roles as small interfaces, and the data that flows between them.

A backend (``offline`` here; ``openai``/``anthropic``/``cli`` later) implements each role with one
method. The orchestrator's round loop only ever talks to these interfaces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from targets.harness.judge.check_result import CheckResult
from targets.printable import one_line, printable

if TYPE_CHECKING:
    from agents.llm.accounting import Accounting
    from agents.llm.agents import LLMPlanner
    from targets.harness.measure.session import Measurement, Paired
    from targets.spec import TargetSpec


class AgentError(RuntimeError):
    """An attempt an agent could not complete (a provider failure, a bad tool call, an output that
    fails its schema twice, an impossible task). The round loop ends that attempt, records the
    message and hands it to the next attempt as feedback."""


class NothingToRepair(AgentError):
    """The implementer has no change to make for the judge's reasons: the candidate would be the one
    just rejected, so the round ends on that verdict instead of paying for the same judgement again
    (on a GPU target, a whole real check)."""


# agent-written text in a record (a task's title, an implementer's account, a judge's reason), escaped as it is
# stored: every view of it (log, show, the report, a commit message, an LLM's prompt) reads it safe
PrintableText = Annotated[str, AfterValidator(printable)]
OneLine = Annotated[str, AfterValidator(one_line)]


class Task(BaseModel):
    """One round's work, as an issue tracker would hold it."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9._=+-]*$")
    title: OneLine
    rationale: PrintableText
    skills: list[str] = []
    changes: dict = {}  # params.json keys to set (what the offline implementer applies)
    acceptance: list[PrintableText] = []
    priority: int = 0  # higher first
    source: OneLine = ""  # "starter", "trigger:<hint>", "mutation", ...


def starter_task(controller: str, params: dict | None = None) -> Task:
    """Round 0's task: the starter stack for ``controller``, written from the skills library, with
    ``params`` over its defaults (``generate --starter-param``)."""
    given = f", with {', '.join(f'{k}={json.dumps(v)}' for k, v in params.items())}" if params else ""
    return Task(
        id=f"starter={controller}",
        title=f"starter stack ({controller}{given})",
        source="starter",
        rationale=f"the {controller} baseline built from the skills library's recipes{given}",
        skills=[controller],
        changes={"controller": controller, **(params or {})},
        acceptance=["vibetrain check passes"],
    )


class Hint(BaseModel):
    """An evaluator finding: ``code`` matches skill triggers. ``by``: read from the trace by the offline
    rules, or an LLM evaluator's reading of the figures (its word: said so wherever a person reads it)."""

    model_config = ConfigDict(extra="forbid")
    code: OneLine
    message: PrintableText
    evidence: dict = {}
    by: Literal["rules", "llm"] = "rules"

    @property
    def said(self) -> str:
        return self.message if self.by == "rules" else f"{self.message} (the LLM evaluator's reading)"


@dataclass
class Attempt:
    """What an implementer did to the workspace."""

    summary: str
    files_changed: list[str] = field(default_factory=list)


@dataclass
class RoundContext:
    """What the round loop knows that an LLM agent's context pack shows: the parent's measurement
    (with its spread and hints), the execution mode, which attempt this is and what the previous one
    did (its edits stay in the workspace), and, for the judge, the implementer's account."""

    parent_round: int | None = None
    parent_metrics: dict = field(default_factory=dict)
    parent_spread: dict = field(default_factory=dict)
    parent_hints: list[Hint] = field(default_factory=list)
    simulated: bool = False
    attempt: int = 1
    max_attempts: int = 1
    previous_account: str = ""
    account: str = ""


@dataclass
class Verdict:
    """The judge's decision: its checks, each a ``CheckResult``; it passes when they all do (and
    there is at least one). ``run`` is the judge's own system run, audited like any measured run
    (its figures count as the first repeat of the candidate's measurement)."""

    checks: list[CheckResult]
    run: Measurement | None = None

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        """Every failed check's reasons, each after the check's name."""
        return [f"{c.name}: {reason}" for c in self.checks if not c.passed for reason in c.reasons]

    @classmethod
    def refused(cls, check: str, reasons: list[str]) -> Verdict:
        """A verdict of one failed check (what stopped a candidate before the judge's run)."""
        return cls([CheckResult(check, False, list(reasons))])

    def adding(self, check: CheckResult) -> Verdict:
        """This verdict with one more check (a failed one drops the run: its figures no longer count)."""
        return Verdict([*self.checks, check], self.run if check.passed else None)

    def record(self) -> dict:
        """What a round commits as ``judge.json``."""
        return {"reasons": self.reasons, "checks": [c.as_dict() for c in self.checks]}


@dataclass
class Evaluation:
    """The evaluator's measurement: medians over repeats, their spread, the paired ratio against the
    baseline (the incumbent best) with its interval, and hints for next rounds. ``findings``: checks
    a measured run failed; any one rejects the candidate (every measured run is judged)."""

    headline: float
    metrics: dict
    spread: dict
    repeats: list[dict]
    hints: list[Hint]
    profile: str = ""
    trace_path: Path | None = None  # the median repeat's trace (for timelines)
    paired: Paired | None = None
    findings: list[str] = field(default_factory=list)


class Implementer(Protocol):
    def implement(
        self, task: Task, workspace: Path, feedback: list[str], hints: list[Hint] = (), context: RoundContext = None
    ) -> Attempt:
        """``feedback``: the judge's reasons for the previous attempt; ``hints``: the parent's findings;
        ``context``: the round's facts for an LLM's context pack (None outside a round). A starter
        task (``starter_task``) writes a complete starter stack, afresh on every attempt."""
        ...


class Judge(Protocol):
    def judge(
        self, workspace: Path, out: Path, task: Task | None = None, seed: int = 0, context: RoundContext = None
    ) -> Verdict: ...


class Evaluator(Protocol):
    def evaluate(
        self, workspace: Path, out: Path, baseline: Path | None, seeds: list[int], first: Measurement | None = None
    ) -> Evaluation:
        """Measure the candidate in ``workspace``, paired with ``baseline`` (a candidate directory)
        when given: one pair of interleaved runs per seed. ``first``: the judge's run, made with
        ``seeds[0]``, counts as the candidate's first repeat."""
        ...


class Planner(Protocol):
    """What the backlog and evolve policies ask of a planner: tasks that answer the evaluator's hints
    on a candidate's parameters, the technique compositions open to it, and its legal parameter moves
    (all of them, or one at random)."""

    spec: TargetSpec

    def tasks_from_hints(self, hints: list[Hint], params: dict) -> list[Task]: ...

    def composition_tasks(self, params: dict) -> list[Task]: ...

    def parameter_moves(self, params: dict) -> list[Task]: ...

    def perturbation(self, params: dict) -> Task | None: ...


@dataclass
class Agents:
    """One backend's roles, handed to the round loop together. ``accounting`` counts an LLM backend's
    tokens and dollars (None offline); ``llm_planner`` serves the ``llm`` policy."""

    backend: str
    planner: Planner
    implementer: Implementer
    judge: Judge
    evaluator: Evaluator
    accounting: Accounting | None = None
    llm_planner: LLMPlanner | None = None
