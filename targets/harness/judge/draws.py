"""What a simulated run's harness drew for its episodes, which no stack chose: the yardstick the selection
net compares what was trained against what was launched by (``selection.py``).

A stack decides how far each episode runs, so the lengths it records say as much about the stack as about
the episode: a member cancelled early looks short. The harness drew every length before any ran: a task's
tokens a turn (``ResponseLengths``) and, where the environment draws it, an episode's turn count
(``drawn_turns``, from the episode's own seed). Both are drawn again here from the run's seed and secret
key, so an episode is judged by what it was.
"""

from __future__ import annotations

import random

from targets.harness.environments.base import drawn_turns
from targets.harness.environments.pool import group_of, numbers_of
from targets.harness.environments.seeds import RunSeed
from targets.harness.sim.response_length import ResponseLengths
from targets.spec import TargetSpec


class WorkloadDraws:
    def __init__(self, spec: TargetSpec, seed: RunSeed, relaunch_of: dict[str, str]) -> None:
        """``relaunch_of``: relaunched group -> the group whose task it runs again (the trace's)."""
        self.workload = spec.workload
        self.seed = seed
        self.relaunch_of = relaunch_of
        self.lengths = ResponseLengths(spec.workload.tokens, seed, self.task_of)
        self.draws_turns = spec.workload.turns.dist is not None  # the spec gives one exactly then

    def task_of(self, episode: str) -> str:
        group = group_of(episode)
        return self.relaunch_of.get(group, group)

    def task_tokens_a_turn(self, task: str) -> float:
        """A turn's mean tokens for ``task`` (named by the group that ran it first) given its draw."""
        return self.lengths.expected_of_task(task)

    def turns(self, episode: str) -> int:
        """The turns ``episode`` drew (only where the environment draws them)."""
        index, member = numbers_of(episode)
        return drawn_turns(self.workload, random.Random(self.seed.episode(index, member)))

    def response_tokens(self, episode: str) -> float | None:
        """The tokens ``episode`` would generate over every turn it drew, were it let run (at most: a full
        context or a timeout ends an episode sooner); None where the environment ends episodes by play."""
        if not self.draws_turns:
            return None
        return float(sum(self.lengths.of(episode, turn) for turn in range(self.turns(episode))))
