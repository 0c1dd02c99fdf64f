"""colocate: every device rolls out the whole batch, then every device trains, then rollout resumes.

Synchronous and on-policy (async ratio 0): the baseline the time-sharing work starts from. Between
rollout and training the cluster is suspended: engines sleep (their memory freed) while the trainer
holds the devices, and wake with the new weights on resume. The long tail of each batch idles every
device.

With ``env_prestart`` (the technique of that name) the next step's groups are launched as soon as a batch
is taken, behind a gate the resume opens: their environments reset while the devices train, and they
generate only under the new weights, so every sample stays on-policy. They are in flight beside the batch
until its step begins, which a staleness bound of at least 1 allows (the audit's in-flight bound).
"""

from __future__ import annotations

import asyncio

from .controller_base import ControllerBase


class Colocate(ControllerBase):
    def __init__(self, runtime, params: dict) -> None:
        super().__init__(runtime, params)
        self.prestart = bool(params.get("env_prestart", 0))
        if self.prestart and self.async_ratio < 1:
            raise ValueError(
                "params env_prestart needs a staleness bound (async_ratio) of at least 1: the next step's groups "
                f"are in flight beside the batch until its step begins; this stack's is {self.async_ratio}"
            )

    def _place(self, devices):
        return list(devices), list(devices)

    async def run(self, cluster, envs, steps: int) -> None:
        _, train = self.placement(cluster.devices)
        cluster, buffer, manager = self._wire(cluster, envs, async_ratio=0)
        manager.launch(self.groups_per_step)
        for step in range(steps):
            batch = await buffer.next_batch(self.groups_per_step, self.version, lambda: None, manager.raise_if_failed)
            resumed = asyncio.Event() if self.prestart else None
            if resumed is not None and step + 1 < steps:
                manager.launch(self.groups_per_step, gate=resumed)  # they reset while the devices train
            await cluster.suspend()
            await self._train(cluster, batch, train)
            await cluster.resume()  # engines wake with the new weights
            if resumed is not None:
                resumed.set()
            elif step + 1 < steps:
                manager.launch(self.groups_per_step)
        await self._finish(buffer, manager)
