"""A real run's serving pool in front of the candidate's cluster (ROSE-like CPU targets).

The pool's production traffic is the harness's (``sim/serving.py``, on the run's wall clock): the
harness serves it on the serving devices not lent, by the serving model's cost model, and measures
every request against the SLOs. What is real is the lending: the candidate's engines on the serving
devices (``Runtime.serving_devices``) sleep until an ``expand`` borrows their device, roll out while
it is lent, and sleep again at the ``shrink`` that gives it back. The gate keeps the two in order,
as the simulated cluster does: a borrow first drains the device's serving requests and only then
wakes the candidate's engine there; a give-back returns the device to the traffic only once the
candidate's engine there is asleep. No trainer may use a serving device.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from targets.api import Completion, Device, GenerateRequest, ServingLoad, TrainBatch
from targets.harness.ipc.remote import RemoteCluster
from targets.harness.sim.serving import ServingPool
from targets.harness.trace import Trace


class ServingGate:
    """The candidate's cluster (``inner``) with the harness's serving pool beside it."""

    def __init__(self, inner: RemoteCluster, pool: ServingPool, serving_devices: Sequence[Device]) -> None:
        self.inner, self.pool = inner, pool
        self.devices = [*inner.devices, *serving_devices]

    def _of_pool(self, devices: Sequence[Device]) -> list[str]:
        return [d.id for d in devices if d.id in self.pool.engines]

    async def generate(self, request: GenerateRequest) -> Completion:
        return await self.inner.generate(request)

    async def expand(self, devices: Sequence[Device]) -> None:
        """Borrow: the serving pool lets the devices go (drained, its engines offloaded), then the
        candidate's engines there wake."""
        borrowed = self._of_pool(devices)
        if borrowed:
            await self.pool.lend_all(borrowed)
        await self.inner.expand(devices)

    async def shrink(self, devices: Sequence[Device]) -> None:
        """Give back: the candidate's engines there sleep, then the serving pool serves on them again."""
        await self.inner.shrink(devices)
        await asyncio.gather(*(self.pool.give_back(d) for d in self._of_pool(devices)))

    async def train(self, batch: TrainBatch, devices: Sequence[Device]) -> int:
        self.pool.refuse_training([d.id for d in devices])
        return await self.inner.train(batch, devices)

    async def train_part(self, batch: TrainBatch, devices: Sequence[Device]) -> None:
        self.pool.refuse_training([d.id for d in devices])
        await self.inner.train_part(batch, devices)

    async def sync_weights(self, version: int, devices: Sequence[Device], interrupt: bool = False) -> None:
        await self.inner.sync_weights(version, devices, interrupt)

    async def suspend(self) -> None:
        await self.inner.suspend()

    async def resume(self) -> None:
        await self.inner.resume()

    async def residency(self) -> dict:
        return await self.inner.residency()

    async def serving_load(self) -> ServingLoad:
        """The harness's measure of the traffic, never the stack's."""
        return self.pool.load()

    async def close(self, trace: Trace, end: float, ran: bool) -> None:
        """The job is over (at ``end``): when it ran to its end, the requests it left in flight are
        served out and the pool's record goes into the trace, for the SLO audit."""
        if ran:
            await self.pool.finish()
            trace.record("serving", **self.pool.summary(end))
        self.pool.close()
