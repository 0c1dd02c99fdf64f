"""How many tokens a simulated turn generates: long-tailed, and persistent per task.

The spec's ``tokens.response_length`` gives a lognormal cut at the turn's budget ``B``
(``tokens.response``): a turn of episode ``e`` in group ``g`` generates
``min(B, max(1, round(exp(mu + task_sigma * z_g + turn_sigma * z_(e,turn)))))`` tokens, with
``z_g`` one standard normal per task (every member of a group and every turn of its episodes share
it, and so does a group that runs a deferred group's task again: a hard task is long each time) and
``z_(e,turn)`` one per turn. Both are drawn from the run's seed (and secret key) and the names alone
(``standard_normal``), so a retried or resumed turn, on any engine, is the same length. ``mu`` is
solved (bisection) so that the mean after the cut is the spec's ``mean``:
``E[min(B, X)] = exp(mu + s^2/2) * Phi((ln B - mu - s^2) / s) + B * (1 - Phi((ln B - mu) / s))``
with ``s^2 = task_sigma^2 + turn_sigma^2``.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable

from targets.harness.environments.pool import group_of
from targets.harness.environments.seeds import RunSeed
from targets.spec import TokensSpec

_UNIFORMS = struct.Struct("<QQ")


def standard_normal(name: str, key: bytes = b"") -> float:
    """A standard normal draw that is a function of ``name`` (and the run's secret ``key``) alone: two
    uniforms from its BLAKE2b hash, through Box-Muller (seeding a ``random.Random`` from a string, as
    this did, cost 6 µs a turn)."""
    high, low = _UNIFORMS.unpack(hashlib.blake2b(name.encode(), key=key, digest_size=16).digest())
    u1, u2 = (high >> 11) * 2.0**-53, (low >> 11) * 2.0**-53  # each in [0, 1), 53 random bits
    return math.sqrt(-2.0 * math.log1p(-u1)) * math.cos(2.0 * math.pi * u2)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def truncated_mean(mu: float, sigma: float, budget: float) -> float:
    """Mean of ``min(budget, X)`` for ``X`` lognormal(mu, sigma)."""
    if sigma == 0:
        return min(budget, math.exp(mu))
    log_b = math.log(budget)
    below = math.exp(mu + sigma**2 / 2) * _phi((log_b - mu - sigma**2) / sigma)
    return below + budget * (1.0 - _phi((log_b - mu) / sigma))


class ResponseLengths:
    def __init__(self, tokens: TokensSpec, seed: int | RunSeed, task_of: Callable[[str], str] = group_of) -> None:
        """``task_of``: the task an episode id runs (the harness's pool knows; by default its group)."""
        seed = seed if isinstance(seed, RunSeed) else RunSeed(seed)
        self.key = seed.key
        self.task_of = task_of
        spec = tokens.response_length
        self.budget = tokens.response
        self.seed = seed.number
        self.spec = spec
        self._z_task: dict[str, float] = {}  # one draw per task, made once
        self._z_of_episode: dict[str, float] = {}  # the same, by episode (finding an episode's task is dearer)
        if spec is None:
            return
        sigma = math.hypot(spec.task_sigma, spec.turn_sigma)
        low, high = -10.0, math.log(self.budget) + 10 * sigma + 1
        for _ in range(200):  # the truncated mean rises with mu
            mid = (low + high) / 2
            low, high = (mid, high) if truncated_mean(mid, sigma, self.budget) < spec.mean else (low, mid)
        self.mu = (low + high) / 2

    def z_of_task(self, task: str) -> float:
        """Task ``task``'s draw (``g<k>``, the group that first ran it): a hard task is long each time."""
        z_task = self._z_task.get(task)
        if z_task is None:
            z_task = self._z_task[task] = standard_normal(f"{self.seed}|task|{task}", self.key)
        return z_task

    def expected_of_task(self, task: str) -> float:
        """The mean tokens of a turn of ``task`` given its draw (the turn's own draw averaged out): what
        the audit compares the tasks trained by, whatever the stack let them run to."""
        if self.spec is None:
            return float(self.budget)
        return truncated_mean(self.mu + self.spec.task_sigma * self.z_of_task(task), self.spec.turn_sigma, self.budget)

    def of(self, episode_id: str, turn: int) -> int:
        """The tokens turn ``turn`` of ``episode_id`` generates, its whole budget without a spec."""
        if self.spec is None:
            return self.budget
        z_task = self._z_of_episode.get(episode_id)
        if z_task is None:
            z_task = self._z_of_episode[episode_id] = self.z_of_task(self.task_of(episode_id))
        z_turn = standard_normal(f"{self.seed}|turn|{episode_id}|{turn}", self.key)
        tokens = math.exp(self.mu + self.spec.task_sigma * z_task + self.spec.turn_sigma * z_turn)
        return min(self.budget, max(1, round(tokens)))
