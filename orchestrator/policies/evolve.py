"""evolve: a population of validated candidates. The parent is the fitter of two drawn at random
(tournament selection on the headline metric over the starter's, chained through the paired comparisons:
``fitness``), or with ``selection="pareto"`` one drawn from the Pareto
front of the headline and the trained tokens a second (no other member is at least as good in both and
better in one): goodput counts trajectories, so a schedule that trains only the short ones can gain on it
while training fewer tokens, and the front keeps the members that give up neither. The mutation applies
a skill its hints triggered, adds or removes a technique, or perturbs one parameter. A mutation whose
result is a near-duplicate of a configuration the run already built (from any parent: adding A then B is
B then A, and moving a parameter back is its grandparent) is not tried again. Deterministic for a seed."""

from __future__ import annotations

import random
from collections.abc import Callable

from agents.roles import Task
from orchestrator.policies.novelty import built_configurations, rebuilds
from orchestrator.state import RoundRecord, RunState


class EvolvePolicy:
    name = "evolve"

    def __init__(self, planner, seed: int, selection: str = "fitness") -> None:
        self.planner, self.seed, self.selection = planner, seed, selection
        self.rng = random.Random(seed)

    def _seeded(self, state: RunState) -> None:
        """A round's draws from the run's seed and the round alone (as the backlog's): a resumed run
        proposes what the run would have, its generator being rebuilt from the seed."""
        self.rng = random.Random(f"{self.seed}/{len(state.rounds)}")  # the round it proposes for

    def _sign(self) -> int:
        return 1 if self.planner.spec.headline_metric.direction == "maximize" else -1

    def _select(self, state: RunState) -> RoundRecord | None:
        fit = fitness(state, self._sign())
        population = [r for r in state.accepted() if r.round in fit]
        if not population:
            return None
        if self.selection == "pareto":
            return self.rng.choice(pareto_front(population, fit))
        contenders = self.rng.sample(population, min(2, len(population)))
        return max(contenders, key=lambda r: fit[r.round])

    def propose(self, state: RunState, params_of: Callable[[RoundRecord], dict]) -> tuple[RoundRecord, Task] | None:
        self._seeded(state)
        tried = state.tried()
        cache: dict[str, dict] = {}

        def params(record: RoundRecord) -> dict:
            if record.commit not in cache:
                cache[record.commit] = params_of(record)
            return cache[record.commit]

        built = built_configurations(state, params)

        def mutations(parent: RoundRecord) -> tuple[list[Task], list[Task], list[Task]]:
            """What is new from ``parent``: the tasks its hints trigger, compositions, parameter moves."""
            current = params(parent)

            def novel(task: Task) -> bool:
                return (parent.commit, task.id) not in tried and not rebuilds(
                    current, task, built, self.planner.default
                )

            skilled = [t for t in self.planner.tasks_from_hints(parent.hints, current) if novel(t)]
            composed = [t for t in self.planner.composition_tasks(current) if novel(t)]
            moved = [t for t in self.planner.parameter_moves(current) if novel(t)]
            return skilled, composed, moved

        for _ in range(20):
            parent = self._select(state)
            if parent is None:
                return None
            skilled, composed, moved = mutations(parent)
            if skilled and self.rng.random() < 0.5:
                return parent, max(skilled, key=lambda t: t.priority)
            if composed and self.rng.random() < 0.5:
                return parent, self.rng.choice(composed)
            if moved:  # a move that is new: one drawn from all moves was mostly one already tried
                return parent, self.rng.choice(moved)
            if skilled:
                return parent, max(skilled, key=lambda t: t.priority)
        # the tournament never draws the least fit, and may have drawn only parents with nothing new: the
        # run ends on its budget, not while a member of the population has an untried mutation
        fit = fitness(state, self._sign())
        for parent in sorted(state.accepted(), key=lambda r: -fit.get(r.round, 0.0)):
            skilled, composed, moved = mutations(parent)
            if skilled or composed or moved:
                return parent, (skilled or composed or moved)[0]
        return None

    def observe(self, state: RunState, record: RoundRecord, params: dict) -> None:
        """The population is the accepted rounds in the state; nothing else to keep."""


TOKENS = "trained_tokens_per_s"  # the second objective: trained response tokens a second


def fitness(state: RunState, sign: int) -> dict[int, float]:
    """Each validated round's headline over the starter's, >1 better whatever the metric's direction,
    chained through the paired comparisons: a round's paired ratio over the best it was measured beside,
    times that best's own. A round's headline is the median over its own seeds, which change every round:
    compared across rounds, a member that drew an easy workload beat the true best (the pair exists to
    remove that noise). A round recorded without its pair counts its headline over that best's (``sign``:
    +1 where the metric is maximized)."""
    fit: dict[int, float] = {}
    best: RoundRecord | None = None
    for record in sorted(state.accepted(), key=lambda r: r.round):
        if record.headline is None:
            continue
        if best is None:  # the starter
            fit[record.round] = 1.0
        elif record.paired is not None:
            fit[record.round] = fit[best.round] * record.paired.ratio
        else:
            fit[record.round] = fit[best.round] * (record.headline / best.headline) ** sign
        if best is None or record.became_best:
            best = record
    return fit


def pareto_front(population: list[RoundRecord], fit: dict[int, float]) -> list[RoundRecord]:
    """The members no other one dominates in (``fitness``, trained tokens a second), in round order; a
    round without the tokens figure counts 0 there (the tokens are its own seeds' median: no pair says
    them on the best's seeds)."""

    def objectives(record: RoundRecord) -> tuple[float, float]:
        return fit[record.round], float(record.metrics.get(TOKENS, 0.0))

    def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return a[0] >= b[0] and a[1] >= b[1] and a != b

    points = [objectives(r) for r in population]
    return [r for r, p in zip(population, points, strict=True) if not any(dominates(q, p) for q in points)]
