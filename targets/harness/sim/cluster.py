"""The simulated ``targets.api.Cluster``: the same mechanism the Ray cluster implements, under virtual
time, with every duration from the cost model.

Rollout devices are grouped into engines of ``costs.engine_devices`` consecutive devices of one pool
(a shrink or expand of any device takes its whole engine); an engine costs what its pool's devices
do. ``generate`` goes to the engine of the request's ``device`` when that engine is active (the
candidate routes), else to the engine that served the episode's previous turn while it is active
(its prefix is cached there), else to the active engine with the fewest requests; the turn generates
as many tokens as ``ResponseLengths`` draws for it (a continuation the rest of them); ``shrink``
aborts what the engines hold and offloads them; ``expand`` reloads them and loads the latest weights
if they are stale; ``train`` takes the training FLOPs of the batch over the given devices;
``sync_weights`` drains each engine's running batch (or, with ``interrupt``, answers it as aborted
with what it decoded) and loads.

A serving pool's devices (``serving.py``) hold offloaded engines too: ``expand`` of one borrows it
(its serving traffic drains and goes to the pool's other devices first), ``shrink`` gives it back;
no trainer ever runs there.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from targets.api import Aborted, Completion, Device, GenerateRequest, ServingLoad, TrainBatch
from targets.harness.sim.cost_model import ClusterCosts
from targets.harness.sim.engine import SimEngine, _Sequence
from targets.harness.sim.response_length import ResponseLengths
from targets.harness.sim.serving import ServingPool

Answer = Callable[[Completion | BaseException], None]  # told a request's completion or the error it ended in


@dataclass(eq=False)
class _Call:
    """One ``generate_then``: the request, whom to tell, and where it is served (its engine and the
    engine's handle, once submitted; a retry after an abort is another call)."""

    request: GenerateRequest
    done: Answer
    length: int | None
    engine: SimEngine | None = None
    seq: _Sequence | None = None  # the engine's handle for ``SimEngine.cancel``
    cancelled: bool = False


class SimCluster:
    def __init__(
        self,
        devices: Sequence[Device],
        rollout: Sequence[Device],
        costs: ClusterCosts,
        lengths: ResponseLengths,
        serving: ServingPool | None = None,
        judging: Sequence[str] = (),
    ) -> None:
        self.serving = serving
        self.judging = set(judging)  # the job's devices set aside for a dedicated reward model
        lendable = [] if serving is None else list(serving.engines)  # the pool's order (sorted, serving:10 came first)
        self.devices = list(devices)
        self.costs = costs
        self.lengths = lengths
        size = costs.engine_devices
        groups = self._engine_groups([d.id for d in rollout], size)
        borrowed = self._engine_groups(lendable, size)
        self.engines = [SimEngine(f"engine{i}", group, costs.of(group[0])) for i, group in enumerate(groups + borrowed)]
        self._engine_of = {device: engine for engine in self.engines for device in engine.devices}
        self._active = set(self.engines[: len(groups)])
        for engine in self.engines[len(groups) :]:  # a serving device's engine: asleep until borrowed
            engine.offload()
        self._sticky: dict[str, SimEngine] = {}
        self._blocked: list[_Call] = []  # requests that came while no engine served
        self._suspended = False
        self._training: set[str] = set()  # devices the trainer last trained on
        self.version = 0

    def _engine_groups(self, rollout: list[str], size: int) -> list[list[str]]:
        if len(rollout) % size:
            raise ValueError(
                f"{len(rollout)} rollout devices do not split into engines of {size} devices "
                f"(the model's engine size times the stack's engine_scale)"
            )
        groups = [rollout[i * size : (i + 1) * size] for i in range(len(rollout) // size)]
        for group in groups:
            if len({self.costs.pool_of[d] for d in group}) > 1:
                raise ValueError(f"the engine on {group} would span pools: an engine's devices are of one pool")
        return groups

    @property
    def engine_devices(self) -> dict[str, list[str]]:
        """What a completion's ``device`` (an engine's first device) stands for: all its devices."""
        return {engine.devices[0]: engine.devices for engine in self.engines}

    # -- clock -------------------------------------------------------------------------------------
    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    # -- rollout -----------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> Completion:
        answer = asyncio.get_running_loop().create_future()
        self.generate_then(request, answer.set_result)
        result = await answer
        if isinstance(result, BaseException):
            raise result
        return result

    def generate_then(self, request: GenerateRequest, done: Answer, length: int | None = None) -> Callable[[], None]:
        """Serve ``request``; ``done`` is told its completion, or the error it ended in (``Aborted``
        when its engine was shrunk, suspended or interrupted). Callbacks, not a task a request: a
        simulated run makes millions. While no engine serves, the request waits for one. ``length``:
        the tokens it generates (a colocated judge's verdict), else what ``ResponseLengths`` draws.
        Returns how to cancel it (its caller has gone): the engine stops serving it, ``done`` is never told."""
        call = _Call(request, done, length)
        self._serve(call)
        return functools.partial(self._cancel, call)

    def _serve(self, call: _Call) -> None:
        request = call.request
        if self._suspended or not self._active:
            self._blocked.append(call)
            return
        engine = self._engine_of.get(request.device)  # None when the candidate leaves it to us
        if engine not in self._active:
            engine = self._sticky.get(request.episode_id)
        if engine not in self._active:
            engine = min(self._active, key=lambda e: (e.load, e.name))
        self._sticky[request.episode_id] = engine
        budget, length = request.params.max_new_tokens, call.length
        if length is None:
            length = min(budget, max(1, self.lengths.of(request.episode_id, request.turn) - request.continues))
        try:
            call.engine = engine
            call.seq = engine.submit(
                request.episode_id, len(request.prompt), budget, length, functools.partial(self._served, call)
            )
        except (ValueError, RuntimeError) as error:  # a request the engine cannot take: its caller is told
            call.done(error)

    def _served(self, call: _Call, completion: Completion) -> None:
        if call.engine.cost.request_overhead_s:  # the answer's way back; the engine serves on
            asyncio.get_running_loop().call_later(call.engine.cost.request_overhead_s, self._answered, call, completion)
        else:
            self._answered(call, completion)

    @staticmethod
    def _answered(call: _Call, completion: Completion) -> None:
        if call.cancelled:
            return
        if completion.finish_reason == "abort":
            request = call.request
            call.done(Aborted(f"{request.episode_id} turn {request.turn} aborted on {call.engine.name}", completion))
        else:
            call.done(completion)

    def _cancel(self, call: _Call) -> None:
        """Its caller has gone: out of the waiting requests, or its engine stops serving it."""
        call.cancelled = True
        if call in self._blocked:
            self._blocked.remove(call)
        elif call.seq is not None:
            call.engine.cancel(call.seq)

    def _unblock(self) -> None:
        """Engines serve again: the requests that waited go out, in the order they came."""
        blocked, self._blocked = self._blocked, []
        for call in blocked:
            self._serve(call)

    def last_device(self, episode: str) -> str | None:
        """The device of the engine that served ``episode``'s last turn (None before its first)."""
        engine = self._sticky.get(episode)
        return engine.devices[0] if engine is not None else None

    def _engines_on(self, devices: Sequence[Device]) -> list[SimEngine]:
        return sorted({self._engine_of[d.id] for d in devices if d.id in self._engine_of}, key=lambda e: e.name)

    async def shrink(self, devices: Sequence[Device]) -> None:
        engines = [e for e in self._engines_on(devices) if e in self._active]
        if engines and not self._active - set(engines):
            raise ValueError(f"shrinking {[d.id for d in devices]} would leave no active rollout engine")
        self._active -= set(engines)
        for engine in engines:
            engine.offload()
        if engines:
            await asyncio.sleep(max(e.cost.offload_s() for e in engines))
        given_back = [d for e in engines for d in e.devices if self.serving and d in self.serving.engines]
        await asyncio.gather(*(self.serving.give_back(d) for d in given_back))

    async def expand(self, devices: Sequence[Device]) -> None:
        engines = [e for e in self._engines_on(devices) if e not in self._active]
        if not engines:
            return
        borrowed = [d for e in engines for d in e.devices if self.serving and d in self.serving.engines]
        if borrowed:
            await self.serving.lend_all(borrowed)
        for engine in engines:
            engine.reload()
        await asyncio.sleep(max(e.cost.reload_s() for e in engines))
        stale = [e for e in engines if e.version != self.version]
        await asyncio.gather(*(e.load_weights(self.version, self._sync_s(e)) for e in stale))
        self._active |= set(engines)
        self._unblock()

    # -- training and weights ----------------------------------------------------------------------
    async def train(self, batch: TrainBatch, devices: Sequence[Device]) -> int:
        self._take_for_training(devices)
        await asyncio.sleep(self.costs.train_s([len(t.tokens) for t in batch.trajectories], [d.id for d in devices]))
        self.version += 1
        return self.version

    async def train_part(self, batch: TrainBatch, devices: Sequence[Device]) -> None:
        """Stream training: the part's forward and backward now (its FLOPs); the step's fixed cost
        (the optimizer, the gradient reduction: ``train_step_overhead_s``) is paid once, by ``train``."""
        self._take_for_training(devices)
        lengths = [len(t.tokens) for t in batch.trajectories]
        await asyncio.sleep(self.costs.train_s(lengths, [d.id for d in devices], overhead=False))

    def _take_for_training(self, devices: Sequence[Device]) -> None:
        if not devices:
            raise ValueError("training needs at least one device")
        if self.serving is not None:
            self.serving.refuse_training([d.id for d in devices])
        judging = sorted(d.id for d in devices if d.id in self.judging)
        if judging:
            raise ValueError(f"{judging} are set aside for the reward model (reward_devices): training never")
        awake = sorted(e.name for e in self._engines_on(devices) if not e.offloaded)
        if awake:
            raise ValueError(
                f"the engines {awake} on the training devices are awake: shrink or suspend them first "
                "(an engine and a trainer never hold a device at once)"
            )
        self._training = {d.id for d in devices}

    async def sync_weights(self, version: int, devices: Sequence[Device], interrupt: bool = False) -> None:
        if version != self.version:
            raise ValueError(f"can only sync the latest version {self.version}, not {version}")
        engines = [e for e in self._engines_on(devices) if e in self._active]
        await asyncio.gather(*(e.load_weights(version, self._sync_s(e), interrupt) for e in engines))

    def _sync_s(self, engine: SimEngine) -> float:
        """Loading the latest version into ``engine``: from the pool that trained it (``ClusterCosts.sync_s``)."""
        return self.costs.sync_s(engine.devices, self._training if self.version else set())

    async def export(self, step: int) -> None:
        """The harness's weight export after a step: no weights to copy; the time a real export
        takes (the twin's fitted term) passes."""
        if self.costs.shared.weight_export_s:
            await asyncio.sleep(self.costs.shared.weight_export_s)

    async def saved(self) -> None:
        """A real export's file is written while training goes on; nothing is written here."""

    # -- suspend / resume / close ------------------------------------------------------------------
    async def suspend(self) -> None:
        """All rollout paused: every engine offloaded (its requests aborted), the devices free to train."""
        self._suspended = True
        engines = [e for e in self.engines if not e.offloaded]
        for engine in engines:
            engine.offload()
        if engines:
            await asyncio.sleep(max(e.cost.offload_s() for e in engines))

    async def resume(self) -> None:
        """Every engine reloaded and brought to the latest weights, then routed to again."""
        engines = [e for e in self.engines if e.offloaded and e in self._active]
        for engine in engines:
            engine.reload()
        if engines:
            await asyncio.sleep(max(e.cost.reload_s() for e in engines))
            stale = [e for e in engines if e.version != self.version]
            await asyncio.gather(*(e.load_weights(self.version, self._sync_s(e)) for e in stale))
        self._suspended = False
        self._unblock()

    async def residency(self) -> dict[str, list[str]]:
        """An awake engine holds its devices; a trainer holds a device it trained on while no awake
        engine is there."""
        out: dict[str, list[str]] = {d.id: [] for d in self.devices}
        for engine in self.engines:
            if not engine.offloaded:
                for device in engine.devices:
                    out[device].append("engine")
        for device in self._training:
            if "engine" not in out[device]:
                out[device].append("trainer")
        return out

    async def serving_load(self) -> ServingLoad:
        if self.serving is None:
            raise ValueError("this target has no serving pool")
        return self.serving.load()

    async def close(self) -> None:
        for engine in self.engines:
            engine.close()
        if self.serving is not None:
            self.serving.close()

    @property
    def preemptions(self) -> int:
        return sum(e.preemptions for e in self.engines)

    def decoding(self) -> tuple[float, float]:
        """(seconds the engines spent decoding, summed; the mean number of sequences decoding then): how
        full the batches were that the rollout time went to."""
        seconds = sum(e.decode_seconds for e in self.engines)
        batch = sum(e.decode_sequence_seconds for e in self.engines) / seconds if seconds else 0.0
        return seconds, batch

    def prefills(self) -> tuple[int, int, float]:
        """(context tokens the engines prefilled, those they restored from a host tier instead, and the
        seconds the prefills and copies took, summed)."""
        return (
            sum(e.prefilled_tokens for e in self.engines),
            sum(e.restored_tokens for e in self.engines),
            sum(e.prefill_seconds for e in self.engines),
        )

    @property
    def peak_kv_fraction(self) -> float:
        return max((e.peak_kv_tokens / e.capacity for e in self.engines if e.capacity), default=0.0)
