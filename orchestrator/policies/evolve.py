"""evolve: a population of validated candidates. The parent is the fitter of two drawn at random
(tournament selection on the headline metric); the mutation applies a skill its hints triggered,
adds or removes a technique, or perturbs one parameter. A mutation whose result is a near-duplicate
of a configuration the run already built (from any parent: adding A then B is B then A, and moving a
parameter back is its grandparent) is not tried again. Deterministic for a seed."""

from __future__ import annotations

import random
from collections.abc import Callable

from agents.roles import Task
from orchestrator.policies.novelty import built_configurations, rebuilds
from orchestrator.state import RoundRecord, RunState


class EvolvePolicy:
    name = "evolve"

    def __init__(self, planner, seed: int) -> None:
        self.planner, self.rng = planner, random.Random(seed)

    def _select(self, state: RunState) -> RoundRecord | None:
        population = [r for r in state.accepted() if r.headline is not None]
        if not population:
            return None
        sign = 1 if self.planner.spec.headline_metric.direction == "maximize" else -1
        contenders = self.rng.sample(population, min(2, len(population)))
        return max(contenders, key=lambda r: sign * r.headline)

    def propose(self, state: RunState, params_of: Callable[[RoundRecord], dict]) -> tuple[RoundRecord, Task] | None:
        tried = state.tried()
        cache: dict[str, dict] = {}

        def params(record: RoundRecord) -> dict:
            if record.commit not in cache:
                cache[record.commit] = params_of(record)
            return cache[record.commit]

        built = built_configurations(state, params)
        for _ in range(20):
            parent = self._select(state)
            if parent is None:
                return None
            current = params(parent)

            def novel(task: Task, parent: RoundRecord = parent, current: dict = current) -> bool:
                return (parent.commit, task.id) not in tried and not rebuilds(current, task, built)

            skilled = [t for t in self.planner.tasks_from_hints(parent.hints, current) if novel(t)]
            if skilled and self.rng.random() < 0.5:
                return parent, max(skilled, key=lambda t: (t.priority, t.id))
            composed = [t for t in self.planner.composition_tasks(current) if novel(t)]
            if composed and self.rng.random() < 0.5:
                return parent, self.rng.choice(composed)
            task = self.planner.perturbation(current)
            if task is not None and novel(task):
                return parent, task
            if skilled:
                return parent, max(skilled, key=lambda t: (t.priority, t.id))
        return None

    def observe(self, state: RunState, record: RoundRecord, params: dict) -> None:
        """The population is the accepted rounds in the state; nothing else to keep."""
