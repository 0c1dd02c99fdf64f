"""serving_harvest: rollout on a serving pool's headroom (ROSE), backing off before its SLOs break.

A serving pool's devices (``Runtime.serving_devices``) serve production traffic; a stack may borrow
them for rollout (``Cluster.expand``: the pool drains the device and serves on the others) and give
them back (``shrink``), never train on them. Every ``CHECK_S`` the harvester reads the pool's traffic
as the harness measures it (``Cluster.serving_load``) and keeps serving as many devices as that
traffic needs, ``rate * (1 + harvest_margin) / capacity`` (rounded up), or while a recent p99 is
over ``BACK_OFF`` of its SLO those serving now and half of those lent; it lends the rest, all in one
``expand``, and gives back the most recently lent first, all in one ``shrink``. The rate the harness
reports is an average over its window, which trails a burst by most of that window: while it rises,
the harvester reads it as ``rate + slope * window`` (the slope since its last reading), where the
burst is heading rather than where it was. After a give-back nothing is lent for one window: the
slope of two readings half a second apart is noise at a burst's rate (Poisson arrivals), and one low
reading would lend a device back into the burst it was just taken from. Lent engines load
each new policy version as soon as it is trained (``policy_advanced``), and a borrow brings the
latest version with it (``expand`` loads it), so they sample under the same staleness bound. The
first episodes start once the first lend is in place (an episode's turns stay on the engine that
served its first, for its prefix cache, so engines lent later get only episodes launched later). The
syncs run beside the harvest: one waits for the lent engines' running turns, and the traffic may
want a device back meanwhile (the give-back aborts those turns, and the sync ends with them).

Its price: each borrow drains the device's serving requests and reloads an engine with weights
across the pools' link; each give-back aborts the turns the engine held (they retry elsewhere).
A margin too small lets a burst arrive before the give-back, and the SLO audit rejects the run.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

from targets.api import Cluster, Device, ServingLoad

CHECK_S = 0.5  # how often the traffic is read (the harness measures it over the last 10 s)
BACK_OFF = 0.3  # a recent p99 over this share of its SLO gives devices back whatever the rate says: requests queue


class ServingHarvest:
    def __init__(
        self, cluster: Cluster, devices: Sequence[Device], engine_devices: int, margin: float, interrupt: bool
    ) -> None:
        if margin < 0:
            raise ValueError(f"params harvest_margin must be at least 0, got {margin}")
        self.cluster, self.margin, self.interrupt = cluster, margin, interrupt
        devices = list(devices)
        self.size = engine_devices
        # engines in the order they are lent (the pool's last devices first); given back in reverse
        self.engines = [devices[i : i + engine_devices] for i in range(0, len(devices), engine_devices)][::-1]
        self.lent: list[list[Device]] = []
        self.version = 0  # the latest version trained (``policy_advanced``)
        self._last: tuple[float, float] | None = None  # (when, rate) of the last reading
        self._given_back_at: float | None = None  # when the last give-back was decided (no lend for a window)
        self._task: asyncio.Task | None = None
        self._syncs: set[asyncio.Task] = set()
        self._failure: BaseException | None = None
        self._stopping = False
        self._sleeping: asyncio.Future | None = None
        self.ready = asyncio.Event()  # set once the first lend is in place: episodes start on every engine
        # told of a failure at once (the controller's waits raise it): a harvest that stopped, or a sync
        # that failed, must not leave the episodes waiting for a first lend, or lent engines on an old version
        self.on_failure: Callable[[BaseException], None] = lambda error: None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._failed(task.exception())

    def _failed(self, error: BaseException) -> None:
        if self._failure is None:
            self._failure = error
            self.on_failure(error)

    async def _run(self) -> None:
        while not self._stopping:
            await self._adjust(await self.cluster.serving_load())
            self.ready.set()
            if not self._stopping:
                self._sleeping = asyncio.ensure_future(self.cluster.sleep(CHECK_S))
                try:
                    await self._sleeping
                except asyncio.CancelledError:
                    if not self._stopping:  # stop() ends the wait; a cancel of the harvest itself ends it
                        raise

    def _rate(self, load: ServingLoad, now: float) -> float:
        """The traffic's rate ahead of the harness's trailing window while it rises (module docstring)."""
        last = self._last
        self._last = (now, load.rate_rps)
        if last is None or now <= last[0]:
            return load.rate_rps
        slope = (load.rate_rps - last[1]) / (now - last[0])
        return load.rate_rps + max(0.0, slope) * load.window_s

    async def _adjust(self, load: ServingLoad) -> None:
        """Lend or give back engines, all at once, until the devices serving are what the traffic needs."""
        now = self.cluster.now()
        rate = self._rate(load, now)
        needed = math.ceil(rate * (1 + self.margin) / load.capacity_rps) if load.capacity_rps else load.serving
        hot = load.ttft_p99_s > BACK_OFF * load.ttft_slo_s or load.tpot_p99_s > BACK_OFF * load.tpot_slo_s
        keep = max(1, needed, load.serving + math.ceil(load.lent / 2) if hot else 0)  # devices that must serve
        lend = max(0, (len(self.engines) * self.size - keep) // self.size)
        if len(self.lent) > lend:
            back, self.lent = self.lent[lend:], self.lent[:lend]
            self._given_back_at = now
            await self.cluster.shrink([d for engine in back for d in engine])
        elif len(self.lent) < lend and (self._given_back_at is None or now - self._given_back_at >= load.window_s):
            more = self.engines[len(self.lent) : lend]
            version = self.version
            await self.cluster.expand([d for engine in more for d in engine])  # loads the latest version
            self.lent += more
            if self.version != version:  # trained meanwhile: the expand may have loaded the version before
                self._sync(self.version, more)

    async def synced(self) -> None:
        """Wait for the lent engines' syncs: the controller trains the next version only once they hold
        this one, as it waits for its own engines' (a turn decoding under an older version meanwhile
        would be trained beyond the staleness bound)."""
        await asyncio.gather(*list(self._syncs))
        if self._failure is not None:  # a sync (or the harvest) that failed before this wait began
            raise self._failure

    def policy_advanced(self, version: int) -> None:
        """A new version was trained: the engines lent now load it, beside the harvest (a sync waits for
        their running turns, and the traffic may want a device back meanwhile)."""
        self.version = version
        if self.lent:
            self._sync(version, self.lent)

    def _sync(self, version: int, engines: list[list[Device]]) -> None:
        devices = [d for engine in engines for d in engine]
        sync = asyncio.ensure_future(self.cluster.sync_weights(version, devices, self.interrupt))
        self._syncs.add(sync)
        sync.add_done_callback(self._synced)

    def _synced(self, sync: asyncio.Task) -> None:
        self._syncs.discard(sync)
        if not sync.cancelled() and sync.exception() is not None:
            self._failed(sync.exception())

    async def stop(self) -> None:
        """End the harvest (the run is over) once the lend, give-back or sync under way has finished: a
        call cut off midway would leave its aborts with no call to explain them. A failure it met is
        the run's."""
        self._stopping = True
        if self._sleeping is not None:
            self._sleeping.cancel()
        await asyncio.gather(*[task for task in [self._task, *self._syncs] if task is not None])
        if self._failure is not None:
            raise self._failure
