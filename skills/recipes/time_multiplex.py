"""time_multiplex: every device samples until the batch is complete; then the training devices are
shrunk out of the rollout pool (their in-flight turns abort and retry elsewhere), train while the
other devices keep sampling the long tail and the next batch, and expand back with the new weights.

Rollout throughput approaches all devices' while training still gets dedicated devices; the price
is the shrink/expand switch (abort, offload, reload, weight load) once per step.

Progress-triggered partial shrink (``shrink_at`` < 1, the ``progress_shrink`` technique): once that
fraction of the batch's groups is ready, the training devices the remaining demand no longer needs
are shrunk early (their switch overlaps the batch's tail); the rest follow when the batch is
complete. Demand is the share of the outstanding groups still running.

Partial rollout (``partial_rollout``, the ``partial_rollout`` technique): the turns the shrink
interrupts resume from what they decoded, and the sampling-only engines' sync interrupts their
running turns instead of waiting for them (they resume under the new weights).

Stream training (``stream_train``, the ``stream_training`` technique, with ``shrink_at``): when the
partial shrink frees every training device (the remaining demand needs none of them), they train the
ready groups as parts of the step (``Cluster.train_part``), oldest first, while the rest of the batch
still decodes; the groups that complete the batch are the step's own, so its last call computes only
them. When it frees fewer, the step is progress_shrink's.

Overlapped sync (``overlap_sync``, the ``overlap_sync`` technique): the sampling-only engines' sync
and the training devices' expand run at once, so the freed devices are serving again while the
sampling-only engines still drain their running turns for the new weights.
"""

from __future__ import annotations

import asyncio
import math

from targets.api import TrainBatch

from .controller_base import ControllerBase, group_advantages


class TimeMultiplex(ControllerBase):
    def _place(self, devices):
        # VAL: VAL_INT_RANGE (min=1, max=len(devices) - 1)
        n_train = self.params["train_devices"]
        return list(devices), list(devices[len(devices) - n_train :])

    async def run(self, cluster, envs, steps: int) -> None:
        rollout, train = self.placement(cluster.devices)
        sampling_only = [d for d in rollout if d not in train]
        cluster, buffer, manager = self._wire(cluster, envs, self.async_ratio)
        refill = self._refill(buffer, manager)
        shrink_at = self.params.get("shrink_at", 1.0)
        if not 0.05 <= shrink_at <= 1.0:
            raise ValueError(f"params shrink_at must be within [0.05, 1.0] (1.0: off), got {shrink_at}")
        stream = bool(self.params.get("stream_train", 0))
        if stream and shrink_at >= 1.0:
            raise ValueError("params stream_train needs shrink_at < 1.0 (progress_shrink): when training may start")
        for _ in range(steps):
            version = await self._step(cluster, buffer, manager, refill, rollout, train, shrink_at, stream)
            sync = cluster.sync_weights(version, sampling_only, interrupt=self.partial_rollout)
            if self.params.get("overlap_sync", 0):
                await asyncio.gather(sync, cluster.expand(train))
            else:
                await sync
                await cluster.expand(train)
        await self._finish(buffer, manager)

    def _freed(self, manager, buffer, rollout) -> int:
        """How many rollout devices the remaining demand no longer needs (progress_shrink's rule):
        demand is the share of the outstanding groups still running."""
        demand = manager.groups_in_flight / (self.groups_per_step * (1 + buffer.async_ratio))
        return len(rollout) - math.ceil(demand * len(rollout))

    async def _step(self, cluster, buffer, manager, refill, rollout, train, shrink_at: float, stream: bool) -> int:
        """One step trained once its batch is complete (with ``shrink_at`` < 1, the training devices
        the remaining demand frees are shrunk early), or streamed when that freed all of them."""
        early = []
        if shrink_at < 1.0:
            await buffer.wait_ready(
                math.ceil(shrink_at * self.groups_per_step), self.version, refill, manager.raise_if_failed
            )
            early = train[: max(0, min(len(train), self._freed(manager, buffer, rollout)))]
            if early:
                await cluster.shrink(early)
        if stream and len(early) == len(train):
            return await self._streamed(cluster, buffer, manager, refill, train)
        batch = await buffer.next_batch(self.groups_per_step, self.version, refill, manager.raise_if_failed)
        await cluster.shrink([d for d in train if d not in early])
        return await self._train(cluster, batch, train)

    async def _streamed(self, cluster, buffer, manager, refill, train) -> int:
        """The rest of the step on training devices rollout no longer needs: the ready groups train as
        a part, whatever is ready when a part ends makes the next, and the groups that complete the
        batch are the step's own."""
        taken = 0
        while True:  # waiting drops stale groups and refills, as for a batch taken whole
            await buffer.wait_ready(1, self.version, refill, manager.raise_if_failed)
            ready = buffer.ready_groups
            if taken + ready >= self.groups_per_step:
                rest = self.groups_per_step - taken
                batch = await buffer.next_batch(rest, self.version, refill, manager.raise_if_failed)
                return await self._train(cluster, batch, train)
            part = buffer.take_part(ready)
            taken += ready
            await cluster.train_part(TrainBatch(part, group_advantages(part)), train)
