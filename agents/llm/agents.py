"""The LLM backend's agents, one per role of ``agents/roles.py``. Each renders its prompt (jinja2,
StrictUndefined, one template per role), talks to the model through a ``ChatClient`` and validates a
structured answer (pydantic), with one repair retry when the answer does not match its schema.

* implementer: a tool loop (``loop.py``) in the workspace until the model finishes and the checks pass;
* judge (``judge.py``): the deterministic gate first (never overruled when it rejects), then a
  read-only review that may reject for reward hacking;
* evaluator: the offline benchmark and hints, plus the model's hints from metrics and profile;
* planner (``--policy llm``): the next parent and task from the run's state.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.llm import context as facts
from agents.llm.client import ChatClient
from agents.llm.errors import LLMError, LLMUnusable
from agents.llm.hacks import HACKS
from agents.llm.loop import cut_note, parse_answer, run_loop
from agents.llm.tools import (
    MAX_DESIGN,
    MAX_FEEDBACK_LINE,
    MAX_FEEDBACK_LINES,
    Toolbox,
    ToolResultError,
    inside,
    read_design,
    truncated,
)
from agents.roles import AgentError, Attempt, Evaluation, Hint, RoundContext, Task
from skills.library import ParamRange, load_skills
from skills.validation import expand_file
from skills.validation.expand import AnnotationError
from targets.spec import TargetSpec

PROMPTS = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).with_name("prompts")),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
)


class OutputSchemaError(AgentError):
    """The model's answer failed its schema twice (the first failure gets one repair request)."""


class ImplementerOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    summary: str = Field(min_length=1)
    files_changed: list[str] = []


class Review(BaseModel):
    model_config = ConfigDict(extra="forbid")
    verdict: str = Field(pattern="^(accept|reject)$")
    reasons: list[str] = []


class EvaluatorOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hints: list[Hint] = []


class PlannerOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    parent_round: int
    task: Task
    plan: list[str] = []


def answer(client: ChatClient, system: str, messages: list[dict], schema: type[BaseModel], role: str) -> BaseModel:
    """Ask for a structured answer; one repair request if it does not validate. A reply cut at the
    output limit is never taken as the answer, even if the cut text parses: the repair request says it
    was cut."""
    turn = client.chat(system, messages, [])
    if turn.cut_at is not None:
        problem = cut_note(turn)
    else:
        try:
            return parse_answer(turn.text, schema)
        except (ValueError, ValidationError) as error:
            problem = f"Your answer did not match the required JSON ({error})."
    messages = messages + [
        {"role": "assistant", "text": turn.text, "tool_calls": []},
        {"role": "user", "content": f"{problem} Answer again with only the JSON object."},
    ]
    turn = client.chat(system, messages, [])
    if turn.cut_at is not None:
        raise OutputSchemaError(
            f"the {role}'s answer was cut at the output limit of {turn.cut_at} tokens twice "
            "(raise it with --max-output-tokens)"
        )
    try:
        return parse_answer(turn.text, schema)
    except (ValueError, ValidationError) as error:
        raise OutputSchemaError(f"the {role}'s answer failed its schema twice: {error}") from None


def implementer_prompt(
    spec: TargetSpec,
    task: Task,
    workspace: Path,
    feedback: list[str],
    hints,
    context: RoundContext | None = None,
    budget: str = "",
) -> str:
    """The implementer's context pack: target and mode, task, the measuring rule and the parent's
    figures, the contract, a map of the files, the skills (the task's in full, the rest indexed),
    DESIGN.md, the previous attempt, the rules and a workflow."""
    skills = load_skills()
    try:
        design = truncated(read_design(workspace) or "(none)", MAX_DESIGN)
    except ToolResultError as refused:
        design = f"({refused})"
    context = context or RoundContext()
    return PROMPTS.get_template("implementer.j2").render(
        target=spec,
        task=task,
        mode=facts.mode_text(context, spec),
        attempt=context.attempt,
        max_attempts=context.max_attempts,
        budget=budget or "no budget given",
        parent=facts.parent_lines(spec, context),
        parent_round=context.parent_round,
        hints=list(hints),
        files=facts.file_map(workspace),
        skills=[skills[s] for s in task.skills if s in skills],
        index=[entry for entry in facts.skills_index() if entry[0] not in task.skills],
        design=design,
        previous_account=context.previous_account,
        diff_stat=facts.diff_stat(workspace) if context.previous_account or feedback else "",
        feedback=cut_feedback(feedback),
        hacks=HACKS,
    )


def cut_feedback(feedback: list[str]) -> list[str]:
    """The judge's reasons as the next attempt's prompt carries them: each cut to its head and tail, and a
    few of them. A reason may quote the candidate's own text (a controller's exception, whole): a megabyte
    one made every call of the next attempt a costly one, and carried what the candidate chose to tell it."""
    lines = [truncated(line, MAX_FEEDBACK_LINE) for line in feedback[:MAX_FEEDBACK_LINES]]
    more = len(feedback) - MAX_FEEDBACK_LINES
    return lines + ([f"... and {more} more reasons (read the judge's report with run_checks)"] if more > 0 else [])


def expand_annotations(workspace: Path) -> list[str]:
    """Expand the stack's ``# VAL:`` annotations in place; the errors, one line each (for the model).
    A file that is a link out of the workspace is not expanded: the expansion writes on the host."""
    if (workspace / "stack").is_symlink():  # its files are the host's: not listed, not written
        return ["stack: a symbolic link: not expanded; the stack must be a folder of the workspace"]
    problems = []
    for path in sorted((workspace / "stack").rglob("*.py")):
        where = path.relative_to(workspace)
        try:
            out = not inside(workspace, path)
        except RuntimeError:  # a link loop
            problems.append(f"{where}: a symbolic link loop: not expanded; put the file itself there")
            continue
        if out:
            problems.append(f"{where}: a link out of the workspace: not expanded; put the file itself there")
            continue
        if not path.is_file():  # a FIFO: reading it would hold the orchestrator for ever
            problems.append(f"{where}: not a regular file (a FIFO, a socket, a device): not expanded; delete it")
            continue
        try:
            expand_file(path, workspace)
        except (AnnotationError, UnicodeDecodeError) as error:  # the model wrote it: the model fixes it
            problems.append(f"annotation error: {error}")
    return problems


DEFAULT_MAX_TURNS = 40  # an implementer attempt's model turns unless --max-turns says otherwise


class LLMImplementer:
    """A tool loop in the workspace until the model calls ``finish`` and the checks pass (a failing
    check or an annotation error goes back to the model while its turns last)."""

    def __init__(
        self,
        spec: TargetSpec,
        client: ChatClient,
        sandbox,
        offline,
        checks,
        benchmark=None,
        max_turns: int = DEFAULT_MAX_TURNS,
        accounting=None,
    ) -> None:
        self.spec, self.client, self.sandbox, self.max_turns = spec, client, sandbox, max_turns
        self.checks, self.benchmark, self.accounting = checks, benchmark, accounting
        self.offline = offline  # the starter comes from the library, as the offline implementer writes it

    def implement(
        self, task: Task, workspace: Path, feedback: list[str], hints: list[Hint] = (), context=None
    ) -> Attempt:
        if task.source == "starter":  # the library writes starters
            return self.offline.implement(task, workspace, feedback)
        budget = facts.budget_line(self.accounting, self.max_turns)
        system = implementer_prompt(self.spec, task, workspace, feedback, hints, context, budget)

        def run_checks() -> str:
            problems = expand_annotations(workspace)
            return ("FAILED\n" + "\n".join(problems)) if problems else self.checks(workspace)

        def on_finish(output: ImplementerOutput) -> str | None:
            report = run_checks()
            return None if report.startswith("PASSED") else report

        toolbox = Toolbox(
            workspace,
            self.sandbox,
            checks=run_checks,
            benchmark=(lambda: self.benchmark(workspace)) if self.benchmark else None,
        )
        result = run_loop(
            self.client,
            system,
            [{"role": "user", "content": "Carry out the task, then call finish."}],
            toolbox,
            ImplementerOutput,
            finish_description="Call when the task is done: the checks run, and a failure comes back to you. "
            "summary: what you changed and why (it goes into the commit message); files_changed: the files.",
            on_finish=on_finish,
            max_turns=self.max_turns,
            role="implementer",
        )
        return Attempt(result.output.summary, result.output.files_changed)


class LLMEvaluator:
    """The offline benchmark and hints, plus the model's hints. The model's hints are advice, not
    evidence: when they cannot be had (the provider fails past its retries, the answer fails its
    schema twice), the evaluation stands on the offline hints, with a ``llm_hints_unavailable`` hint
    that says why, rather than losing a measured candidate. A spent budget still stops the run."""

    def __init__(self, spec: TargetSpec, offline, client: ChatClient) -> None:
        self.spec, self.offline, self.client = spec, offline, client

    def evaluate(self, workspace: Path, out: Path, baseline: Path | None, seeds: list[int], first=None) -> Evaluation:
        evaluation = self.offline.evaluate(workspace, out, baseline, seeds, first)
        if evaluation.findings:
            return evaluation
        codes = sorted({code for s in load_skills().values() for code in s.triggers})
        metrics = {k: v for k, v in evaluation.metrics.items() if isinstance(v, (int, float))}
        system = PROMPTS.get_template("evaluator.j2").render(
            target=self.spec,
            repeats=len(evaluation.repeats),
            metrics=metrics,
            spread=evaluation.spread,
            paired=evaluation.paired,
            hints=evaluation.hints,
            profile=evaluation.profile[:6000],
            codes=codes,
        )
        try:
            output = answer(
                self.client, system, [{"role": "user", "content": "Write the hints."}], EvaluatorOutput, "evaluator"
            )
        except LLMUnusable:
            raise  # a backend that refuses the run: the run stops, no outage to fall back from
        except (LLMError, OutputSchemaError) as error:  # BudgetSpent too: the measured candidate is kept, with the
            # offline hints, and the run stops at its budget check after the round
            evaluation.hints.append(
                Hint(
                    code="llm_hints_unavailable",
                    message=f"LLM hints unavailable ({type(error).__name__}: {error}); the hints above are the "
                    "offline rules' only",
                )
            )
            return evaluation
        known = {h.code for h in evaluation.hints}
        evaluation.hints += [h.model_copy(update={"by": "llm"}) for h in output.hints if h.code not in known]
        return evaluation


def param_range(r: ParamRange) -> str:
    """A parameter's range as the planner reads it: ``[0, 4] step 1, default 0 (the simulator models it)``."""
    high = "" if r.max is None else f"{r.max:g}"
    if r.max_fraction is not None:
        high = (f"{high}, " if high else "") + f"at most {r.max_fraction:g} of the devices"
    said = f"[{r.min:g}, {high or 'no bound'}]"
    said += f" step {r.step:g}" if r.step is not None else ""
    said += f" in whole engines of {r.step_engines}" if r.step_engines is not None else ""
    said += f", default {r.default:g}" if r.default is not None else ""
    return said + (" (the simulator models it)" if r.simulated else "")


class LLMPlanner:
    """For the ``llm`` policy: proposes the parent and the task; the offline planner's range checks
    still apply when the task is implemented."""

    def __init__(self, spec: TargetSpec, client: ChatClient) -> None:
        self.spec, self.client = spec, client

    def plan(self, state, design: str, params: dict[int, dict]) -> PlannerOutput:
        """``params``: each validated round's ``params.json``, by round (what a task's changes move from)."""
        system = PROMPTS.get_template("planner.j2").render(
            target=self.spec,
            rounds=state.rounds,
            best_round=state.best_round,
            skills=list(load_skills().values()),
            design=design,
            params=params,
            param_range=param_range,
        )
        return answer(
            self.client, system, [{"role": "user", "content": "Plan the next round."}], PlannerOutput, "planner"
        )
