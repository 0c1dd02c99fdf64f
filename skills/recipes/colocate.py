"""colocate: every device rolls out the whole batch, then every device trains, then rollout resumes.

Synchronous and on-policy (async ratio 0): the baseline the time-sharing work starts from. Between
rollout and training the cluster is suspended: engines sleep (their memory freed) while the trainer
holds the devices, and wake with the new weights on resume. The long tail of each batch idles every
device.

With ``env_prestart`` (the technique of that name) the next step's groups are launched once a share
``prestart_at`` of the batch's groups is ready (1: as the batch is taken; 0: as its rollout starts), behind a
gate the resume opens: their environments reset while the batch's tail rolls out and the devices train, and
they generate only under the new weights, so every sample stays on-policy. They are in flight beside the
batch until its step begins, which the stack declares (``Declared.env_prestart``: the audit's in-flight bound
allows a step's groups more; its staleness bound stays the stack's).
"""

from __future__ import annotations

import asyncio
import math

from .controller_base import ControllerBase


class Colocate(ControllerBase):
    def __init__(self, runtime, params: dict) -> None:
        super().__init__(runtime, params)
        prestart = params.get("env_prestart", 0)
        if isinstance(prestart, bool) or prestart not in (0, 1):  # build's range check comes after: named here
            raise ValueError(f"params env_prestart must be 0 (off) or 1 (on), got {prestart!r}")
        self.prestart = prestart == 1
        # the batch's groups ready when the next step's are launched (their resets then overlap the tail)
        prestart_at = params.get("prestart_at", 1.0)
        if isinstance(prestart_at, bool) or not isinstance(prestart_at, int | float) or not 0 <= prestart_at <= 1:
            raise ValueError(
                f"params prestart_at must be a number within [0, 1] (1: as the batch is taken), got {prestart_at!r}"
            )
        self.prestart_ready = math.ceil(prestart_at * self.groups_per_step)

    def _place(self, devices):
        return list(devices), list(devices)

    async def run(self, cluster, envs, steps: int) -> None:
        _, train = self.placement(cluster.devices)
        cluster, buffer, manager = self._wire(cluster, envs, async_ratio=0)
        manager.launch(self.groups_per_step)
        for step in range(steps):
            resumed = asyncio.Event() if self.prestart and step + 1 < steps else None
            refill = self._prestart(buffer, manager, resumed)
            batch = await buffer.next_batch(self.groups_per_step, self.version, refill, manager.raise_if_failed)
            await cluster.suspend()
            await self._train(cluster, batch, train)
            await cluster.resume()  # engines wake with the new weights
            if resumed is not None:
                resumed.set()
            elif step + 1 < steps and not self.prestart:
                manager.launch(self.groups_per_step)
        await self._finish(buffer, manager)

    def _prestart(self, buffer, manager, gate: asyncio.Event | None):
        """The refill a batch's wait calls as its groups complete: once ``prestart_ready`` of them are ready, it
        launches the next step's groups behind ``gate`` (once; never without a gate)."""
        launched = False

        def refill() -> None:
            nonlocal launched
            if gate is not None and not launched and buffer.ready_groups >= self.prestart_ready:
                manager.launch(self.groups_per_step, gate=gate)
                launched = True

        return refill
