"""Environment manager: trajectory-level asynchrony, one coroutine per episode.

Each episode alternates ``cluster.generate`` and ``env.step`` on its own schedule, so a slow tool
call or a long episode never holds others back. A turn whose engine was shrunk mid-request raises
``Aborted``; it is retried (the cluster routes it to a still-active engine), so the turn is neither
lost nor counted twice. Finished trajectories go to the group buffer.
"""

from __future__ import annotations

import asyncio

from targets.api import Aborted, Cluster, GenerateRequest, SamplingParams, Trajectory

from .sample_buffer import GroupBuffer


class EnvManager:
    def __init__(
        self, cluster: Cluster, envs, buffer: GroupBuffer, sampling: SamplingParams, max_sequence: int
    ) -> None:
        self.cluster, self.envs, self.buffer = cluster, envs, buffer
        self.sampling, self.max_sequence = sampling, max_sequence
        self.groups_in_flight = 0
        self._tasks: dict[asyncio.Task, str] = {}  # running episode coroutines -> episode id
        self._failure: BaseException | None = None

    def launch(self, groups: int) -> None:
        for _ in range(groups):
            episodes = self.envs.new_group()
            # VAL: VAL_NO_DUPLICATES (value=[e.episode_id for e in episodes])
            self.buffer.expect(episodes[0].group_id)
            self.groups_in_flight += 1
            remaining = [len(episodes)]
            for episode in episodes:
                task = asyncio.create_task(self._run_episode(episode, remaining))
                self._tasks[task] = episode.episode_id
                task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.pop(task, None)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()

    def raise_if_failed(self) -> None:
        """Surface an episode coroutine's crash in the controller instead of hanging on it."""
        if self._failure is not None:
            raise RuntimeError("an episode coroutine failed") from self._failure

    async def _run_episode(self, episode, remaining: list[int]) -> None:
        prompt = await episode.reset()
        t = Trajectory(
            episode.episode_id, episode.group_id, list(prompt), [0] * len(prompt), [0.0] * len(prompt), 0.0, []
        )
        turn = 0
        while True:
            if len(t.tokens) + self.sampling.max_new_tokens > self.max_sequence:
                self.envs.drop(episode.episode_id, "max_sequence")
                break
            # No copy of the context: the trajectory only grows after generate returns.
            request = GenerateRequest(episode.episode_id, turn, t.tokens, self.sampling)
            completion = await self._generate(request)
            result = await episode.step(completion.tokens)
            t.append_turn(completion, result)
            turn += 1
            if result.done:
                self.buffer.put(t)
                break
        remaining[0] -= 1
        if remaining[0] == 0:
            self.groups_in_flight -= 1

    async def _generate(self, request: GenerateRequest):
        while True:
            try:
                return await self.cluster.generate(request)
            except Aborted:
                continue  # the cluster routes the retry to a still-active engine

    async def cancel_all(self) -> None:
        """End of run: stop every episode still in flight and hand it back (reason ``end_of_run``)."""
        running = dict(self._tasks)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for episode_id in running.values():
            self.envs.drop(episode_id, "end_of_run")
