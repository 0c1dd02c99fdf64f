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

Overlapped sync (``overlap_sync``, the ``overlap_sync`` technique): the sampling-only engines' sync
and the training devices' expand run at once, so the freed devices are serving again while the
sampling-only engines still drain their running turns for the new weights.
"""

from __future__ import annotations

import asyncio
import math

from .controller_base import ControllerBase


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
        outstanding = self.groups_per_step * (1 + buffer.async_ratio)
        for _ in range(steps):
            early = []
            if shrink_at < 1.0:
                ready = math.ceil(shrink_at * self.groups_per_step)
                await buffer.wait_ready(ready, self.version, refill, manager.raise_if_failed)
                demand = manager.groups_in_flight / outstanding
                freed = len(rollout) - math.ceil(demand * len(rollout))
                early = train[: max(0, min(len(train), freed))]
                if early:
                    await cluster.shrink(early)
            batch = await buffer.next_batch(self.groups_per_step, self.version, refill, manager.raise_if_failed)
            await cluster.shrink([d for d in train if d not in early])
            version = await self._train(cluster, batch, train)
            sync = cluster.sync_weights(version, sampling_only, interrupt=self.partial_rollout)
            if self.params.get("overlap_sync", 0):
                await asyncio.gather(sync, cluster.expand(train))
            else:
                await sync
                await cluster.expand(train)
        await self._finish(buffer, manager)
