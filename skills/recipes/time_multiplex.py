"""time_multiplex: every device samples until the batch is complete; then the training devices are
shrunk out of the rollout pool (their in-flight turns abort and retry elsewhere), train while the
other devices keep sampling the long tail and the next batch, and expand back with the new weights.

Rollout throughput approaches all devices' while training still gets dedicated devices; the price
is the shrink/expand switch (abort, offload, reload, weight load) once per step.
"""

from __future__ import annotations

from .controller_base import ControllerBase


class TimeMultiplex(ControllerBase):
    def placement(self, devices):
        # VAL: VAL_INT_RANGE (min=1, max=len(devices) - 1)
        n_train = self.params["train_devices"]
        return list(devices), list(devices[len(devices) - n_train :])

    async def run(self, cluster, envs, steps: int) -> None:
        rollout, train = self.placement(cluster.devices)
        sampling_only = [d for d in rollout if d not in train]
        buffer, manager = self._wire(cluster, envs, self.async_ratio)
        refill = self._refill(buffer, manager)
        for _ in range(steps):
            batch = await buffer.next_batch(self.groups_per_step, self.version, refill, manager.raise_if_failed)
            await cluster.shrink(train)
            version = await self._train(cluster, batch, train)
            await cluster.sync_weights(version, sampling_only)
            await cluster.expand(train)
        await self._finish(buffer, manager)
