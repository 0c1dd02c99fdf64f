"""backlog: an issue tracker of structured tasks. Every round starts from the best candidate and takes the
highest-priority task not yet tried on it and not abandoned anywhere in the run (rejected, or measured
without gain on a best: the plan's ABANDONED steps); the evaluator's hints (through the planner's skill
triggers) add tasks. A controller switch measured without gain is first followed once by the technique
its own findings call for most, on top of it. A parameter move without gain queues no further step
of that parameter from its findings (``moved_parameter``). When the backlog runs dry, the planner composes techniques
(adds one, or removes one: additions first). A near miss (a gain inside the noise on an earlier best;
``RunState.near_misses``) is not abandoned at once: it waits until the additions never tried have run on
this best, is tried once more before the removals, and a second near miss gives it up. So is a
controller switch that lost by at most ``SWITCH_RETRY_WITHIN``: once more on a later best, carrying the
techniques that best gained, after the near misses. Then a parameter moves (in an order the run's seed
shuffles), and last a composition, then a parameter move, abandoned on an earlier best is retried on
this one, where the rest of the set may now favour it: the run stops on its budget while any of these is
untried on the best. A task whose result is a configuration the run built already is skipped."""

from __future__ import annotations

import random

from agents.roles import Task
from orchestrator.policies.novelty import built_configurations, rebuilds
from orchestrator.state import RoundRecord, RunState

# A controller switch that lost by at most this much is tried on one later best again: a controller pays with
# the techniques that suit it, and the later best carries some (at paper scale, time_multiplex came out -1.4%
# on the starter and was given up; with the host tier the search later found it is 1.44x colocate:
# benchmarks/results/simulated-generalization.yaml). One seed's ratio is noisy: time_multiplex over colocate
# read -12% and -1.4% on two runs' first seeds, 0.94-1.14 over a bench's three. One that lost by more than
# this (the static split's -75%) is not tried again.
SWITCH_RETRY_WITHIN = 0.25
SWITCH_TRIES = 2  # tries of one controller switch in a run, at most


class BacklogPolicy:
    name = "backlog"

    def __init__(self, planner, seed: int) -> None:
        self.planner, self.seed = planner, seed

    def propose(self, state: RunState, params_of) -> tuple[RoundRecord, Task] | None:
        parent = state.best
        if parent is None:
            return None
        params = params_of(parent)
        tried, abandoned = state.tried(), state.abandoned()
        near = state.near_misses()
        retrying = {r.task.id for r in near}
        built = built_configurations(state, params_of)

        def fresh(task: Task) -> bool:
            """Not tried on this parent, not given up on, still meaning what it says on this parent (a task
            queued under an earlier best may add a technique this one has on), and not a configuration the
            run built already."""
            given_up = (parent.commit, task.id) in tried or task.id in abandoned
            return (
                not given_up
                and self.planner.applies(task, params)
                and not rebuilds(params, task, built, self.planner.default)
            )

        follow_up = self._follow_up(state, params_of, tried, built)
        if follow_up is not None:
            return follow_up
        for task in sorted(state.backlog, key=lambda t: (-t.priority, t.id)):
            task = self.planner.as_on(task, params)  # a switch queued under an earlier best, written for this one
            if task.id not in retrying and fresh(task):
                return parent, task
        compositions = sorted(self.planner.composition_tasks(params), key=lambda t: (-t.priority, t.id))
        # a near miss as this parent's planner writes it (the task its round ran where it writes none)
        by_id = {t.id: t for t in compositions}
        near_misses = [by_id.get(r.task.id, r.task) for r in near]
        additions = [t for t in compositions if t.id.startswith("add-") and t.id not in retrying]
        removals = [t for t in compositions if t.id.startswith("remove-") and t.id not in retrying]
        for task in [*additions, *near_misses]:
            if fresh(task):
                return parent, task
        switch = self._switch_again(state, parent, params, tried, built)
        if switch is not None:
            return parent, switch
        for task in removals:
            if fresh(task):
                return parent, task
        moves = self.planner.parameter_moves(params)
        random.Random(f"{self.seed}/{parent.commit}").shuffle(moves)  # the same order when a run resumes
        for task in moves:
            if fresh(task):
                return parent, task
        for task in [*compositions, *moves]:
            if (parent.commit, task.id) not in tried and not rebuilds(params, task, built, self.planner.default):
                return parent, task  # given up on under another best, never tried on this one
        return None

    def _follow_up(self, state: RunState, params_of, tried: set, built: list) -> tuple[RoundRecord, Task] | None:
        """A controller switch that lost is followed once by the technique its own findings call for
        most, on top of it: a controller is rarely worth it alone (time-multiplexing pays on a
        long-CoT target only with partial rollout hiding its syncs' drains), and greedy steps from the
        best would never come back to it."""
        for record in state.accepted():
            if not record.task.id.startswith("controller=") or record.became_best or not record.commit:
                continue
            if any(r.parent_commit == record.commit and r.verdict != "error" for r in state.rounds):
                continue  # followed up already (a follow-up that ended in an error, never judged, is tried again)
            params = params_of(record)
            tasks = [
                t
                for t in self.planner.tasks_from_hints(record.hints, params)
                if t.id.startswith("add-")
                and self.planner.applies(t, params)
                and (record.commit, t.id) not in tried
                and not rebuilds(params, t, built, self.planner.default)
            ]
            if tasks:  # of equal priority, the one the planner ranks first (max keeps the first)
                return record, max(tasks, key=lambda t: t.priority)
        return None

    def _switch_again(self, state: RunState, parent: RoundRecord, params: dict, tried: set, built: list) -> Task | None:
        """A controller switch that lost narrowly on an earlier best, written for this one (its techniques
        kept, those the new controller cannot run switched off), while it has had fewer than ``SWITCH_TRIES``."""
        for record in state.accepted():
            task, paired = record.task, record.paired
            if not task.id.startswith("controller=") or record.became_best or paired is None:
                continue
            if paired.ratio < 1 - SWITCH_RETRY_WITHIN:
                continue
            if sum(1 for r in state.rounds if r.task.id == task.id and r.verdict != "error") >= SWITCH_TRIES:
                continue
            task = self.planner.as_on(task, params)
            if (
                (parent.commit, task.id) not in tried
                and self.planner.applies(task, params)
                and not rebuilds(params, task, built, self.planner.default)
            ):
                return task
        return None

    def observe(self, state: RunState, record: RoundRecord, params: dict) -> None:
        known = {t.id for t in state.backlog}
        if record.verdict == "accepted":
            stepped = set() if record.became_best else moved_parameter(record.task)
            for task in self.planner.tasks_from_hints(record.hints, params):
                if moved_parameter(task) & stepped:
                    continue  # a step that gained nothing is not stepped on from (tail_round 16 -> 64, 7 rounds)
                if task.id not in known:
                    # queued now, taken rounds later: its finding is this round's, said so beside a later parent's
                    found = task.model_copy(update={"rationale": f"round {record.round} found: {task.rationale}"})
                    state.backlog.append(found)
                    known.add(task.id)


def moved_parameter(task: Task) -> set[str]:
    """The parameter a move task sets (its id is ``name=value``), or none: a hint moves a parameter one way
    (``PARAM_MOVES``), so the candidate a move made, measured without gain, hints the next step the same
    way; queued for the best, that step is taken as a jump from it, and so on while each lands in the noise
    (the paper-scale search at 36efac4 spent seven rounds taking tail_round 16 -> 64, each within 1%)."""
    name = task.id.partition("=")[0]
    return {name} if name in task.changes and name != "controller" else set()
