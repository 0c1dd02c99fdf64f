"""static_split: disjoint pools. Rollout devices sample continuously (up to ``async_ratio`` versions
ahead); training devices train whenever a batch is ready; weights sync to the rollout pool after
each step (with ``partial_rollout`` the turns running then are interrupted and resume under the new
weights). Rollout throughput is capped by the rollout pool, and training devices idle while they
wait for data."""

from __future__ import annotations

from .controller_base import ControllerBase


class StaticSplit(ControllerBase):
    def _place(self, devices):
        # VAL: VAL_INT_RANGE (min=1, max=len(devices) - 1)
        n_rollout = self.params["rollout_devices"]
        # VAL: VAL_INT_RANGE (min=1, max=len(devices) - n_rollout)
        n_train = self.params["train_devices"]
        return list(devices[:n_rollout]), list(devices[n_rollout : n_rollout + n_train])

    async def run(self, cluster, envs, steps: int) -> None:
        rollout, train = self.placement(cluster.devices)
        cluster, buffer, manager = self._wire(cluster, envs, self.async_ratio)
        refill = self._refill(buffer, manager)
        for _ in range(steps):
            batch = await buffer.next_batch(self.groups_per_step, self.version, refill, manager.raise_if_failed)
            version = await self._train(cluster, batch, train)
            await cluster.sync_weights(version, rollout, interrupt=self.partial_rollout)
        await self._finish(buffer, manager)
