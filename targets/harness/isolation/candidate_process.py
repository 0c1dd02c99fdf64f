"""What runs inside a candidate process: ``python -m targets.harness.isolation.candidate_process ROLE SOCKET STACK``.

The harness starts one sandboxed process per role and talks to it only over the channel:

* ``controller``: builds the stack, runs ``controller.run`` against proxies of the harness's cluster
  and environments (every call crosses the channel; the harness stamps it with its own clock);
* ``cluster``: builds the stack and serves the harness's forwarded calls on ``make_cluster()``;
* ``components``: serves accuracy checks 1-3 on ``make_engine``/``make_trainer``/``sync_engine``.

Nothing here is trusted: a candidate may patch any of it in its own process, and the harness
decodes whatever arrives as hostile data. The point is that nothing the harness records lives here.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from targets.api import (
    DROP_REASONS,
    Aborted,
    Completion,
    Device,
    GenerateRequest,
    Runtime,
    ServingLoad,
    StepResult,
    TokenCount,
    TrainBatch,
)
from targets.harness.ipc import shared_ring
from targets.harness.ipc.channel import AsyncChannel, Frame, Received, SyncChannel
from targets.harness.ipc.wire import (
    PromptMemory,
    get_aborted,
    get_batch,
    get_completion,
    get_config,
    get_plain_request,
    get_runtime,
    get_state,
    get_step_result,
    get_tokens,
    put_aborted,
    put_batch,
    put_completion,
    put_declared,
    put_engine_settings,
    put_request,
    put_state,
    put_tokens,
)
from targets.harness.sim.virtual_time import FollowerTimeLoop

ROLES = ("controller", "cluster", "components")


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def _import_stack(stack_dir: str):
    """``stack`` from the candidate directory, importable by this process and the ones it starts
    (Ray workers inherit PYTHONPATH; a stack joining a running cluster hands it on to its workers)."""
    sys.path.insert(0, stack_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join([stack_dir, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return importlib.import_module("stack")


_STARTED = time.monotonic()


def _log(message: str) -> None:
    print(f"[{time.monotonic() - _STARTED:7.2f}s] {message}", file=sys.stderr, flush=True)


def _error_frame(error: BaseException, **header: Any) -> Frame:
    return Frame(
        **header,
        error={
            "type": type(error).__name__,
            "message": str(error),
            "traceback": "".join(traceback.format_exception(error))[-4000:],
        },
    )


# -- controller ----------------------------------------------------------------------------------------


class _Calls:
    """Requests with ids over an async channel; replies resolve them as they arrive. Under virtual
    time every harness frame carries the harness's clock, which becomes this loop's clock."""

    def __init__(self, channel: AsyncChannel, loop: asyncio.AbstractEventLoop) -> None:
        self.channel, self.loop = channel, loop
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.counts = False  # a simulated run: token sequences travel as counts (set by the harness's init)
        self._follow = isinstance(loop, FollowerTimeLoop)

    async def call(self, frame: Frame) -> Received:
        self.next_id += 1
        frame.header["id"] = self.next_id
        future = self.loop.create_future()
        self.pending[self.next_id] = future
        self.channel.send(frame)
        return await future

    def on_frame(self, rx: Received) -> None:
        if self._follow:
            self.loop.set_time(rx["t"])
        future = self.pending.pop(rx.get("id"), None)
        if future is not None and not future.done():
            future.set_result(rx)

    def on_lost(self, error: BaseException) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        self.pending.clear()


def _raise_if_error(rx: Received, counts: bool = False) -> Received:
    error = rx.get("error")
    if error is None:
        return rx
    if error["type"] == "Aborted":
        raise get_aborted(rx, error, counts)
    kind = {"ValueError": ValueError, "PermissionError": PermissionError, "KeyError": KeyError}
    raise kind.get(error["type"], RuntimeError)(error["message"])


class ProxyCluster:
    """The harness's cluster as a controller sees it (follows ``targets.api.Cluster``)."""

    def __init__(self, calls: _Calls, devices: list[Device], memory: PromptMemory) -> None:
        self._calls, self.devices, self._memory = calls, devices, memory
        self._start = asyncio.get_running_loop().time()

    def now(self) -> float:
        return asyncio.get_running_loop().time() - self._start

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def _call(self, method: str, **fields: Any) -> Received:
        return _raise_if_error(await self._calls.call(Frame(kind="cluster", method=method, **fields)))

    async def generate(self, request: GenerateRequest) -> Completion:
        frame = Frame(kind="cluster", method="generate")
        frame.header["request"] = put_request(frame, request, self._memory)
        counts = self._calls.counts
        rx = _raise_if_error(await self._calls.call(frame), counts)
        return get_completion(rx, rx["completion"], counts)

    async def shrink(self, devices: Sequence[Device]) -> None:
        await self._call("shrink", devices=[d.id for d in devices])

    async def expand(self, devices: Sequence[Device]) -> None:
        await self._call("expand", devices=[d.id for d in devices])

    async def train(self, batch: TrainBatch, devices: Sequence[Device]) -> int:
        frame = Frame(kind="cluster", method="train", devices=[d.id for d in devices])
        frame.header["batch"] = put_batch(frame, batch, self._memory)
        return (_raise_if_error(await self._calls.call(frame)))["version"]

    async def train_part(self, batch: TrainBatch, devices: Sequence[Device]) -> None:
        frame = Frame(kind="cluster", method="train_part", devices=[d.id for d in devices])
        frame.header["batch"] = put_batch(frame, batch, self._memory)
        _raise_if_error(await self._calls.call(frame))

    async def sync_weights(self, version: int, devices: Sequence[Device], interrupt: bool = False) -> None:
        await self._call("sync_weights", version=version, devices=[d.id for d in devices], interrupt=interrupt)

    async def serving_load(self) -> ServingLoad:
        return ServingLoad(**(await self._call("serving_load"))["load"])

    async def suspend(self) -> None:
        await self._call("suspend")

    async def resume(self) -> None:
        await self._call("resume")

    async def export_weights(self, into):
        raise PermissionError("export_weights is the harness's; controllers do not call it")

    async def close(self) -> None:
        raise PermissionError("the harness closes the cluster")


class ProxyEpisode:
    """One harness episode (follows ``targets.api.EnvHandle``): its id, its group, reset, step, checkpoint."""

    __slots__ = ("_calls", "episode_id", "group_id")

    def __init__(self, calls: _Calls, episode_id: str, group_id: str) -> None:
        self._calls, self.episode_id, self.group_id = calls, episode_id, group_id

    async def reset(self) -> list[int] | TokenCount:
        rx = _raise_if_error(await self._calls.call(Frame(kind="env", method="reset", episode=self.episode_id)))
        return get_tokens(rx, rx["observation"], self._calls.counts, "observation")

    async def step(self, action: list[int] | TokenCount) -> StepResult:
        frame = Frame(kind="env", method="step", episode=self.episode_id)
        frame.header["action"] = put_tokens(frame, action, self._calls.counts)
        rx = _raise_if_error(await self._calls.call(frame))
        return get_step_result(rx, rx["result"], self._calls.counts)

    async def checkpoint(self) -> None:
        _raise_if_error(await self._calls.call(Frame(kind="env", method="checkpoint", episode=self.episode_id)))


class ProxyEnvs:
    """The harness's environment pool (follows ``EnvSource`` and ``EnvDropper``). Episode ids follow
    the harness's numbering; the harness checks every one it is told about."""

    def __init__(self, calls: _Calls, group_size: int, memory: PromptMemory) -> None:
        self._calls, self.group_size, self._memory = calls, group_size, memory
        self._groups = 0

    def new_group(self, extra: int = 0, relaunch: str | None = None) -> list[ProxyEpisode]:
        index, self._groups = self._groups, self._groups + 1
        self._calls.channel.send(Frame(kind="env", method="new_group", group=index, extra=extra, relaunch=relaunch))
        return [ProxyEpisode(self._calls, f"g{index}/e{m}", f"g{index}") for m in range(self.group_size + extra)]

    def drop(self, episode_id: str, reason: str) -> None:
        if reason not in DROP_REASONS:
            raise ValueError(f"drop reason must be one of {DROP_REASONS}, got {reason!r}")
        self._memory.forget(episode_id)
        self._calls.channel.send(Frame(kind="env", method="drop", episode=episode_id, reason=reason))


async def _controller(channel: AsyncChannel, stack_dir: str) -> None:
    loop = asyncio.get_running_loop()
    calls = _Calls(channel, loop)
    if isinstance(loop, FollowerTimeLoop):
        # Writes wait for the loop to run dry; then, in one burst: the calls, and a notice of how far
        # this loop may sleep (its next timer) and how many harness frames it has taken in.
        channel.corked = channel.bursts = True

        def on_idle(deadline: float | None) -> None:
            channel.flush(idle=(channel.received, deadline))

        loop.on_idle = on_idle
    init = await channel.recv()
    if isinstance(loop, FollowerTimeLoop):
        loop.set_time(init["t"])
    channel.listen(calls.on_frame, calls.on_lost)
    try:
        runtime = get_runtime(init["runtime"])
        stack = _import_stack(stack_dir).build(runtime)
        rollout, train = stack.controller.placement(list(runtime.devices))
        channel.send(
            Frame(
                kind="hello",
                rollout=[d.id for d in rollout],
                train=[d.id for d in train],
                declared=put_declared(stack.declared),
                engine=put_engine_settings(stack.engine),
            )
        )
        memory = PromptMemory(counts=init["counts"])
        calls.counts = init["counts"]
        await stack.controller.run(
            ProxyCluster(calls, list(runtime.devices), memory),
            ProxyEnvs(calls, runtime.workload.group_size, memory),
            init["steps"],
        )
        channel.send(Frame(kind="done"))
    except Exception as error:  # the harness reports it as the candidate's failure
        channel.send(_error_frame(error, kind="failed"))
    await channel.close()


def run_controller(socket_path: str, stack_dir: str, virtual: bool) -> None:
    if not virtual:

        async def main() -> None:
            await _controller(await AsyncChannel.over(_connect(socket_path)), stack_dir)

        asyncio.run(main())
        return
    loop = FollowerTimeLoop()
    asyncio.set_event_loop(loop)
    sock = _connect(socket_path)
    channel = AsyncChannel.polled(sock, shared_ring.accept(sock))  # driven by the loop itself
    loop.io = channel.transport
    try:
        loop.run_until_complete(_controller(channel, stack_dir))
    finally:
        loop.close()


# -- cluster -------------------------------------------------------------------------------------------


async def _serve_cluster(channel: AsyncChannel, exports: socket.socket, stack_dir: str) -> None:
    """``exports``: the second connection, on which the harness hands over each weight region."""
    # imported here, not at the top: it loads torch, which the controller and components processes
    # (the same module) would otherwise pay a second of start-up for without using it
    from targets.harness.ipc.region_writer import IncomingRegions, RegionWriter
    from targets.harness.ipc.weight_export import Layout

    regions = IncomingRegions(exports)  # each mapped as it arrives, ahead of its export
    _log("connected")
    init = await channel.recv()
    runtime: Runtime = get_runtime(init["runtime"])
    by_id = {d.id: d for d in (*runtime.devices, *runtime.serving_devices)}  # a serving pool's: lent by expand
    try:
        stack = _import_stack(stack_dir).build(runtime)
        if stack.make_cluster is None:
            raise ValueError("this stack has no real cluster (make_cluster is None)")
        _log("stack built; starting the cluster")
        cluster = await stack.make_cluster()
    except Exception as error:
        channel.send(_error_frame(error, kind="failed"))
        await channel.close()
        return
    _log("cluster ready")
    channel.send(Frame(kind="ready"))
    finished = asyncio.get_running_loop().create_future()  # set on close, or when the harness goes away

    async def handle(rx: Received) -> None:
        method, frame = rx["method"], Frame(id=rx["id"])
        try:
            devices = [by_id[i] for i in rx.get("devices", [])]
            if method == "generate":
                frame.header["completion"] = put_completion(
                    frame, await cluster.generate(get_plain_request(rx, rx["request"]))
                )
            elif method in ("shrink", "expand"):
                await getattr(cluster, method)(devices)
            elif method == "train":
                frame.header["version"] = await cluster.train(get_batch(rx, rx["batch"]), devices)
            elif method == "train_part":
                await cluster.train_part(get_batch(rx, rx["batch"]), devices)
            elif method == "sync_weights":
                await cluster.sync_weights(rx["version"], devices, interrupt=rx["interrupt"])
            elif method in ("suspend", "resume"):
                await getattr(cluster, method)()
            elif method == "residency":
                frame.header["resident"] = await cluster.residency()
            elif method == "export_weights":
                layout = Layout.from_wire(rx["layout"])
                writer = RegionWriter(await regions.take(rx["number"]), layout)
                try:
                    await cluster.export_weights(writer)
                finally:
                    writer.close()
                frame.header["written"] = writer.written()
            elif method == "close":
                _log("closing the cluster")
                await cluster.close()
                _log("cluster closed")
            else:
                raise ValueError(f"unknown cluster method {method!r}")
        except Aborted as error:  # with its partial response, which the harness records
            frame = Frame(id=rx["id"])
            frame.header["error"] = put_aborted(frame, error)
        except asyncio.CancelledError as error:
            if asyncio.current_task().cancelling():  # the harness's cancel (or the close): it hears the end
                if not finished.done():
                    channel.send(Frame(id=rx["id"], cancelled=True))  # the call's one answer: it forgets it
                raise
            frame = _error_frame(error, id=rx["id"])  # the stack's own code raised it: an error like any
        except Exception as error:  # goes back to the harness, which decides what it means
            frame = _error_frame(error, id=rx["id"])
        channel.send(frame)
        if method == "close" and not finished.done():
            finished.set_result(None)

    tasks: dict[int, asyncio.Task] = {}  # the calls being answered, by the harness's number

    def on_frame(rx: Received) -> None:
        if rx["method"] == "cancel":  # its caller went away: the call is cancelled, answered `cancelled`
            cancelled = tasks.get(rx["call"])
            if cancelled is not None:
                cancelled.cancel()
            return
        task = tasks[rx["id"]] = asyncio.create_task(handle(rx))
        task.add_done_callback(lambda task, number=rx["id"]: tasks.pop(number, None))

    def on_lost(error: BaseException) -> None:
        if not finished.done():
            finished.set_result(None)

    channel.listen(on_frame, on_lost)
    await finished
    for task in list(tasks.values()):
        task.cancel()
    await channel.close()


def run_cluster(socket_path: str, stack_dir: str) -> None:
    async def main() -> None:
        channel = _connect(socket_path)
        exports = _connect(socket_path)
        await _serve_cluster(await AsyncChannel.over(channel), exports, stack_dir)

    asyncio.run(main())


# -- components (accuracy checks) ------------------------------------------------------------------


def run_components(socket_path: str, stack_dir: str) -> None:
    channel = SyncChannel(_connect(socket_path))
    init = channel.recv()
    try:
        stack = _import_stack(stack_dir).build(get_runtime(init["runtime"]))
    except Exception as error:
        channel.send(_error_frame(error, kind="failed"))
        return
    channel.send(Frame(kind="ready"))
    engines: dict[str, Any] = {}
    trainers: dict[str, Any] = {}
    while True:
        rx = channel.recv()
        method, frame = rx["method"], Frame(id=rx.get("id"))
        if method == "close":
            channel.send(frame)
            return
        try:
            _components_call(stack, engines, trainers, rx, frame)
        except Exception as error:
            frame = _error_frame(error, id=rx.get("id"))
        channel.send(frame)


def _components_call(stack, engines: dict, trainers: dict, rx: Received, frame: Frame) -> None:
    from targets.api import SamplingParams

    method = rx["method"]
    if method == "make_engine":
        handle = f"engine{len(engines)}"
        engines[handle] = stack.make_engine()
        frame.header["handle"] = handle
    elif method == "engine_generate":
        p = rx["params"]
        params = SamplingParams(p["max_new_tokens"], p["temperature"], p["seed"], tuple(p["stop_token_ids"]))
        completions = engines[rx["handle"]].generate([rx.ints(a) for a in rx["prompts"]], params)
        frame.header["completions"] = [put_completion(frame, c) for c in completions]
    elif method == "engine_version":
        frame.header["version"] = engines[rx["handle"]].weight_version
    elif method == "make_trainer":
        handle = f"trainer{len(trainers)}"
        trainers[handle] = stack.make_trainer(get_state(rx, rx["state"]), get_config(rx["config"]))
        frame.header["handle"] = handle
    elif method == "trainer_step":
        frame.header["version"] = trainers[rx["handle"]].train_step(get_batch(rx, rx["batch"]))
    elif method == "trainer_version":
        frame.header["version"] = trainers[rx["handle"]].version
    elif method == "trainer_state":
        frame.header["state"] = put_state(frame, trainers[rx["handle"]].state_dict())
    elif method == "sync_engine":
        stack.sync_engine(engines[rx["engine"]], get_state(rx, rx["state"]), rx["version"])
    else:
        raise ValueError(f"unknown components method {method!r}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] not in ROLES + ("controller-virtual",):
        print(
            f"usage: python -m targets.harness.isolation.candidate_process {{{','.join(ROLES)}}} SOCKET STACK_DIR",
            file=sys.stderr,
        )
        return 2
    role, socket_path, stack_dir = argv
    global _STARTED
    _STARTED = time.monotonic()  # its log's clock: from here, whether this process is fresh or a fork of a zygote
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if role == "controller":
        run_controller(socket_path, stack_dir, virtual=False)
    elif role == "controller-virtual":
        run_controller(socket_path, stack_dir, virtual=True)
    elif role == "cluster":
        run_cluster(socket_path, stack_dir)
    else:
        run_components(socket_path, stack_dir)
    _log(f"candidate {role} process done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
