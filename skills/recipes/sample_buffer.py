"""Group queue: finished trajectories gathered by GRPO group; a batch is whole groups, the oldest
created first (never the quickest to finish: choosing by length would bias training toward short
episodes, and the audit rejects it).

The staleness bound is enforced when a batch is taken: a group holding a turn generated more than
``async_ratio`` versions before the current policy is dropped whole (handed back to the harness with
the reason ``stale``, so it is counted, not lost, and its task runs again: ``on_stale``); at the end of
a run everything still waiting is handed back with ``end_of_run``. A member that finishes after its
group is complete (a spare of a group launched with redundancy) is handed back as ``redundant``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from targets.api import Trajectory


class GroupBuffer:
    def __init__(self, group_size: int, async_ratio: int, envs) -> None:
        self.group_size, self.async_ratio, self.envs = group_size, async_ratio, envs
        self._partial: dict[str, list[Trajectory]] = {}
        self._ready: dict[str, list[Trajectory]] = {}
        self._rank: dict[str, int] = {}  # group -> creation order
        self._complete: set[str] = set()  # groups that reached group_size finished members
        self.streamed = 0  # groups taken as parts of the step not yet trained (stream training)
        self._changed = asyncio.Event()
        self.on_complete: Callable[[str], None] = lambda group_id: None  # the manager cancels spares here
        self.on_batch: Callable[[], None] = lambda: None  # a batch was taken (the manager defers tails here)
        self.on_stale: Callable[[str], None] = lambda group_id: None  # the manager relaunches its task here

    def expect(self, group_id: str) -> None:
        """A group was just created: its place in the creation order."""
        self._rank[group_id] = len(self._rank)

    def put(self, trajectory: Trajectory) -> None:
        if trajectory.group_id in self._complete:
            self.envs.drop(trajectory.episode_id, "redundant")
            return
        group = self._partial.setdefault(trajectory.group_id, [])
        group.append(trajectory)
        if len(group) == self.group_size:
            self._ready[trajectory.group_id] = self._partial.pop(trajectory.group_id)
            self._complete.add(trajectory.group_id)
            self.on_complete(trajectory.group_id)
            self._changed.set()

    @property
    def ready_groups(self) -> int:
        return len(self._ready)

    def drop_stale(self, policy_version: int) -> int:
        """Drop ready groups too old for a step from ``policy_version``; returns how many."""
        stale = [
            g for g, ts in self._ready.items() if policy_version - min(t.oldest_version for t in ts) > self.async_ratio
        ]
        for group_id in stale:
            for t in self._ready.pop(group_id):
                self.envs.drop(t.episode_id, "stale")
            self.on_stale(group_id)
        return len(stale)

    def drop_group(self, group_id: str, reason: str) -> None:
        """Hand back a group's finished members (its running ones are the manager's to stop)."""
        for t in self._partial.pop(group_id, []):
            self.envs.drop(t.episode_id, reason)

    def drop_all(self, reason: str) -> None:
        """End of run: hand back every trajectory still waiting (finished or partial groups)."""
        for groups in (self._ready, self._partial):
            for trajectories in groups.values():
                for t in trajectories:
                    self.envs.drop(t.episode_id, reason)
            groups.clear()

    async def next_batch(
        self, groups: int, policy_version: int, refill: Callable[[], None], check: Callable[[], None]
    ) -> list[Trajectory]:
        """Wait for ``groups`` fresh groups and take them, oldest first.

        ``refill`` is called whenever groups finish or are dropped (to keep episodes in flight);
        ``check`` raises if the episodes' coroutines failed, so a crash surfaces instead of a hang.
        """
        await self.wait_ready(groups, policy_version, refill, check)
        self.streamed = 0  # a streamed step's parts are trained with this, the rest of its batch
        batch = self._oldest(groups)
        # VAL: AST_POSTCONDITION (cond=len(batch) == groups * self.group_size)
        self.on_batch()
        return batch

    def take_part(self, groups: int) -> list[Trajectory]:
        """A part of a streamed step: still the step's until it trains (``streamed``, which ``refill``
        counts as waiting: the next batch's groups start when this one is taken whole, not sooner)."""
        self.streamed += groups
        return self._oldest(groups)

    def _oldest(self, groups: int) -> list[Trajectory]:
        taken: list[Trajectory] = []
        for group_id in sorted(self._ready, key=self._rank.__getitem__)[:groups]:
            taken.extend(self._ready.pop(group_id))
        return taken

    def wake(self) -> None:
        """Something a waiting batch must look at again happened elsewhere: a group was handed back
        (its place can be refilled), or an episode coroutine failed (``check`` raises)."""
        self._changed.set()

    async def wait_ready(
        self, groups: int, policy_version: int, refill: Callable[[], None], check: Callable[[], None]
    ) -> None:
        """Wait until ``groups`` fresh groups are ready (taking none); look again whenever a group
        completes or the buffer is woken, never on a timer (a poll would wake the controller for
        nothing, and leave a handed-back group's place empty until it came round)."""
        while True:
            check()
            self.drop_stale(policy_version)
            refill()
            if len(self._ready) >= groups:
                break
            self._changed.clear()
            await self._changed.wait()
