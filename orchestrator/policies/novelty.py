"""Novelty: the configurations (params.json) a run has built, and whether a proposal is one of them
again. Adding A then B builds what B then A built; moving a parameter back builds the grandparent."""

from __future__ import annotations

from collections.abc import Callable

from agents.roles import Task
from orchestrator.state import RoundRecord, RunState

NEAR = 0.1
"""Real-valued parameters within this fraction of each other count as the same point (counts and
device numbers must be equal)."""


def near_duplicates(a: dict, b: dict, default: Callable[[str], object] | None = None) -> bool:
    """Two configurations (params.json) that differ by no more than NEAR in any real-valued parameter; a
    parameter one leaves out counts at ``default(name)`` (the planner's defaults: a move back to a default
    that params.json leaves out, such as the target's own async_ratio, rebuilt the grandparent unseen)."""
    unset = default or (lambda name: None)
    for key in a.keys() | b.keys():
        x, y = a.get(key, unset(key)), b.get(key, unset(key))
        if x == y:
            continue
        reals = all(isinstance(v, float) for v in (x, y))
        if not reals or abs(x - y) > NEAR * max(abs(x), abs(y)):
            return False
    return True


def built_configurations(state: RunState, params_of: Callable[[RoundRecord], dict]) -> list[dict]:
    """Every configuration the run has built or tried: a validated round's own parameters (each read
    once), and for the others (rejected, screened out) their parent's with the task's changes; not a
    round that ended in an error, whose candidate was never judged (``RunState.tried`` bounds its retries)."""
    validated = {r.commit: params_of(r) for r in state.accepted() if r.commit}
    built = list(validated.values())
    for record in state.rounds:
        if record.verdict not in ("accepted", "error") and record.task.changes and record.parent_commit in validated:
            built.append({**validated[record.parent_commit], **record.task.changes})
    return built


def rebuilds(params: dict, task: Task, built: list[dict], default: Callable[[str], object] | None = None) -> bool:
    """Whether ``task`` applied to ``params`` gives a configuration the run built already (a task with no
    ``changes``, an LLM's free-form edit, never does: its result is not known before it runs)."""
    return bool(task.changes) and any(near_duplicates({**params, **task.changes}, b, default) for b in built)
