"""colocate: every device rolls out the whole batch, then every device trains, then rollout resumes.

Synchronous and on-policy (async ratio 0): the baseline the time-sharing work starts from. Between
rollout and training the cluster is suspended: engines sleep (their memory freed) while the trainer
holds the devices, and wake with the new weights on resume. The long tail of each batch idles every
device.
"""

from __future__ import annotations

from .controller_base import ControllerBase


class Colocate(ControllerBase):
    def _place(self, devices):
        return list(devices), list(devices)

    async def run(self, cluster, envs, steps: int) -> None:
        _, train = self.placement(cluster.devices)
        cluster, buffer, manager = self._wire(cluster, envs, async_ratio=0)
        for _ in range(steps):
            manager.launch(self.groups_per_step)
            batch = await buffer.next_batch(self.groups_per_step, self.version, lambda: None, manager.raise_if_failed)
            await cluster.suspend()
            await self._train(cluster, batch, train)
            await cluster.resume()  # engines wake with the new weights
        await self._finish(buffer, manager)
