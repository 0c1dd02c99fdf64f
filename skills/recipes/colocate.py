"""colocate: every device rolls out the whole batch, then every device trains, then weights sync.

Synchronous and on-policy (async ratio 0): the baseline the time-sharing work starts from. Engines
stay resident while training (they are idle then); the long tail of each batch idles every device.
"""

from __future__ import annotations

from .controller_base import ControllerBase


class Colocate(ControllerBase):
    def placement(self, devices):
        return list(devices), list(devices)

    async def run(self, cluster, envs, steps: int) -> None:
        rollout, train = self.placement(cluster.devices)
        buffer, manager = self._wire(cluster, envs, async_ratio=0)
        for _ in range(steps):
            manager.launch(self.groups_per_step)
            batch = await buffer.next_batch(self.groups_per_step, self.version, lambda: None, manager.raise_if_failed)
            version = await self._train(cluster, batch, train)
            await cluster.sync_weights(version, rollout)
        await self._finish(buffer, manager)
