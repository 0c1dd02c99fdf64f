"""A serving pool under virtual time: production traffic the harness serves on the pool's devices
that are not lent to rollout, each request measured against the pool's SLOs (ROSE-like targets).

* **arrivals**: Poisson at the spec's rate curve (``ServingSpec.rate``, piecewise constant, repeating
  every ``period_s``); a gap that crosses a change of rate is drawn again from the change (memoryless).
* **serving**: each device runs one engine of the serving model (``SimEngine``: continuous batching,
  the serving model's cost model on that device). TTFT is arrival to the end of its prefill; TPOT
  is the rest of its time over its other ``output_tokens - 1`` tokens. Routing: the fewest requests
  waiting for their prefill, then the fewest in all (arrivals sent after a device already
  prefilling would all wait for it).
* **the traffic's rate** (``load``): arrivals over the last ``WINDOW_S``; the traffic ran before the
  job did, so in the run's first ``WINDOW_S`` the part of the window before it counts at the curve's
  rate then (what the pool's own monitor would have seen).
* **lending** (a stack's ``expand`` of a serving device): the device takes no new requests, its own
  finish (drain), and its serving engine offloads (the serving model's shard over the host link);
  the last serving device is never lent. **Giving back** (``shrink``): the serving engine reloads,
  then takes requests again.
* **what the audit reads**: the run's p99 TTFT and TPOT over every request that arrived while the job
  ran. When the job ends the traffic stops and the pool serves what it holds to the last token on the
  devices still serving (``finish``), so starving requests or slowing their decode until the run
  ends hides nothing; the lent device-seconds end with the job.
* **capacity**: the rate one device serves within both SLOs, as ROSE profiles its serving engines
  offline: one device's engine under Poisson arrivals at a constant rate for ``PROFILE_S`` virtual
  seconds, the rate bisected until its p99 TTFT and TPOT sit at the SLOs. It is what the harness
  tells a stack (``ServingLoad.capacity_rps``); the pool's own p99s are measured, never derived.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from targets.api import ServingLoad
from targets.harness.environments.seeds import RunSeed
from targets.harness.sim.cost_model import CostModel
from targets.harness.sim.engine import SimEngine
from targets.spec import SpecError, TargetSpec
from targets.spec.serving import ServingSpec

WINDOW_S = 10.0  # what ``load`` measures over: short enough to follow a burst, long enough for a p99
PROFILE_S, PROFILE_STEPS = 300.0, 6  # the capacity profile: seconds at each rate tried, bisection steps
FINISH_POLL_S = 0.05  # how often ``finish`` looks whether the last requests are served (virtual seconds)
FINISH_LIMIT_S = 3600.0  # a drain longer than this is a simulator bug, said out loud


@dataclass
class _Request:
    arrived: float
    first: float | None = None


@dataclass
class ServingRecord:
    """What the run's serving traffic met: each finished request's TTFT, TPOT and finish time."""

    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    finished_at: list[float] = field(default_factory=list)


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else 0.0


class ServingPool:
    def __init__(
        self,
        spec: ServingSpec,
        devices: list[str],
        cost: CostModel,
        seed: int,
        capacity_rps: float,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``clock``: the time the pool measures in (the run's trace clock; the loop's, virtual, by
        default); its traffic's curve starts at the clock's time now, when the job does."""
        self.spec, self.cost, self.capacity_rps = spec, cost, capacity_rps
        self.engines = {device: SimEngine(f"{device}/serving", [device], cost) for device in devices}
        self.lent: set[str] = set()
        self.record = ServingRecord()
        self._waiting: dict[int, _Request] = {}  # arrived, not finished
        self._arrivals: deque[float] = deque()  # arrival times within the last window
        self._loop = asyncio.get_running_loop()
        self._now = clock or self._loop.time
        self.origin = self._now()  # when the job started: the rate curve's 0 s
        self._lent_changes: list[tuple[float, int]] = [(self.origin, 0)]  # (time, devices lent from then)
        self._rng = np.random.default_rng(seed)
        self._numbers = itertools.count()
        self._closed = False
        self._timer = self._loop.call_soon(self._schedule)

    # -- traffic -----------------------------------------------------------------------------------
    def _schedule(self) -> None:
        """The next arrival, from now."""
        t = self._now()
        while True:
            rps, left = self.spec.rate_at(t - self.origin)
            gap = self._rng.exponential(1.0 / rps) if rps > 0 else math.inf
            if gap < left:
                break
            t += left
        self._timer = self._loop.call_later(t + gap - self._now(), self._arrive)

    def _arrive(self) -> None:
        if self._closed:
            return
        now = self._now()
        number = next(self._numbers)
        request = self._waiting[number] = _Request(now)
        self._arrivals.append(now)
        serving = [d for d in self.engines if d not in self.lent]
        engine = self.engines[min(serving, key=lambda d: (self.engines[d].pending, self.engines[d].load, d))]
        out = self.spec.output_tokens

        def started() -> None:
            if request.first is None:
                request.first = self._now()

        def done(completion) -> None:
            if completion.finish_reason == "abort":  # never: a serving engine is not offloaded while it holds requests
                raise RuntimeError(f"serving request {number} on {engine.name} was aborted")
            del self._waiting[number]
            finished = self._now()
            self.record.ttft.append(request.first - request.arrived)
            self.record.tpot.append((finished - request.first) / (out - 1))
            self.record.finished_at.append(finished)

        engine.submit(f"serve{number}", self.spec.prompt_tokens, out, out, done, started)
        self._schedule()

    # -- lending ---------------------------------------------------------------------------------
    def refuse_training(self, devices: list[str]) -> None:
        """Rollout may borrow the pool's devices; a training call on any of them is refused."""
        serving = [d for d in devices if d in self.engines]
        if serving:
            raise ValueError(f"{serving} serve production traffic: rollout may borrow them, training never")

    async def lend_all(self, devices: list[str]) -> None:
        """Lend ``devices`` together (a rollout engine's), or none of them: checked whole first, since a
        refusal half way left the first ones lent and drained for the rest of the run, their engine never
        active and never given back."""
        if len(self.engines) - len(self.lent | set(devices)) < 1:
            raise ValueError(f"lending {devices} would leave the serving pool no device to serve its traffic")
        await asyncio.gather(*(self.lend(device) for device in devices))

    async def lend(self, device: str) -> None:
        """Stop serving on ``device``: no new requests, its own drain, its serving engine offloads."""
        if device in self.lent:
            return
        if len(self.engines) - len(self.lent) <= 1:
            raise ValueError(f"lending {device} would leave the serving pool no device to serve its traffic")
        self.lent.add(device)
        self._lent_changes.append((self._now(), len(self.lent)))
        engine = self.engines[device]
        while engine.load:
            await asyncio.sleep(0.05)
        engine.offload()
        await asyncio.sleep(self.cost.offload_s())

    async def give_back(self, device: str) -> None:
        """Serve on ``device`` again once its serving engine has reloaded."""
        if device not in self.lent:
            return
        self.engines[device].reload()
        await asyncio.sleep(self.cost.reload_s())
        self.lent.discard(device)
        self._lent_changes.append((self._now(), len(self.lent)))

    # -- measures --------------------------------------------------------------------------------
    def load(self) -> ServingLoad:
        now = self._now()
        while self._arrivals and self._arrivals[0] < now - WINDOW_S:
            self._arrivals.popleft()
        before_run = max(0.0, WINDOW_S - (now - self.origin)) * self.spec.rate_at(0.0)[0]  # the traffic before the job
        first = bisect.bisect_left(self.record.finished_at, now - WINDOW_S)
        slo = self.spec.slo
        return ServingLoad(
            rate_rps=(len(self._arrivals) + before_run) / WINDOW_S,
            serving=len(self.engines) - len(self.lent),
            lent=len(self.lent),
            ttft_p99_s=p99(self.record.ttft[first:] + self._still_waiting(now)),
            tpot_p99_s=p99(self.record.tpot[first:]),
            ttft_slo_s=slo.ttft_p99_ms / 1e3,
            tpot_slo_s=slo.tpot_p99_ms / 1e3,
            capacity_rps=self.capacity_rps,
            window_s=WINDOW_S,
        )

    async def finish(self) -> None:
        """No more arrivals; wait until every request that arrived is served to its last token, on the
        devices still serving, so the run's p99s are measured over all of them (a request the job's
        last lends slowed counts as much as any other)."""
        self._closed = True
        self._timer.cancel()
        started = self._now()
        while self._waiting:
            if self._now() - started > FINISH_LIMIT_S:
                raise RuntimeError(
                    f"{len(self._waiting)} serving requests still unserved {FINISH_LIMIT_S:.0f} s after the run"
                )
            await asyncio.sleep(FINISH_POLL_S)

    def summary(self, end: float) -> dict:
        """The run's serving figures for the trace: p99s over every request (one still waiting for its
        first token counts with its wait so far; none is after ``finish``), the SLOs, and the
        device-seconds lent up to ``end``, the job's end."""
        now = self._now()
        waiting = self._still_waiting(now)
        changes = [(t, n) for t, n in self._lent_changes if t <= end]
        ends = [t for t, _ in changes[1:]] + [end]
        lent = sum((stop - t) * n for (t, n), stop in zip(changes, ends, strict=True))
        slo = self.spec.slo
        return {
            "requests": len(self.record.ttft) + len(self._waiting),
            "finished": len(self.record.ttft),
            "ttft_p99_s": p99(self.record.ttft + waiting),
            "tpot_p99_s": p99(self.record.tpot),
            "ttft_slo_s": slo.ttft_p99_ms / 1e3,
            "tpot_slo_s": slo.tpot_p99_ms / 1e3,
            "lent_device_s": lent,
            "devices": sorted(self.engines),
            "windows": self._windows(now),
        }

    def _still_waiting(self, now: float) -> list[float]:
        """How long each request still waiting for its first token has waited: what its TTFT is at least."""
        return [now - r.arrived for r in self._waiting.values() if r.first is None]

    def _windows(self, now: float) -> list[list[float]]:
        """Per ``WINDOW_S`` of the run: [end, requests finished, most devices lent, p99 TTFT, p99 TPOT]."""
        out, first = [], 0
        finished = self.record.finished_at
        for end in np.arange(self.origin + WINDOW_S, now + WINDOW_S, WINDOW_S):
            last = bisect.bisect_left(finished, end)
            changes = [n for t, n in self._lent_changes if end - WINDOW_S <= t < end]
            lent = max([*changes, self._lent_at(end - WINDOW_S)])
            ttft, tpot = self.record.ttft[first:last], self.record.tpot[first:last]
            out.append([float(end), last - first, lent, p99(ttft), p99(tpot)])
            first = last
        return out

    def _lent_at(self, t: float) -> int:
        return next(n for when, n in reversed(self._lent_changes) if when <= t)

    def close(self) -> None:
        self._closed = True
        self._timer.cancel()
        for engine in self.engines.values():
            engine.close()


@functools.cache
def serving_capacity(spec: ServingSpec, cost: CostModel) -> float:
    """Requests/s one device serves within the SLOs (the module's docstring): outside any running
    loop (a profile is a simulation of its own), once per serving model, device and SLO."""
    from targets.harness.sim.virtual_time import run_virtual

    def holds(rate: float) -> bool:
        constant = spec.model_copy(update={"rate": ((0.0, rate),), "period_s": PROFILE_S})

        async def profile() -> dict:
            pool = ServingPool(constant, ["profile:0"], cost, seed=0, capacity_rps=0.0)
            await asyncio.sleep(PROFILE_S)
            pool.close()
            return pool.summary(asyncio.get_running_loop().time())

        s = run_virtual(profile())
        return s["ttft_p99_s"] <= s["ttft_slo_s"] and s["tpot_p99_s"] <= s["tpot_slo_s"]

    low, high = 0.0, 1.0 / cost.prefill_s(spec.prompt_tokens, 0)  # prefill alone would fill the device
    for _ in range(PROFILE_STEPS):
        mid = (low + high) / 2
        low, high = (mid, high) if holds(mid) else (low, mid)
    return low


def serving_cost(spec: TargetSpec) -> CostModel:
    """The serving model's costs on its pool. The pool serves (and lends) one engine a device, so a model
    that needs several devices an engine is refused by name: simulated one a device, each device had its
    engine's bandwidth and KV room, and a stack could borrow headroom the pool never had."""
    (pool,) = spec.hardware.serving_pools
    cost = CostModel.from_spec(spec, pool.name, pool.serving.model)
    if cost.engine_devices != 1:
        index = spec.hardware.pools.index(pool)
        raise SpecError(
            f"hardware.pools.{index}.serving.model: its {cost.weight_bytes / 1e9:.0f} GB of weights need "
            f"{cost.engine_devices} devices an engine on {pool.kind} ({cost.memory_bytes / 1e9:.0f} GB each); "
            "a serving pool runs one engine a device: serve a model that fits one device"
        )
    return cost


def serving_pool_of(spec: TargetSpec, seed: int | RunSeed) -> Callable[..., ServingPool] | None:
    """What makes the target's serving pool inside a run, on the loop's clock or the ``clock`` it is
    given (None without one); its capacity is profiled here, outside any running loop (a profile is a
    simulation of its own)."""
    pools = spec.hardware.serving_pools
    if not pools:
        return None
    (pool,) = pools  # the spec allows one
    cost = serving_cost(spec)
    devices = [d for d in spec.hardware.serving_device_ids() if spec.hardware.pool_name(d) == pool.name]
    capacity = serving_capacity(pool.serving, cost)
    stream = (seed if isinstance(seed, RunSeed) else RunSeed(seed)).stream("serving")
    return lambda clock=None: ServingPool(pool.serving, devices, cost, stream, capacity, clock)
