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
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from targets.api import Declared, Runtime
from targets.harness.environments import EnvironmentPool
from targets.harness.environments.hosted import Confinement
from targets.harness.ipc import shared_ring
from targets.harness.ipc.channel import AsyncChannel, Frame
from targets.harness.ipc.remote import CandidateError, RemoteCluster, raise_if_error
from targets.harness.ipc.weight_export import Layout, WeightExporter
from targets.harness.ipc.wire import (
    field_of,
    put_declared,
    put_engine_settings,
    put_runtime,
)
from targets.harness.isolation.controller_link import ControllerLink
from targets.harness.isolation.processes import CandidateProcesses, channel_of
from targets.harness.isolation.serving_gate import ServingGate
from targets.harness.isolation.stack_digest import directory_digest
from targets.harness.isolation.traced_cluster import TracedCluster
from targets.harness.reward_model.service import RewardModelService
from targets.harness.sim.cluster import SimCluster
from targets.harness.sim.cost_model import ClusterCosts
from targets.harness.sim.reward import judge_costs_of, placement_refused
from targets.harness.sim.serving import ServingPool, serving_pool_of
from targets.harness.trace import Trace
from targets.spec import TargetSpec


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
    for role, named in (("rollout", rollout), ("train", train)):
        if len(set(map(str, named))) != len(named):  # the simulator builds an engine for each device named
            raise CandidateError(f"the controller's {role} placement names a device twice: {named}")
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
    # a user's environment in a process of its own, under bubblewrap, out of sight of the run's folder (its
    # actions are the candidate's text)
    envs = await asyncio.to_thread(  # a user's factory may take its time: not on this loop
        EnvironmentPool,
        spec.workload,
        trace.clock,
        trace,
        seed=seed,
        model_path=runtime.model_path,
        confinement=Confinement(processes.sandbox, (weights.parent,), processes.memory_bytes),
    )
    try:
        return await _drive_with_envs(spec, runtime, processes, steps, trace, mark, remote, exporter, envs, make_pool)
    finally:
        await asyncio.to_thread(envs.close)  # the process a user's environment ran in, whatever happened


async def _drive_with_envs(
    spec: TargetSpec,
    runtime: Runtime,
    processes: CandidateProcesses,
    steps: int,
    trace: Trace,
    mark: Marks,
    remote: RemoteCluster,
    exporter: WeightExporter,
    envs: EnvironmentPool,
    make_pool: Callable[..., ServingPool] | None,
) -> dict:
    """The rest of ``drive_real`` once its environments exist: the controller's link, the run, its end."""
    channel = await channel_of(processes, "controller")
    link = ControllerLink(channel, envs, trace.clock, virtual=False, vocab=spec.model.config.vocab_size)
    link.send(Frame(kind="init", runtime=put_runtime(runtime), steps=steps, counts=False))
    serving = asyncio.create_task(link.serve())
    judge: RewardModelService | None = None
    gate: ServingGate | None = None
    try:
        rollout, _, declared = await _hello(link, processes, [d.id for d in runtime.devices])
        # engines the target's simulator cannot run are refused here as there (the twin, fitted to this run's
        # trace, reads them as its engines: a red team's declared 4-device engines on a target of 1 passed)
        refused = ClusterCosts.from_spec(spec).refusal(link.engine, spec.simulator.max_engine_scale)
        if refused:
            raise CandidateError(refused)
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
            stack=directory_digest(processes.stack_dir / "stack"),  # calibrate --trace checks it fits that stack
            rollout=rollout,
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
            stack=directory_digest(processes.stack_dir / "stack"),  # calibrate --trace checks it fits that stack
            rollout=rollout_ids,
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
