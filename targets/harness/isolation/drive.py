"""A system run: the candidate's controller, in a sandboxed process of its own, drives a cluster
through the harness, with harness-owned environments, for a number of training steps.

Three processes, and the harness in the middle of every call::

    controller process --(channel)--> harness: TracedCluster --(channel)--> cluster process (Ray actors)
                                      harness: EnvironmentPool

The harness stamps each call with its own clock into its own trace and snapshots the weights after
each training step; nothing a candidate patches in its processes changes what is recorded, and the
cluster only ever receives what the harness forwarded (the batch the audit replays is the batch the
trainer got). Under simulated execution the cluster is the harness's ``SimCluster`` and the clock is
virtual: the harness advances it only when the controller process says it is idle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from targets.api import Aborted, Completion, Declared, EngineSettings, GenerateRequest, Runtime, StepResult, TokenIds
from targets.errors import UserError
from targets.harness.environments import EnvironmentPool, Episode
from targets.harness.ipc import shared_ring
from targets.harness.ipc.channel import AsyncChannel, Frame, Received
from targets.harness.ipc.protocol import ProtocolError
from targets.harness.ipc.remote import CandidateError, RemoteCluster, raise_if_error
from targets.harness.ipc.weight_export import Layout, WeightExporter
from targets.harness.ipc.wire import (
    PromptMemory,
    field_of,
    get_batch,
    get_declared,
    get_engine_settings,
    get_request,
    get_tokens,
    put_aborted,
    put_completion,
    put_declared,
    put_engine_settings,
    put_runtime,
    put_step_result,
    put_tokens,
)
from targets.harness.isolation.episode_activity import EpisodeActivity
from targets.harness.isolation.processes import CandidateProcesses, channel_of
from targets.harness.isolation.serving_gate import ServingGate
from targets.harness.isolation.traced_cluster import TracedCluster
from targets.harness.reward_model.service import RewardModelService
from targets.harness.sim.cluster import SimCluster
from targets.harness.sim.engine import simulated_response
from targets.harness.sim.reward import judge_costs_of, placement_refused
from targets.harness.sim.serving import serving_pool_of
from targets.harness.trace import Trace
from targets.spec import TargetSpec


class ControllerLink:
    """The harness's end of the controller process: serves its environment and cluster calls, each
    as it arrives, and under virtual time tracks whether it is idle (``IdlePeer``)."""

    def __init__(self, channel: AsyncChannel, envs: EnvironmentPool, clock, virtual: bool) -> None:
        self.channel, self.envs, self.clock, self.virtual = channel, envs, clock, virtual
        self.cluster: TracedCluster | None = None  # set by ``open`` once the controller said hello
        # environment and cluster calls that came before ``open``: served then, in order, so nothing
        # the controller asks starts before the run does (a reward model's judges load in between)
        self._held: list[Received] = []
        self.memory = PromptMemory(counts=virtual)  # a simulated run keeps token counts only
        self.episodes: dict[str, Any] = {}
        self.activity = EpisodeActivity(clock.now)  # what each episode has under way, and how long it sat idle
        self.declared = Declared()  # what the controller's hello declares
        self.engine = EngineSettings()  # what the simulator models of its engines (the hello says)
        # a reward model's: judge(episode, then) as the episode's last step ends; then(score) with the verdict
        self.judge: Callable[[Episode, Callable[[float], None]], None] | None = None
        loop = asyncio.get_running_loop()
        self.hello: asyncio.Future = loop.create_future()
        self.done: asyncio.Future = loop.create_future()
        self._idle_received, self._deadline = -1, None
        self.waits = 0  # idle notices: how often the harness waited on the controller (round trips)
        self._numbers = itertools.count()  # numbers the calls under way
        self._tasks: dict[int, asyncio.Task] = {}  # cluster calls being answered, by number
        self._steps: dict[int, asyncio.TimerHandle] = {}  # environment steps and checkpoints under way, by number

    # -- IdlePeer ------------------------------------------------------------------------------------
    def idle_until(self) -> tuple[bool, float | None]:
        return self._idle_received == self.channel.sent, self._deadline

    def wake(self, now: float) -> None:
        self.send(Frame(kind="time"))

    def flush(self) -> None:
        self.channel.flush()

    def _on_idle(self, received: int, deadline: float | None) -> None:
        """The controller's idle notice (the end of its burst): it has taken in ``received`` frames."""
        self._idle_received, self._deadline = received, deadline
        self.waits += 1

    # -- frames ----------------------------------------------------------------------------------------
    def send(self, frame: Frame) -> None:
        if self.virtual:
            frame.header["t"] = self.clock.now()
        self.channel.send(frame)

    def fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)

    async def serve(self) -> None:
        """Serve frames until the controller is done (or fails, or breaks the protocol)."""
        self.channel.listen(self._on_frame, self._on_lost, self._on_idle)
        try:
            await self.done
        finally:
            for step in self._steps.values():
                step.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _on_frame(self, rx: Received) -> None:
        if self.done.done():
            return
        try:
            self._dispatch(rx)
        except ProtocolError as error:
            self.fail(ProtocolError(f"the controller process broke the protocol: {error}"))

    def _on_lost(self, error: BaseException) -> None:
        self.fail(ProtocolError(f"the controller process hung up before it was done: {error}"))

    def _dispatch(self, rx: Received) -> None:
        kind = rx.get("kind")
        if kind in ("env", "cluster") and self.cluster is None:
            if kind == "cluster" and not self.hello.done():
                raise ProtocolError("a cluster call before the controller's hello")
            self._held.append(rx)
        elif kind == "hello":
            if not self.hello.done():
                self.declared = get_declared(field_of(rx.header, "declared", dict, "hello"))
                self.engine = get_engine_settings(field_of(rx.header, "engine", dict, "hello"))
                refused = self.envs.workload.over_declared_limits(self.declared)
                if refused:
                    raise ProtocolError(refused)
                # before the controller's first new_group, which may follow in the same burst
                self.envs.max_extra = self.declared.redundant_per_group
                self.hello.set_result(rx)
        elif kind == "done":
            if not self.done.done():
                self.done.set_result(None)
        elif kind == "failed":
            error = rx.get("error") or {}
            raised = f"the controller raised {error.get('type')}: {error.get('message')}\n"
            self.fail(CandidateError(raised + str(error.get("traceback", ""))[-3000:]))
        elif kind == "env" and rx.get("method") == "new_group":
            group = field_of(rx.header, "group", int, "new_group")
            if group != self.envs.groups_created:
                raise ProtocolError(
                    f"the controller numbered a new group {group}, the harness's next is {self.envs.groups_created}"
                )
            relaunch = rx.get("relaunch")
            if relaunch is not None and not isinstance(relaunch, str):
                raise ProtocolError(f"new_group.relaunch: expected a group id or null, got {relaunch!r}")
            try:
                episodes = self.envs.new_group(field_of(rx.header, "extra", int, "new_group"), relaunch)
            except ValueError as error:
                raise ProtocolError(str(error)) from None
            for episode in episodes:
                self.episodes[episode.episode_id] = episode
                self.activity.created(episode.episode_id)
        elif kind == "env" and rx.get("method") == "drop":
            episode = field_of(rx.header, "episode", str, "drop")
            self.memory.forget(episode)
            idle = self.activity.of(episode)
            try:
                self.envs.drop(episode, field_of(rx.header, "reason", str, "drop"), idle)
            except ValueError as error:
                raise ProtocolError(str(error)) from None
        elif kind == "env":
            self._env(rx)
        elif kind == "cluster":
            # Tokens travel as deltas against the episode's last prompt: decode them now, in arrival
            # order, before a drop later in the same burst (a cancelled spare) forgets that prompt.
            self._call(rx, self._decode_tokens(rx))
        else:
            raise ProtocolError(f"unknown frame kind {kind!r}")

    def _decode_tokens(self, rx: Received):
        """A generate call's request or a train (or train_part) call's batch (both carry prompt deltas), else None."""
        method = rx.get("method")
        try:
            if method == "generate":
                return get_request(rx, field_of(rx.header, "request", dict, "generate"), self.memory)
            if method in ("train", "train_part"):
                return get_batch(rx, field_of(rx.header, "batch", dict, method), self.memory)
        except ValueError as error:  # a sampling or batch field the contract's own types refuse
            raise ProtocolError(str(error)) from None
        return None

    def open(self, cluster: TracedCluster) -> None:
        """Serve calls on ``cluster`` from now on: the run has started. The calls that came before
        are served first, in the order they came (a drop after a generate forgets its prompt after)."""
        self.cluster = cluster
        held, self._held = self._held, []
        for rx in held:
            self._on_frame(rx)

    def _call(self, rx: Received, tokens) -> None:
        key = next(self._numbers)
        if rx.get("method") == "generate":
            self._generate(rx.get("id"), tokens, key)
        else:
            self._tasks[key] = asyncio.create_task(self._answer(rx, tokens, key))

    def _generate(self, request_id: Any, request: GenerateRequest, key: int) -> None:
        """Answer a generate call when the cluster has served it (a callback, not a task a turn)."""

        self.activity.begin(request.episode_id, generate=True)

        def done(result: Completion | BaseException) -> None:
            self._tasks.pop(key, None)
            self.activity.end(request.episode_id, generate=True)
            if self.done.done():
                return  # the run is over: nobody waits for this answer
            try:
                if isinstance(result, BaseException):
                    reply = self._error_reply(request_id, result)
                else:
                    reply = Frame(id=request_id)
                    reply.header["completion"] = put_completion(reply, result, self.memory.counts)
            except Exception as error:  # noqa: BLE001 - a harness bug: the run fails with it, loudly
                self.fail(error)
                return
            if reply is not None:
                self.send(reply)

        task = self.cluster.generate_then(request, done)
        if task is not None:
            self._tasks[key] = task

    async def _answer(self, rx: Received, tokens, key: int) -> None:
        """Answer one cluster call (a task of its own: it takes the cluster's time)."""
        request_id = rx.get("id")
        try:
            reply = Frame(id=request_id)
            await self._cluster(rx, reply, tokens)
        except Exception as error:  # noqa: BLE001 - _error_reply sorts out what the controller is told
            reply = self._error_reply(request_id, error)
        finally:
            del self._tasks[key]  # here, not in a done callback: one loop turn less per call
        if reply is not None:
            self.send(reply)

    def _error_reply(self, request_id: Any, error: Exception) -> Frame | None:
        """What the controller is told of a call that raised, as it would be in-process; None (and
        the run fails) when the call broke the protocol, or when the error is none a call may raise:
        the harness's own bug, which fails the run with it (raised here, in a task nobody awaits, it
        would leave the controller waiting for an answer until the run's time limit)."""
        if isinstance(error, ProtocolError):
            self.fail(ProtocolError(f"the controller process broke the protocol: {error}"))
            return None
        if isinstance(error, Aborted):  # its partial response only goes to a stack that declared it resumes them
            frame = Frame(id=request_id)
            partial = error if self.declared.partial_rollout else Aborted(str(error))
            frame.header["error"] = put_aborted(frame, partial, self.memory.counts)
            return frame
        if isinstance(error, (CandidateError, ValueError, KeyError, PermissionError, RuntimeError)):
            # the candidate's own cluster raised, or the controller misused the contract: it is told, as in-process
            kind = "RuntimeError" if isinstance(error, CandidateError) else type(error).__name__
            return Frame(id=request_id, error={"type": kind, "message": str(error)[:2000]})
        self.fail(error)
        return None

    def _env(self, rx: Received) -> None:
        """A reset is answered at once; a step or a checkpoint when its time has passed (a timer, not a task)."""
        request_id, counts = rx.get("id"), self.memory.counts
        reply = Frame(id=request_id)
        try:
            episode_id = field_of(rx.header, "episode", str, "env call")
            if episode_id not in self.episodes:
                raise KeyError(f"no episode {episode_id!r}: the harness never created it")
            episode = self.episodes[episode_id]
            if episode.asynchronous and rx["method"] in ("reset", "step"):  # a user's environment: its own time
                action = None
                if rx["method"] == "step":
                    action = get_tokens(rx, field_of(rx.header, "action", dict, "step"), counts, "step.action")
                key = next(self._numbers)
                self._tasks[key] = asyncio.create_task(self._user_env(key, request_id, reply, episode, action))
                return
            if rx["method"] == "reset":
                reply.header["observation"] = put_tokens(reply, episode.reset_now(), counts)
                self.activity.begin(episode_id)
                self.activity.end(episode_id)
            elif rx["method"] == "step":
                action = get_tokens(rx, field_of(rx.header, "action", dict, "step"), counts, "step.action")
                if counts:  # what a simulated engine's response of that length says (the environment reads it)
                    action = simulated_response(episode_id, len(action))
                latency, failures = episode.begin_step()
                self.activity.begin(episode_id)

                def stepped() -> bool:
                    result = episode.end_step(action, latency, failures)
                    self.activity.end(episode_id, finished=result.done)
                    if not self._judged(result):
                        reply.header["result"] = put_step_result(reply, result, counts)
                        return False

                    def verdict(score: float) -> None:  # the judge's score joins the last turn's reward
                        judged = dataclasses.replace(result, reward=result.reward + score)
                        reply.header["result"] = put_step_result(reply, judged, counts)
                        self._send_unless_done(reply)

                    self.judge(episode, verdict)
                    return True  # answered once the verdict is in

                self._answer_after(latency, reply, stepped)
                return
            elif rx["method"] == "checkpoint":
                # the first since the episode's last step is work on it; another at the same turn saves
                # nothing new, and would keep an episode the stack holds looking under way
                first = episode.checkpoint_turn < episode.turn
                seconds = episode.begin_checkpoint()
                if first:
                    self.activity.begin(episode_id)

                def checkpointed() -> None:
                    episode.end_checkpoint()
                    if first:
                        self.activity.end(episode_id)

                self._answer_after(seconds, reply, checkpointed)
                return
            else:
                raise ProtocolError(f"unknown env method {rx['method']!r}")
        except Exception as error:  # noqa: BLE001 - _error_reply sorts out what the controller is told
            reply = self._error_reply(request_id, error)
        if reply is not None:
            self.send(reply)

    async def _user_env(self, key: int, request_id: Any, reply: Frame, episode, action: TokenIds | None) -> None:
        """A reset (``action`` None) or a step of a user's environment, answered when it answers. A call
        the contract forbids (a second reset, a step after the end) is the controller's error; the
        environment raising ends the run with its message (the user's code, not the candidate's)."""
        self.activity.begin(episode.episode_id)
        under_way = True
        try:
            if action is None:
                reply.header["observation"] = put_tokens(reply, await episode.reset(), self.memory.counts)
            else:
                result = await episode.step(action)
                self.activity.end(episode.episode_id, finished=result.done)  # a verdict may follow
                under_way = False
                if self._judged(result):  # the judge's score joins the last turn's reward
                    verdict = asyncio.get_running_loop().create_future()
                    self.judge(episode, lambda score: None if verdict.done() else verdict.set_result(score))
                    result = dataclasses.replace(result, reward=result.reward + await verdict)
                reply.header["result"] = put_step_result(reply, result, self.memory.counts)
        except UserError as error:
            self.fail(error)
            return
        except Exception as error:  # noqa: BLE001 - _error_reply sorts out what the controller is told
            reply = self._error_reply(request_id, error)
        finally:
            self._tasks.pop(key, None)
            if under_way:  # a reset, or a call that raised
                self.activity.end(episode.episode_id)
        if reply is not None:
            self.send(reply)

    def _judged(self, result: StepResult) -> bool:
        """Whether a reward model judges the episode this step ended (it ended well)."""
        return self.judge is not None and result.done and not result.timed_out and not result.lost

    def _send_unless_done(self, reply: Frame) -> None:
        """A reply that may come after the controller is done (a verdict the run's end overtook): dropped then."""
        if not self.done.done():
            self.send(reply)

    def _answer_after(self, seconds: float, reply: Frame, finish: Callable[[], bool | None]) -> None:
        """Send ``reply`` once ``seconds`` have passed, ``finish`` having ended the environment's work
        (and filled the reply; True: a reward model judges first, and ``finish`` sends it then): a
        timer, not a task, cancelled with the link if the run ends first."""
        key = next(self._numbers)

        def answer() -> None:
            del self._steps[key]
            if not finish():  # True: ``finish`` sends the reply itself, later
                self.send(reply)

        self._steps[key] = asyncio.get_running_loop().call_later(seconds, answer)

    async def _cluster(self, rx: Received, reply: Frame, tokens) -> None:
        """``tokens``: the generate request or train batch, decoded as the frame arrived."""
        cluster = self.cluster
        by_id, names = cluster.by_id, rx.get("devices")
        if names is not None and (not isinstance(names, list) or any(n not in by_id for n in names)):
            raise ValueError(f"unknown devices {names!r}; this cluster has {sorted(by_id)}")
        devices = [] if names is None else [by_id[n] for n in names]
        method = rx.get("method")
        if method in ("shrink", "expand"):
            await getattr(cluster, method)(devices)
        elif method == "train":
            reply.header["version"] = await cluster.train(tokens, devices)
        elif method == "train_part":
            await cluster.train_part(tokens, devices)
        elif method == "sync_weights":
            await cluster.sync_weights(
                field_of(rx.header, "version", int, "sync_weights"),
                devices,
                interrupt=field_of(rx.header, "interrupt", bool, "sync_weights"),
            )
        elif method in ("suspend", "resume"):
            if method == "suspend":
                self.activity.suspended(True)
            await getattr(cluster, method)()
            if method == "resume":
                self.activity.suspended(False)
        elif method == "serving_load":
            reply.header["load"] = dataclasses.asdict(await cluster.serving_load())
        else:
            raise ProtocolError(f"unknown cluster method {method!r}")


async def _hello(
    link: ControllerLink, processes: CandidateProcesses, devices: list[str]
) -> tuple[list[str], list[str], Declared]:
    """The controller's placement and declarations, once it has built its stack."""

    await asyncio.wait({link.hello, link.done}, return_when=asyncio.FIRST_COMPLETED)
    if not link.hello.done():
        link.done.result()  # the controller failed before saying hello: raise why
        raise CandidateError(f"the controller process ended before saying hello:\n{processes.log_tail('controller')}")
    hello = link.hello.result()
    rollout = field_of(hello.header, "rollout", list, "hello")
    train = field_of(hello.header, "train", list, "hello")
    refused = placement_refused(link.envs.workload, link.engine, rollout, train, devices)
    if refused:
        raise CandidateError(refused)
    return rollout, train, link.declared


Marks = Callable[[str], None]
"""Tells the parent process the moment the run starts and ends (it times them with its own clock)."""


async def drive_real(
    spec: TargetSpec,
    runtime: Runtime,
    processes: CandidateProcesses,
    steps: int,
    seed: int,
    trace: Trace,
    weights: Path,
    mark: Marks,
    version_zero: Callable[[], Layout],
    before_run: Callable[[], Awaitable[None]] | None = None,
) -> dict:
    """A real run: the candidate's cluster process (its engines and trainers on Ray) behind the proxy, a serving
    pool's traffic beside it (``serving_gate.py``). ``version_zero`` runs here while the candidate's cluster
    starts: it writes the harness's own version 0 into ``weights`` and says the layout every later version is
    exported in. ``before_run`` (a check's accuracy phase, in a thread) is awaited before this process touches a
    model: torch's defaults are process-wide, and a model loading here would change them under it."""
    processes.launch("cluster", connections=2)
    processes.launch("controller")
    cluster_channel = await channel_of(processes, "cluster")
    exports = processes.accept("cluster")  # the cluster's second connection: weight regions travel on it
    cluster_channel.send(Frame(kind="init", runtime=put_runtime(runtime)))
    if before_run is not None:
        await before_run()
    layout = version_zero()
    make_pool = await asyncio.to_thread(serving_pool_of, spec, seed)  # its capacity profile: a loop of its own
    raise_if_error(await cluster_channel.recv(), "make_cluster")
    remote = RemoteCluster(cluster_channel, list(runtime.devices))
    exporter = WeightExporter(layout, exports, weights, remote.export_into)
    remote.start()
    envs = EnvironmentPool(spec.workload, trace.clock, trace, seed=seed, model_path=runtime.model_path)
    link = ControllerLink(await channel_of(processes, "controller"), envs, trace.clock, virtual=False)
    link.send(Frame(kind="init", runtime=put_runtime(runtime), steps=steps, counts=False))
    serving = asyncio.create_task(link.serve())
    judge: RewardModelService | None = None
    gate: ServingGate | None = None
    try:
        rollout, _, declared = await _hello(link, processes, [d.id for d in runtime.devices])
        if make_pool is not None:  # its traffic starts with the run
            gate = ServingGate(remote, make_pool(trace.clock.now), runtime.serving_devices)
        traced = TracedCluster(gate or remote, trace, exporter)
        if spec.workload.reward_model is not None:  # its instances loaded before the run starts
            judge = RewardModelService.for_run(spec, link.engine, runtime, trace, traced.last_device.get, link.fail)
            await judge.start(rollout)
            link.judge = judge.judge
        trace.record(
            "run_start",
            devices=[d.id for d in runtime.devices],
            steps=steps,
            stop_token_ids=list(runtime.stop_token_ids),
            tokens_recorded=True,
            engines={},
            declared=put_declared(declared),
            engine=put_engine_settings(link.engine),
        )
        link.open(traced)
        await traced._residency()
        mark("run_start")
        await serving
    finally:
        trace.record("run_end")
        mark("run_end")
        end = trace.clock.now()
        if not serving.done():
            serving.cancel()
        if judge is not None:
            trace.record("reward_service", **judge.summary(end))
            await judge.close()
        if gate is not None:
            await gate.close(trace, end, ran=serving.done() and not serving.cancelled() and not serving.exception())
        closing = asyncio.ensure_future(asyncio.wait_for(remote.close(), timeout=120))
        await asyncio.wait({closing})
        saving = asyncio.ensure_future(exporter.saved())
        await asyncio.wait({saving})
        exporter.close()
    closing.result()  # reached only when the run itself succeeded: then a failed close is the candidate's failure
    saving.result()
    return {"steps": steps, "versions": [0, *exporter.versions]}


def drive_simulated(
    spec: TargetSpec, runtime: Runtime, processes: CandidateProcesses, steps: int, seed: int
) -> tuple[Trace, dict]:
    """A simulated run: the harness's ``SimCluster`` under virtual time that only the harness moves."""
    from targets.harness.sim.cost_model import ClusterCosts
    from targets.harness.sim.response_length import ResponseLengths
    from targets.harness.sim.reward import RewardService, dedicated_engines
    from targets.harness.sim.virtual_time import VirtualClock, VirtualTimeLoop, run_virtual

    costs = ClusterCosts.from_spec(spec)
    make_serving = serving_pool_of(spec, seed)
    loop = VirtualTimeLoop()
    trace = Trace(VirtualClock(loop), record_tokens=False)
    summary: dict = {}
    processes.launch("controller-virtual")

    async def main() -> None:
        envs = EnvironmentPool(spec.workload, trace.clock, trace, seed=seed, counts=True)
        sock = processes.accept("controller-virtual")
        channel = AsyncChannel.polled(sock, shared_ring.offer(sock))  # driven by the loop itself
        link = ControllerLink(channel, envs, trace.clock, virtual=True)
        channel.corked = channel.bursts = True  # flushed by the loop when it runs dry
        loop.peer, loop.io = link, channel.transport
        link.send(Frame(kind="init", runtime=put_runtime(runtime), steps=steps, counts=True))
        answering = asyncio.create_task(link.serve())
        rollout_ids, _, declared = await _hello(link, processes, [d.id for d in runtime.devices])
        by_id = {d.id: d for d in runtime.devices}
        if any(i not in by_id for i in rollout_ids):
            raise CandidateError(f"the controller placed engines on unknown devices {rollout_ids}")
        lengths = ResponseLengths(spec.workload.tokens, seed, envs.task_of)
        refused = costs.refusal(link.engine, spec.simulator.max_engine_scale)
        if refused:
            raise CandidateError(refused)
        engine_costs = costs.for_engines(link.engine)
        summary["engine_devices"] = engine_costs.engine_devices  # the stack's engines, which the metrics weigh
        judge, judge_costs = None, judge_costs_of(spec)
        if judge_costs is not None and link.engine.reward == "colocated":  # the judge's weights beside each engine
            engine_costs = engine_costs.hosting(judge_costs.shared.weight_bytes)
        if judge_costs is not None and link.engine.reward == "dedicated":
            engines = dedicated_engines(link.engine.reward_devices, judge_costs)
            if isinstance(engines, str):
                raise CandidateError(engines)
        serving = make_serving() if make_serving is not None else None
        devices = list(runtime.devices + runtime.serving_devices)
        cluster = SimCluster(
            devices, [by_id[i] for i in rollout_ids], engine_costs, lengths, serving, link.engine.reward_devices
        )
        if judge_costs is not None:
            judge = RewardService(
                spec.workload.reward_model, link.engine, cluster, judge_costs, costs.shared, trace, link.fail
            )
            link.judge = judge.judge
        traced = TracedCluster(cluster, trace, cluster)
        trace.record(
            "run_start",
            devices=[d.id for d in runtime.devices],
            steps=steps,
            stop_token_ids=list(runtime.stop_token_ids),
            tokens_recorded=False,
            engines=cluster.engine_devices,
            declared=put_declared(declared),
            engine=put_engine_settings(link.engine),
        )
        link.open(traced)
        await traced._residency()
        try:
            await answering
        finally:
            trace.record("run_end")
            end = trace.clock.now()
            if judge is not None:
                trace.record("reward_service", **judge.summary(end))
                judge.close()
            ran = answering.done() and not answering.cancelled() and answering.exception() is None
            if serving is not None and ran:  # after the job's end: the requests it left in flight are served out
                loop.peer = loop.io = None  # the controller is done: virtual time is the harness's alone
                await serving.finish()
                trace.record("serving", **serving.summary(end))
            summary["peak_kv_fraction"] = cluster.peak_kv_fraction
            # the smallest pool's, less what a colocated judge's weights take from it
            summary["kv_capacity_tokens"] = min(cost.kv_capacity_tokens for cost in engine_costs.pools.values())
            summary["preemptions"] = cluster.preemptions
            summary["decode_seconds"], summary["decode_batch"] = cluster.decoding()
            summary["prefilled_tokens"], summary["restored_tokens"], summary["prefill_seconds"] = cluster.prefills()
            summary["controller_round_trips"] = link.waits
            summary["controller_wait_seconds"] = loop.waited_s
            await cluster.close()
            loop.peer = loop.io = None

    started = time.perf_counter()
    run_virtual(main(), loop)
    summary.update(
        virtual_seconds=trace.clock.now(),
        wall_seconds=time.perf_counter() - started,
        simulated=True,
        steps=steps,
    )
    return trace, summary
