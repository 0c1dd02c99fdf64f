"""The candidate's objects as the harness reaches them, across the channel: its real cluster
(``RemoteCluster``, async, many calls in flight) and its single components for accuracy checks 1-3
(``RemoteEngine`` and ``RemoteTrainer``, one call at a time). Each follows the contract's protocol,
so the harness's proxy and checks use them as they would any cluster, engine or trainer; whatever
comes back is decoded as hostile data."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from targets.api import (
    Completion,
    Device,
    GenerateRequest,
    SamplingParams,
    StateDict,
    TrainBatch,
    TrainingConfig,
)
from targets.harness.ipc.channel import AsyncChannel, Frame, Received, SyncChannel
from targets.harness.ipc.protocol import ProtocolError
from targets.harness.ipc.weight_export import Layout
from targets.harness.ipc.wire import (
    field_of,
    get_aborted,
    get_completion,
    get_state,
    put_batch,
    put_config,
    put_params,
    put_plain_request,
    put_state,
)
from targets.printable import printable


class CandidateError(RuntimeError):
    """The candidate's code raised (the message carries its type, message and traceback tail)."""


def raise_if_error(rx: Received, what: str) -> Received:
    error = rx.get("error")
    if error is None:
        return rx
    if not isinstance(error, dict):
        raise ProtocolError(f"{what}: a malformed error reply")
    if error.get("type") == "Aborted":
        raise get_aborted(rx, error)
    said = f"{error.get('type')}: {str(error.get('message'))[:1000]}\n{str(error.get('traceback', ''))[-2000:]}"
    raise CandidateError(f"{what}: {printable(said)}")  # the candidate's words, shown to a person


class RemoteCluster:
    """The candidate's cluster process (follows ``targets.api.Cluster`` from the harness's side)."""

    def __init__(self, channel: AsyncChannel, devices: list[Device]) -> None:
        self.channel, self.devices = channel, list(devices)
        self._pending: dict[int, asyncio.Future] = {}
        self._cancelled: set[int] = set()  # calls cancelled here, until their one last frame comes
        self._next = 0
        self._lost: BaseException | None = None

    def start(self) -> None:
        self.channel.listen(self._on_frame, self._on_lost)

    def _on_frame(self, rx: Received) -> None:
        future = self._pending.pop(rx.get("id"), None)
        if future is None and rx.get("id") in self._cancelled:  # its answer, or the cancel's acknowledgement
            self._cancelled.discard(rx.get("id"))
            return
        if future is None or rx.get("cancelled"):
            what = "acknowledged a cancel never sent" if future is not None else "answered a call never made"
            self._on_lost(ProtocolError(f"the cluster process {what} (id {rx.get('id')!r})"))
            if future is not None and not future.done():
                future.set_exception(self._lost)
            return
        if not future.cancelled():  # a call whose caller went away (the controller finished): its answer is dropped
            future.set_result(rx)

    def _on_lost(self, error: BaseException) -> None:
        """Every caller waiting learns why the cluster went away."""
        self._lost = self._lost or error
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    async def _call(self, frame: Frame, what: str) -> Received:
        if self._lost is not None:
            raise ProtocolError(f"{what}: the cluster process is gone ({self._lost})")
        self._next += 1
        frame.header["id"] = self._next
        number, future = self._next, asyncio.get_running_loop().create_future()
        self._pending[number] = future
        self.channel.send(frame)
        try:
            rx = await future
        except asyncio.CancelledError:  # the caller went away (a generate whose episode was dropped)
            if self._pending.pop(number, None) is not None and not self.channel.closing:
                self._cancelled.add(number)
                self.channel.send(Frame(method="cancel", call=number))  # the cluster stops serving it
            raise
        return raise_if_error(rx, f"cluster.{what}")

    def now(self) -> float:
        raise PermissionError("the harness keeps the clock")

    async def sleep(self, seconds: float) -> None:
        raise PermissionError("the harness keeps the clock")

    async def generate(self, request: GenerateRequest) -> Completion:
        frame = Frame(method="generate")
        frame.header["request"] = put_plain_request(frame, request)
        rx = await self._call(frame, "generate")
        return get_completion(rx, field_of(rx.header, "completion", dict, "reply"))

    async def shrink(self, devices: Sequence[Device]) -> None:
        await self._call(Frame(method="shrink", devices=[d.id for d in devices]), "shrink")

    async def expand(self, devices: Sequence[Device]) -> None:
        await self._call(Frame(method="expand", devices=[d.id for d in devices]), "expand")

    async def train(self, batch: TrainBatch, devices: Sequence[Device]) -> int:
        frame = Frame(method="train", devices=[d.id for d in devices])
        frame.header["batch"] = put_batch(frame, batch)
        return field_of((await self._call(frame, "train")).header, "version", int, "train reply")

    async def train_part(self, batch: TrainBatch, devices: Sequence[Device]) -> None:
        frame = Frame(method="train_part", devices=[d.id for d in devices])
        frame.header["batch"] = put_batch(frame, batch)
        await self._call(frame, "train_part")

    async def sync_weights(self, version: int, devices: Sequence[Device], interrupt: bool = False) -> None:
        frame = Frame(method="sync_weights", version=version, devices=[d.id for d in devices], interrupt=interrupt)
        await self._call(frame, "sync_weights")

    async def suspend(self) -> None:
        await self._call(Frame(method="suspend"), "suspend")

    async def resume(self) -> None:
        await self._call(Frame(method="resume"), "resume")

    async def export_into(self, number: int, layout: Layout) -> object:
        """Export ``number`` into the region the harness has just sent on the weights socket; the
        reply is the names the cluster says it wrote (checked by the caller)."""
        frame = Frame(method="export_weights", number=number, layout=layout.to_wire())
        return (await self._call(frame, "export_weights")).get("written")

    async def serving_load(self):
        raise ValueError("this target has no serving pool")

    async def residency(self) -> dict:
        return (await self._call(Frame(method="residency"), "residency")).get("resident")

    async def close(self) -> None:
        await self._call(Frame(method="close"), "close")
        await self.channel.close()


class RemoteComponents:
    """The candidate's components process: one call at a time, answered in order."""

    def __init__(self, channel: SyncChannel) -> None:
        self.channel = channel
        self._next = 0

    def call(self, method: str, frame: Frame | None = None, **fields: Any) -> Received:
        self._next += 1
        frame = frame or Frame()
        frame.header.update(method=method, id=self._next, **fields)
        self.channel.send(frame)
        rx = self.channel.recv()
        if rx.get("id") != self._next:
            raise ProtocolError(f"the components process answered call {rx.get('id')!r}, not {self._next}")
        return raise_if_error(rx, method)

    def make_engine(self) -> RemoteEngine:
        return RemoteEngine(self, field_of(self.call("make_engine").header, "handle", str, "make_engine"))

    def make_engine_after(self, ready: Callable[[], object]) -> Callable[[], RemoteEngine]:
        """Ask for an engine now and return how to collect it, so the harness can work meanwhile
        (the candidate's first frame, ``ready``, is read before the engine's)."""
        self._next += 1
        frame = Frame(method="make_engine", id=self._next)
        self.channel.send(frame)
        expected = self._next

        def collect() -> RemoteEngine:
            ready()
            rx = self.channel.recv()
            if rx.get("id") != expected:
                raise ProtocolError(f"the components process answered call {rx.get('id')!r}, not {expected}")
            return RemoteEngine(self, field_of(raise_if_error(rx, "make_engine").header, "handle", str, "make_engine"))

        return collect

    def make_trainer(self, state: StateDict, config: TrainingConfig) -> RemoteTrainer:
        frame = Frame()
        frame.header.update(state=put_state(frame, state), config=put_config(config))
        return RemoteTrainer(self, field_of(self.call("make_trainer", frame).header, "handle", str, "make_trainer"))

    def sync_engine(self, engine: RemoteEngine, state: StateDict, version: int) -> None:
        frame = Frame()
        frame.header["state"] = put_state(frame, state)
        self.call("sync_engine", frame, engine=engine.handle, version=version)

    def close(self) -> None:
        self.call("close")
        self.channel.close()


class RemoteEngine:
    """Follows ``targets.api.RolloutEngine`` (what checks 1 and 3 need of it)."""

    def __init__(self, components: RemoteComponents, handle: str) -> None:
        self.components, self.handle = components, handle

    @property
    def weight_version(self) -> int:
        return field_of(
            self.components.call("engine_version", handle=self.handle).header, "version", int, "engine_version"
        )

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams) -> list[Completion]:
        frame = Frame()
        frame.header.update(prompts=[frame.array(p, "i4") for p in prompts], params=put_params(params))
        rx = self.components.call("engine_generate", frame, handle=self.handle)
        return [get_completion(rx, c) for c in field_of(rx.header, "completions", list, "engine_generate")]

    def load_weights(self, state: StateDict, version: int) -> None:
        raise PermissionError("the checks load weights through the stack's own sync path (sync_engine)")


class RemoteTrainer:
    """Follows ``targets.api.Trainer``."""

    def __init__(self, components: RemoteComponents, handle: str) -> None:
        self.components, self.handle = components, handle

    @property
    def version(self) -> int:
        return field_of(
            self.components.call("trainer_version", handle=self.handle).header, "version", int, "trainer_version"
        )

    def train_step(self, batch: TrainBatch) -> int:
        frame = Frame()
        frame.header["batch"] = put_batch(frame, batch)
        return field_of(
            self.components.call("trainer_step", frame, handle=self.handle).header, "version", int, "trainer_step"
        )

    def state_dict(self) -> dict:
        rx = self.components.call("trainer_state", handle=self.handle)
        return get_state(rx, rx["state"])
