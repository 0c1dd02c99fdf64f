"""The LLM backend's agents, one per role of ``agents/roles.py``. Each renders its prompt (jinja2,
StrictUndefined, one template per role), talks to the model through a ``ChatClient`` and validates a
structured answer (pydantic), with one repair retry when the answer does not match its schema.

* implementer: a tool-use loop in the workspace until the model answers with its summary;
* judge: the deterministic gate first (never overruled when it rejects), then a review of the diff
  that may reject for reward hacking;
* evaluator: the offline benchmark and hints, plus the model's hints from metrics and profile;
* planner (``--policy llm``): the next parent and task from the run's state.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import git
import jinja2
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.llm.client import AssistantTurn, ChatClient
from agents.llm.tools import Toolbox
from agents.roles import AgentError, Attempt, Evaluation, Hint, Task, Verdict
from skills.library import load_skills
from skills.validation import expand_file
from targets.spec import TargetSpec

PROMPTS = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).with_name("prompts")),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
)
JSON_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


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


def _parse(text: str, schema: type[BaseModel]) -> BaseModel:
    match = JSON_OBJECT.search(text)
    if match is None:
        raise ValueError("no JSON object in the answer")
    return schema.model_validate(json.loads(match.group(0)))


def cut_note(turn: AssistantTurn) -> str:
    """What the model is told when its reply stopped at the output limit (``turn.cut_at``): the reply
    was not used, its tool calls (whose arguments may be incomplete) were not run."""
    calls = ", ".join(c.name for c in turn.tool_calls)
    dropped = f" Its tool calls ({calls}) were not run: their arguments may be incomplete." if calls else ""
    return (
        f"Your reply was cut at the output limit of {turn.cut_at} tokens, so it was not used.{dropped} "
        "Go on in smaller pieces: less text per reply, large files written as several edits, and a short "
        "final JSON answer."
    )


def answer(client: ChatClient, system: str, messages: list[dict], schema: type[BaseModel], role: str) -> BaseModel:
    """Ask for a structured answer; one repair request if it does not validate. A reply cut at the
    output limit is never taken as the answer, even if the cut text parses: the repair request says it
    was cut."""
    turn = client.chat(system, messages, [])
    if turn.cut_at is not None:
        problem = cut_note(turn)
    else:
        try:
            return _parse(turn.text, schema)
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
        return _parse(turn.text, schema)
    except (ValueError, ValidationError) as error:
        raise OutputSchemaError(f"the {role}'s answer failed its schema twice: {error}") from None


def implementer_prompt(spec: TargetSpec, task: Task, workspace: Path, feedback: list[str], hints) -> str:
    """The implementer's instructions: target, task, the skills it names, DESIGN.md, hints, feedback."""
    skills = load_skills()
    design = (workspace / "DESIGN.md").read_text() if (workspace / "DESIGN.md").exists() else "(none)"
    return PROMPTS.get_template("implementer.j2").render(
        target=spec,
        task=task,
        skills=[skills[s] for s in task.skills if s in skills],
        design=design,
        hints=[Hint(**h) for h in hints],
        feedback=feedback,
    )


class LLMImplementer:
    def __init__(
        self, spec: TargetSpec, client: ChatClient, sandbox, offline, checks, benchmark=None, max_turns: int = 40
    ) -> None:
        self.spec, self.client, self.sandbox, self.max_turns = spec, client, sandbox, max_turns
        self.checks, self.benchmark = checks, benchmark
        self.offline = offline  # the starter comes from the library, as the offline implementer writes it

    def starter(self, workspace: Path, controller: str) -> Attempt:
        return self.offline.starter(workspace, controller)

    def implement(self, task: Task, workspace: Path, feedback: list[str], hints: list[dict] = ()) -> Attempt:
        system = implementer_prompt(self.spec, task, workspace, feedback, hints)
        toolbox = Toolbox(
            workspace,
            self.sandbox,
            checks=lambda: self.checks(workspace),
            benchmark=(lambda: self.benchmark(workspace)) if self.benchmark else None,
        )
        messages: list[dict] = [{"role": "user", "content": "Carry out the task, then answer with the JSON summary."}]
        for _ in range(self.max_turns):
            turn = self.client.chat(system, messages, toolbox.specs())
            if turn.cut_at is not None:  # never an answer, and its calls are not run: the model is told
                messages.append({"role": "assistant", "text": turn.text, "tool_calls": []})
                messages.append({"role": "user", "content": cut_note(turn)})
                continue
            messages.append({"role": "assistant", "text": turn.text, "tool_calls": turn.tool_calls})
            if not turn.tool_calls:
                try:
                    output = _parse(turn.text, ImplementerOutput)
                except (ValueError, ValidationError) as error:
                    output = answer(
                        self.client,
                        system,
                        messages[:-1]
                        + [
                            {"role": "assistant", "text": turn.text, "tool_calls": []},
                            {
                                "role": "user",
                                "content": f"That was not the JSON summary ({error}). "
                                "Answer with only the JSON object.",
                            },
                        ],
                        ImplementerOutput,
                        "implementer",
                    )
                break
            for call in turn.tool_calls:
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": toolbox.call(call)}
                )
        else:
            raise AgentError(f"the implementer used {self.max_turns} turns without finishing")
        for path in sorted((workspace / "stack").rglob("*.py")):
            expand_file(path)
        return Attempt(output.summary, output.files_changed)


class LLMJudge:
    """The deterministic gate decides first; the model may only add a rejection."""

    def __init__(self, gate, client: ChatClient) -> None:
        self.gate, self.client = gate, client

    def judge(self, workspace: Path, out: Path, task: Task | None = None, seed: int = 0) -> Verdict:
        verdict = self.gate.judge(workspace, out, task, seed)
        if not verdict.passed:
            return verdict
        repo = git.Repo(workspace)
        repo.git.add("-A")
        diff = repo.git.diff("--cached", "HEAD", "--", ".", ":(exclude).vibetrain") or "(no change)"
        task = task or Task(id="unknown", title="(not given)", rationale="")
        system = PROMPTS.get_template("judge.j2").render(task=task, checks=verdict.checks, diff=diff[:30_000])
        review = answer(self.client, system, [{"role": "user", "content": "Review the change."}], Review, "judge")
        if review.verdict == "reject":
            reasons = [f"llm review: {r}" for r in review.reasons] or ["llm review: rejected without a reason"]
            return Verdict(
                False, reasons, verdict.checks + [{"name": "llm_review", "passed": False, "reasons": reasons}]
            )
        return Verdict(
            True, [], verdict.checks + [{"name": "llm_review", "passed": True, "reasons": review.reasons}], verdict.run
        )


class LLMEvaluator:
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
            hints=evaluation.hints,
            profile=evaluation.profile[:6000],
            codes=codes,
        )
        output = answer(
            self.client, system, [{"role": "user", "content": "Write the hints."}], EvaluatorOutput, "evaluator"
        )
        known = {h.code for h in evaluation.hints}
        evaluation.hints += [h for h in output.hints if h.code not in known]
        return evaluation


class LLMPlanner:
    """For the ``llm`` policy: proposes the parent and the task; the offline planner's range checks
    still apply when the task is implemented."""

    def __init__(self, spec: TargetSpec, client: ChatClient) -> None:
        self.spec, self.client = spec, client

    def plan(self, state, design: str) -> PlannerOutput:
        system = PROMPTS.get_template("planner.j2").render(
            target=self.spec,
            rounds=state.rounds,
            best_round=state.best_round,
            skills=list(load_skills().values()),
            design=design,
        )
        return answer(
            self.client, system, [{"role": "user", "content": "Plan the next round."}], PlannerOutput, "planner"
        )
