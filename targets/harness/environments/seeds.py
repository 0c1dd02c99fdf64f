"""What a run's workload is drawn from: a number and a secret.

The number is the caller's (runs of one number see the same tasks, so a paired comparison compares
like with like). The key is the harness's: drawn once per session, never shown to a candidate, it
keys every derivation, so no candidate can predict a task, an opening prompt or a simulated response
length from the number, nor recognise a check by its first observations. An empty key is the public
derivation (the reference loop, an exported launcher, a reproduction), the same as before keys
existed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class RunSeed:
    number: int
    key: bytes = b""

    def _keyed(self, *parts: object) -> int:
        text = "|".join(str(p) for p in (self.number, *parts)).encode()
        return int.from_bytes(hashlib.blake2b(text, key=self.key, digest_size=8).digest(), "little")

    def stream(self, name: str) -> int:
        """The seed of a random stream of the run's own, named ``name`` (a serving pool's arrivals)."""
        return self._keyed("stream", name) if self.key else self.number * 1_000_003 + len(name)

    def task(self, task: int) -> int:
        """The seed of task ``task`` (the ``task``-th group's, or the group a relaunch reruns)."""
        return self._keyed("task", task) if self.key else self.number * 1_000_003 + task

    def episode(self, index: int, member: int) -> int:
        """The seed of member ``member`` of group ``index``: a new episode, even of a relaunched task."""
        return (
            self._keyed("episode", index, member) if self.key else (self.number * 1_000_003 + index) * 131 + member + 1
        )
