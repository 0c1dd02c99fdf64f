"""llm: an LLM planner reads the run (rounds, verdicts, metrics, hints, the best candidate's DESIGN.md)
and writes the next parent and task. Its choice is checked: the parent must be a validated round and
the task must be new on it, and a task that sets parameters must not build a configuration the run built
already (``novelty.py``: what the other policies never propose either). A planner that fails (a provider
error, an invalid choice) hands this round to the backlog policy, and says so; a spent LLM budget is no
such failure: it stops the run before a round that could only fail on it (and mark its task tried)."""

from __future__ import annotations

import logging

from agents.llm.errors import BudgetSpent, LLMUnusable
from agents.roles import AgentError, Task
from orchestrator.policies.backlog import BacklogPolicy
from orchestrator.policies.novelty import built_configurations, rebuilds
from orchestrator.state import RoundRecord, RunState

log = logging.getLogger("vibetrain.policy")


class LLMPolicy:
    name = "llm"

    def __init__(self, planner, seed: int, llm_planner=None, design_of=None) -> None:
        self.backlog = BacklogPolicy(planner, seed)
        self.llm_planner, self.design_of = llm_planner, design_of

    def propose(self, state: RunState, params_of) -> tuple[RoundRecord, Task] | None:
        if state.best is None:
            return None
        try:
            validated = {r.round: params_of(r) for r in state.accepted()}
            choice = self.llm_planner.plan(state, self.design_of(state.best), validated)
            parent = state.record(choice.parent_round)
            if parent is None or parent.verdict != "accepted":
                raise AgentError(f"the planner chose round {choice.parent_round}, which is not a validated candidate")
            if (parent.commit, choice.task.id) in state.tried():
                raise AgentError(f"the planner chose task {choice.task.id!r}, already tried on round {parent.round}")
            built = built_configurations(state, params_of)
            if rebuilds(params_of(parent), choice.task, built, self.backlog.planner.default):
                raise AgentError(
                    f"the planner chose task {choice.task.id!r} on round {parent.round}, whose changes "
                    f"{choice.task.changes} build a configuration the run built already"
                )
        except (BudgetSpent, LLMUnusable):  # the run stops on these: no planner failure to fall back from
            raise
        except AgentError as error:
            log.warning("LLM planner: %s; this round follows the backlog policy instead", error)
            fallback = self.backlog.propose(state, params_of)
            if fallback is None:
                return None
            parent, task = fallback  # the round's record says why the backlog chose it, not only the log
            said = f"the LLM planner failed ({error}), so the backlog policy chose this task: {task.rationale}"
            return parent, task.model_copy(update={"rationale": said})
        known = {t.id for t in state.backlog}
        for step in choice.plan:
            text = step.strip()[:120]
            # ASCII only: "µ" is alphanumeric to Python and no character of a task id
            step_id = "plan-" + "".join(c if c.isascii() and c.isalnum() else "-" for c in text.lower())[:40].strip("-")
            if text and step_id != "plan-" and step_id not in known:
                state.backlog.append(
                    Task(id=step_id, title=text, rationale="the LLM planner's plan", source="llm", priority=-1)
                )
                known.add(step_id)
        return parent, choice.task.model_copy(update={"source": "llm"})

    def observe(self, state: RunState, record: RoundRecord, params: dict) -> None:
        self.backlog.observe(state, record, params)
