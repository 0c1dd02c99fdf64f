"""Search policies, one file each: which candidate to start from and which task to try next."""

from __future__ import annotations

from typing import Protocol

from agents.roles import Task
from orchestrator.state import RoundRecord, RunState


class Policy(Protocol):
    name: str

    def propose(self, state: RunState, params_of) -> tuple[RoundRecord, Task] | None:
        """(parent round, task) for the next round, or None when there is nothing left to try.
        ``params_of(record)`` reads a candidate's ``params.json`` from git."""
        ...

    def observe(self, state: RunState, record: RoundRecord, params: dict) -> None:
        """Learn from a finished round (its hints feed the backlog)."""
        ...


def make_policy(name: str, planner, seed: int, llm_planner=None, design_of=None, selection: str = "fitness") -> Policy:
    """The policy ``name`` (one of ``orchestrator.config.POLICIES``, checked there); ``selection``: the
    evolve policy's parent selection."""
    from orchestrator.policies.backlog import BacklogPolicy
    from orchestrator.policies.evolve import EvolvePolicy
    from orchestrator.policies.llm import LLMPolicy

    if name == "llm":
        return LLMPolicy(planner, seed, llm_planner, design_of)
    if name == "evolve":
        return EvolvePolicy(planner, seed, selection)
    return BacklogPolicy(planner, seed)
