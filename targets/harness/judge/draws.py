"""What the harness drew for a run's episodes, which no stack chose: the yardstick the selection net compares
what was trained against what was launched by (``selection_net.py``).

A stack decides how far each episode runs, so the lengths it records say as much about the stack as about
the episode: a member cancelled early looks short. The harness drew some lengths before any episode ran:
where the environment draws it, each episode's turn count (``drawn_turns``, from the episode's own seed,
in a real run as in a simulated one), and in a simulated run each turn's tokens (``ResponseLengths``: the
task's draw and the turn's). They are drawn again here from the run's seed and secret key, so an episode is
judged by what it was. A real run's tokens are the model's: only its turns are drawn.
"""

from __future__ import annotations

import random

from targets.harness.environments.base import drawn_turns
from targets.harness.environments.pool import group_of, numbers_of
from targets.harness.environments.seeds import RunSeed
from targets.harness.sim.response_length import ResponseLengths
from targets.spec import TargetSpec


class WorkloadDraws:
    def __init__(self, spec: TargetSpec, seed: RunSeed, relaunch_of: dict[str, str], simulated: bool) -> None:
        """``relaunch_of``: relaunched group -> the group whose task it runs again (the trace's)."""
        self.workload = spec.workload
        self.seed = seed
        self.relaunch_of = relaunch_of
        self.lengths = ResponseLengths(spec.workload.tokens, seed, self.task_of)
        self.draws_turns = spec.workload.turns.dist is not None  # the spec gives one exactly then
        self.draws_tokens = simulated  # a simulated turn's tokens are drawn (its whole budget without a spec)
        self.tasks_differ = simulated and spec.workload.tokens.response_length is not None

    def task_of(self, episode: str) -> str:
        group = group_of(episode)
        return self.relaunch_of.get(group, group)

    def task_tokens_a_turn(self, task: str) -> float | None:
        """A turn's mean tokens for ``task`` (named by the group that ran it first) given its draw; None
        where tasks are not drawn apart (a real run's, or every turn its whole budget)."""
        return self.lengths.expected_of_task(task) if self.tasks_differ else None

    def turns(self, episode: str) -> float | None:
        """The turns ``episode`` drew (at most: a timeout, a lost environment or a full context ends it
        sooner); None where the environment ends episodes by play."""
        if not self.draws_turns:
            return None
        index, member = numbers_of(episode)
        return float(drawn_turns(self.workload, random.Random(self.seed.episode(index, member))))

    def response_tokens(self, episode: str) -> float | None:
        """The tokens ``episode`` would generate over every turn it drew, were it let run; None unless both
        are drawn (a simulated run of an environment that draws its turns)."""
        turns = self.turns(episode) if self.draws_tokens else None
        if turns is None:
            return None
        return float(sum(self.lengths.of(episode, turn) for turn in range(int(turns))))
