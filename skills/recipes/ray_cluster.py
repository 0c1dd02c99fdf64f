"""The real ``targets.api.Cluster`` on Ray: one actor per device, holding the device's rollout engine
(a device that may roll out), its FSDP2 trainer rank (a training device), or both.

Placement: on GPU targets a placement group with one GPU bundle per device, each actor on its own
bundle; on CPU targets one custom Ray resource per logical device. Ray starts here (the candidate's
cluster process) and stops on ``close``, unless ``RAY_ADDRESS`` names a cluster already running: the
actors then join it, and ``close`` leaves it running.

A serving pool's devices (``lendable``, from ``Runtime.serving_devices``) get an engine each, asleep
until an ``expand`` borrows the device (the harness drains its serving traffic first) and asleep
again from the ``shrink`` that gives it back; no trainer rank ever runs there.

Memory: a device hosting both an engine and a trainer rank gives it to one at a time. ``shrink`` (or
``suspend``) puts the engines to sleep and brings the trainers back; ``expand`` (or ``resume``)
offloads the trainers' optimizer state, wakes the engines' weights, syncs them, offloads the
trainers' parameters and wakes the KV caches (on CPU the trainers leave whole first: nothing moves
there, and the sync needs no parameters on the device). ``train`` refuses devices whose engine is awake.

Weight sync, by placement: the object store on CPU; on GPU, an in-place copy to the engine on trainer
rank 0's device (the same process) and a broadcast group (NCCL) to engines on other GPUs.

Mechanism only; the controller decides when to shrink, train, sync and expand. ``generate`` goes to the
active engine that served the episode's previous turn (its prefix is cached there) unless that engine
has clearly more in flight than the least loaded one, else to the least loaded.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import ray
from ray.job_config import JobConfig

from targets.api import (
    Aborted,
    Completion,
    Device,
    GenerateRequest,
    Runtime,
    StateDict,
    TrainBatch,
    TrainingConfig,
    WeightExport,
)

from .engine_server import EngineServer
from .fsdp_trainer import FSDPTrainer
from .rendezvous import Rendezvous
from .weight_sync import DEFAULT_BUCKET_BYTES, BroadcastGroup, Layout, merge, publish

# Calls a device's actor runs at once (Ray's default for an async actor is 1,000): a request that came early
# waits in the actor for an earlier one (``arrival_order.py``), which must find a slot to come in.
ACTOR_CALLS = 100_000
STICKY_SLACK = 4  # requests an engine may have beyond the least loaded one and still keep its episodes
# The engine options whose technique keeps counts of its own (``EngineServer.counts``): what the
# cluster's log calls it, and the line it writes for each engine at close.
COUNTED = {
    "speculative_tokens": ("speculative decoding", "{kept} of {drafted} drafted tokens kept"),
    "host_kv_tokens": ("host tier", "{host_restored} tokens restored of {host_saved} saved"),
    "prefill_chunk": ("chunked prefill", "{chunks} prompt chunks computed short of their prompt's end"),
}


def join_or_start_ray(runtime: Runtime) -> str | None:
    """Joins the Ray cluster ``RAY_ADDRESS`` names (already running, its resources naming the devices:
    a multi-machine cluster, or one a test module shares), else starts one on this machine: then the
    session folder it made, for ``close`` to remove (None when it joined)."""
    devices = (*runtime.devices, *runtime.serving_devices)  # a serving pool's too: rollout may borrow them
    resources = {} if runtime.accelerator == "cuda" else {f"{runtime.device_resource}{d.index}": 1.0 for d in devices}
    if not os.environ.get("RAY_ADDRESS"):
        folder = tempfile.mkdtemp(prefix="vtray-", dir="/tmp")
        ray.init(
            num_cpus=os.cpu_count(),
            resources=resources,
            include_dashboard=False,
            configure_logging=False,
            _temp_dir=folder,
        )
        return folder
    # Its workers are the cluster's: they import the stack from the paths this process was given, as
    # a code search path. (A runtime_env setting PYTHONPATH instead costs each actor a worker of its
    # own started through Ray's setup script, which imports Ray once more: ~1 CPU-second per actor.)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ray.init(configure_logging=False, job_config=JobConfig(code_search_path=paths))
    address = os.environ["RAY_ADDRESS"]
    offered = ray.cluster_resources()
    needed = {"GPU": float(len(runtime.devices))} if runtime.accelerator == "cuda" else resources
    missing = sorted(f"{name} ({amount:g})" for name, amount in needed.items() if offered.get(name, 0) < amount)
    if missing:
        ray.shutdown()
        raise RuntimeError(
            f"the Ray cluster at RAY_ADDRESS={address} lacks {', '.join(missing)}: start it with the devices' resources"
        )
    print(f"joined the Ray cluster at {address}", file=sys.stderr)
    return None


def rendezvous_host() -> str:
    """Where the ranks reach this process's store: loopback on a cluster of this machine alone, this
    node's address on a cluster it joined (ranks on other machines would reach their own loopback and
    wait out the store's timeout). The store listens on every interface either way."""
    return ray.util.get_node_ip_address() if os.environ.get("RAY_ADDRESS") else "127.0.0.1"


async def placement_group_of(runtime: Runtime):
    """On GPU, one bundle (a GPU and a CPU) per device, packed onto as few nodes as fit; bundle i is
    device i. None on CPU (devices are custom resources there)."""
    if runtime.accelerator != "cuda":
        return None
    from ray.util.placement_group import placement_group

    group = placement_group([{"GPU": 1, "CPU": 1} for _ in runtime.devices], strategy="PACK")
    await group.ready()
    return group


def actor_options(runtime: Runtime, device: Device, placement) -> dict:
    """Where the actor of ``device`` runs, holding all of it: the device's bundle on GPU, its custom
    resource on CPU."""
    if runtime.accelerator == "cuda":
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": 0,
            "num_gpus": 1.0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement, placement_group_bundle_index=device.index
            ),
        }
    return {"num_cpus": 0, "resources": {f"{runtime.device_resource}{device.index}": 1.0}}


class DeviceActor:
    """One device's Ray actor: its rollout engine, its trainer rank, or both. A device that changes
    role keeps one process (no second Ray worker and torch import; the sync on trainer rank 0's device
    is an in-place copy, as in the local cluster). Engine calls run on the actor's event loop (the
    ``EngineServer``); trainer calls on one thread of their own, one at a time in arrival order (so
    every rank meets its collectives in the same order), and the loop keeps answering meanwhile."""

    def __init__(self, engine: dict | None, trainer: dict | None) -> None:
        self.server = EngineServer(**engine) if engine is not None else None
        self._trainer_thread = ThreadPoolExecutor(1, thread_name_prefix="trainer")  # CUDA's device is per thread
        self.trainer = self._trainer_thread.submit(FSDPTrainer, **trainer).result() if trainer is not None else None
        self._group: BroadcastGroup | None = None

    def _on_trainer(self, method, *args):
        """``method(*args)`` on the trainer's thread, queued now (before the caller's first await)."""
        return asyncio.wrap_future(self._trainer_thread.submit(method, *args))

    # -- the engine ------------------------------------------------------------------------------------
    async def generate(self, prompt, params, episode=None, arrival=None) -> Completion:
        return await self.server.generate(prompt, params, episode, arrival)

    async def forget(self, arrival: int) -> None:
        self.server.forget(arrival)

    async def sleep(self, tags: Sequence[str] = ("weights", "kv_cache")) -> int:
        return await self.server.sleep(tags)

    async def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> int:
        return await self.server.wake(tags)

    async def load_weights(self, buckets: Sequence, version: int, interrupt: bool = False) -> int:
        """The engine's version after the load: an engine put to sleep meanwhile skips it."""
        return await self.server.load_weights(buckets, version, interrupt, unless_asleep=True)

    async def weight_version(self) -> int:
        return await self.server.weight_version()

    async def counts(self) -> dict[str, int]:
        return await self.server.counts()

    # -- the trainer rank ------------------------------------------------------------------------------
    async def train_step(self, batch: TrainBatch) -> int:
        return await self._on_trainer(self.trainer.train_step, batch)

    async def train_part(self, batch: TrainBatch) -> None:
        await self._on_trainer(self.trainer.train_part, batch)

    async def state_dict(self) -> StateDict:
        return await self._on_trainer(self.trainer.state_dict)

    async def offload(self, parts: tuple[str, ...] = ("optimizer", "params")) -> None:
        await self._on_trainer(self.trainer.offload, parts)

    async def reload(self) -> None:
        await self._on_trainer(self.trainer.reload)

    async def close(self) -> None:
        try:
            if self.server is not None:
                await self.server.close()
        finally:  # the trainer's rank leaves its group whatever the engine's close raised
            if self.trainer is not None:
                await self._on_trainer(self.trainer.close)
            self._trainer_thread.shutdown(wait=False)

    # -- weight sync on GPU ----------------------------------------------------------------------------
    async def sync_local(self, version: int, interrupt: bool, load: bool) -> None:
        """Every trainer rank gathers the full weights; with ``load``, this device's engine copies them
        in place (trainer rank 0's device: engine and trainer share the process and the GPU)."""
        state = await self._on_trainer(self.trainer.device_state)
        if load:
            await self.server.load_state(state, version, interrupt)

    def join_broadcast(self, rendezvous: str, rank: int, world_size: int) -> None:
        """Rank 0 sends (trainer rank 0's device); the others receive (engines on other devices)."""
        self._group = BroadcastGroup(rendezvous, rank, world_size, "cuda:0")

    async def broadcast_layouts(self, dtype: str, bucket_bytes: int) -> list[Layout]:
        import torch

        def layouts() -> list[Layout]:
            return BroadcastGroup.layouts(self.trainer.module.state_dict(), getattr(torch, dtype), bucket_bytes)

        return await self._on_trainer(layouts)

    async def broadcast(
        self, layouts: list[Layout], version: int, dtype: str, bucket_bytes: int, interrupt: bool
    ) -> None:
        """This device's part of one broadcast, in one order on every device: a trainer rank first
        gathers the full weights (a collective of all ranks), then rank 0 sends or an engine receives,
        never both communicators at once on one GPU. An engine whose weights sleep drops what it got
        (it is brought up to date when it wakes); one whose weights are awake loads them, its KV cache
        awake or not (an expand loads before it wakes the cache)."""
        import torch

        state = await self._on_trainer(self.trainer.device_state) if self.trainer is not None else None
        if self._group is None:
            return
        if self._group.rank == 0:
            await self._on_trainer(self._group.send, state, getattr(torch, dtype), bucket_bytes)
            return
        buckets = await asyncio.to_thread(self._group.receive, layouts)
        await self.server.load_state(merge(buckets), version, interrupt, unless_asleep=True)


class RayCluster:
    def __init__(
        self,
        runtime: Runtime,
        rollout: Sequence[Device],
        train: Sequence[Device],
        actors: dict,
        bucket_bytes: int,
        rendezvous: Rendezvous,
        counted: tuple[str, ...] = (),  # engine options of COUNTED that are on
        lendable: Sequence[Device] = (),
        ray_folder: str | None = None,  # the session folder of the Ray this cluster started (removed at close)
    ) -> None:
        self.runtime, self.devices = runtime, [*runtime.devices, *lendable]
        self._rendezvous = rendezvous  # held while the cluster lives: its groups meet (and NCCL connects) through it
        self.rollout_devices, self.train_devices = list(rollout), list(train)
        self.cuda = runtime.accelerator == "cuda"
        self.bucket_bytes = bucket_bytes
        self._actors = actors  # device id -> its DeviceActor
        self._engines = {d.id: actors[d.id] for d in [*rollout, *lendable]}  # the same actors, by role
        self._trainers = [actors[d.id] for d in train]  # in rank order
        self._shared = {d.id for d in rollout} & {d.id for d in train}
        self._awake = {d.id for d in rollout}  # engines holding their device
        self._active = {d.id for d in rollout}  # engines taking requests
        self._trainer_loaded = {d.id for d in train} - self._shared
        self._outstanding = dict.fromkeys(self._engines, 0)
        self._sticky: dict[str, str] = {}
        self._arrivals = {d: itertools.count() for d in self._engines}  # each engine's requests, numbered as sent
        self._routable = asyncio.Event()
        self._routable.set()
        self._suspended = False
        self._broadcast_ready = False
        self.version = 0
        self._published: tuple[int, list] | None = None
        self._ray_folder = ray_folder
        self.counted = counted  # the engines' techniques whose own counts the log gets at close
        self._loading = asyncio.Lock()  # a sync and an expand at once (overlap_sync) publish once, broadcast in turn

    @classmethod
    async def start(
        cls,
        runtime: Runtime,
        rollout: Sequence[Device],
        train: Sequence[Device],
        config: TrainingConfig,
        engine: str = "paged",
        threads: int = 1,
        engine_options: dict | None = None,
        trainer_options: dict | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        lendable: Sequence[Device] = (),
    ) -> RayCluster:
        cuda = runtime.accelerator == "cuda"
        if lendable and cuda:  # before anything is started that would need releasing
            raise ValueError("a serving pool's devices are lent to a real cluster on CPU targets only")
        ray_folder = join_or_start_ray(runtime) if not ray.is_initialized() else None
        shared = {d.id for d in rollout} & {d.id for d in train}
        placement = await placement_group_of(runtime)
        torch_device = "cuda:0" if cuda else "cpu"  # Ray shows each actor only its own GPU
        rendezvous = Rendezvous(rendezvous_host())
        ranks = {d.id: rank for rank, d in enumerate(train)}
        rolling = {d.id for d in [*rollout, *lendable]}
        Actor = ray.remote(DeviceActor)
        actors = {}
        for d in [*runtime.devices, *lendable]:  # one actor a device, holding the whole device, whatever its roles
            if d.id not in rolling and d.id not in ranks:
                continue
            engine_kwargs = (
                dict(
                    model_path=runtime.model_path,
                    dtype=runtime.dtype,
                    name=d.id,
                    threads=threads,
                    engine=engine,
                    device=torch_device,
                    **(engine_options or {}),
                )
                if d.id in rolling
                else None
            )
            trainer_kwargs = (
                dict(
                    model_path=runtime.model_path,
                    config=config,
                    dtype=runtime.dtype,
                    device=torch_device,
                    rank=ranks[d.id],
                    world_size=len(train),
                    rendezvous=rendezvous.address,
                    threads=threads,
                    **(trainer_options or {}),
                )
                if d.id in ranks
                else None
            )
            options = actor_options(runtime, d, placement)
            actors[d.id] = Actor.options(**options, max_concurrency=ACTOR_CALLS).remote(engine_kwargs, trainer_kwargs)
        await asyncio.gather(
            *(actors[d.id].sleep.remote() for d in lendable),  # asleep until borrowed
            *(actors[d.id].weight_version.remote() for d in rollout),
            *(actors[d.id].offload.remote() for d in train if d.id in shared),
        )
        counted = tuple(option for option in COUNTED if (engine_options or {}).get(option))
        return cls(runtime, rollout, train, actors, bucket_bytes, rendezvous, counted, lendable, ray_folder)

    # -- clock -------------------------------------------------------------------------------------
    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    # -- rollout -----------------------------------------------------------------------------------
    def _route(self, episode: str, device: str | None) -> str:
        if device in self._active:  # the controller routed it (the kv_routing technique)
            return device
        least = min(self._active, key=lambda d: (self._outstanding[d], d))
        sticky = self._sticky.get(episode)
        if sticky in self._active and self._outstanding[sticky] <= self._outstanding[least] + STICKY_SLACK:
            return sticky
        return least

    async def generate(self, request: GenerateRequest) -> Completion:
        while self._suspended or not self._active:  # no await between the look and clear(): no lost wake-up
            self._routable.clear()
            await self._routable.wait()
        device = self._route(request.episode_id, request.device)
        self._sticky[request.episode_id] = device
        self._outstanding[device] += 1
        try:
            # numbered here, per engine: Ray starts an async actor's calls in any order, and the engine
            # takes them in this one (``arrival_order.py``)
            arrival = next(self._arrivals[device])
            try:
                call = self._engines[device].generate.remote(
                    request.prompt, request.params, request.episode_id, arrival
                )
                try:
                    completion = await call
                except asyncio.CancelledError:  # its episode was dropped: the engine stops serving it
                    ray.cancel(call)
                    raise
            except BaseException:  # a call cancelled before it started, or never sent, never comes: the
                self._engines[device].forget.remote(arrival)  # engine's later requests are not to wait for it
                raise
        finally:
            self._outstanding[device] -= 1
        if completion.finish_reason == "abort":
            raise Aborted(f"{request.episode_id} turn {request.turn} aborted on {device}", completion)
        return completion

    async def _to_trainers(self, ids: set[str]) -> None:
        """Engines on ``ids`` to sleep, then the trainer ranks there back on the device."""
        asleep = [i for i in ids if i in self._awake]
        await asyncio.gather(*(self._engines[i].sleep.remote() for i in asleep))
        self._awake -= set(asleep)
        ranks = [r for r, d in enumerate(self.train_devices) if d.id in ids and d.id not in self._trainer_loaded]
        await asyncio.gather(*(self._trainers[r].reload.remote() for r in ranks))
        self._trainer_loaded |= {self.train_devices[r].id for r in ranks}

    async def _to_engines(self, ids: set[str]) -> None:
        """Trainer ranks on ``ids`` offload their optimizer state, engines there wake their weights and
        sync, the ranks offload their parameters, the engines wake their KV caches. On GPU the engine on
        trainer rank 0's device copies the weights from its parameters, so both hold the device for the
        sync; on CPU nothing moves and the sync goes through the object store: the ranks leave whole
        first, and no moment has both (another call's residency may look in meanwhile)."""
        waking = [i for i in ids if i in self._engines and i not in self._awake]
        if not waking:
            return
        ranks = [r for r, d in enumerate(self.train_devices) if d.id in ids and d.id in self._trainer_loaded]
        leaving = {self.train_devices[r].id for r in ranks}
        first = ("optimizer",) if self.cuda else ("optimizer", "params")
        await asyncio.gather(*(self._trainers[r].offload.remote(first) for r in ranks))
        if not self.cuda:
            self._trainer_loaded -= leaving
        # each engine's own word on its version: -1 when its weights were discarded, an older one when a
        # load came while it slept (a serving device given back beside a sync skips it)
        versions = await asyncio.gather(*(self._engines[i].wake.remote(["weights"]) for i in waking))
        self._awake |= set(waking)
        stale = [i for i, v in zip(waking, versions) if v != self.version]
        if stale:
            await self._load(stale, self.version)
        if self.cuda:
            await asyncio.gather(*(self._trainers[r].offload.remote(("params",)) for r in ranks))
            self._trainer_loaded -= leaving
        await asyncio.gather(*(self._engines[i].wake.remote(["kv_cache"]) for i in waking))

    async def shrink(self, devices: Sequence[Device]) -> None:
        ids = {d.id for d in devices} & set(self._engines)
        if not self._active - ids:
            raise ValueError(f"shrinking {sorted(ids)} would leave no active rollout engine (suspend to pause rollout)")
        self._active -= ids
        await self._to_trainers(ids)

    async def expand(self, devices: Sequence[Device]) -> None:
        ids = {d.id for d in devices} & set(self._engines)
        await self._to_engines(ids)
        if not self._suspended:
            self._active |= ids
            self._routable.set()

    # -- training and weights ----------------------------------------------------------------------
    async def train(self, batch: TrainBatch, devices: Sequence[Device]) -> int:
        await self._trainers_on(devices)
        versions = await asyncio.gather(*(t.train_step.remote(batch) for t in self._trainers))
        if len(set(versions)) != 1:
            raise RuntimeError(f"trainer ranks disagree on the version: {versions}")
        self.version = versions[0]
        return self.version

    async def train_part(self, batch: TrainBatch, devices: Sequence[Device]) -> None:
        """Stream training: every trainer rank computes the part's gradients and keeps them for the step."""
        await self._trainers_on(devices)
        await asyncio.gather(*(t.train_part.remote(batch) for t in self._trainers))

    async def _trainers_on(self, devices: Sequence[Device]) -> None:
        if {d.id for d in devices} != {d.id for d in self.train_devices}:
            raise ValueError(
                f"this cluster trains on {[d.id for d in self.train_devices]}, not {[d.id for d in devices]}"
            )
        awake = sorted(d.id for d in self.train_devices if d.id in self._awake)
        if awake:
            raise ValueError(
                f"the engines on {awake} are awake: shrink or suspend them before training there "
                "(an engine and a trainer never hold a device at once)"
            )
        await self._to_trainers({d.id for d in self.train_devices})

    async def sync_weights(self, version: int, devices: Sequence[Device], interrupt: bool = False) -> None:
        if version != self.version:
            raise ValueError(f"can only sync the latest version {self.version}, not {version}")
        awake = [d.id for d in devices if d.id in self._awake]  # sleeping engines sync when they wake
        if awake:
            await self._load(awake, version, interrupt)

    async def _load(self, device_ids: list[str], version: int, interrupt: bool = False) -> None:
        """Bring the engines on ``device_ids`` to ``version``; with ``interrupt`` their running
        requests come back aborted (with their partial responses) instead of finishing first."""
        if not self.cuda:
            async with self._loading:
                if self._published is None or self._published[0] != version:
                    state = (await asyncio.gather(*(t.state_dict.remote() for t in self._trainers)))[
                        0
                    ]  # every rank gathers
                    self._published = (version, publish(state, self.bucket_bytes))
                published = self._published[1]
            await asyncio.gather(
                *(self._engines[i].load_weights.remote(published, version, interrupt) for i in device_ids)
            )
        else:
            async with self._loading:  # one broadcast group: loads take turns
                local = [i for i in device_ids if i == self.train_devices[0].id]
                if local:
                    await self._load_local(version, interrupt)
                if [i for i in device_ids if i not in local]:
                    await self._load_broadcast(version, set(device_ids) if interrupt else set())

    async def _load_local(self, version: int, interrupt: bool) -> None:
        """The engine on trainer rank 0's device copies the gathered weights in place (one process)."""
        await asyncio.gather(*(t.sync_local.remote(version, interrupt, r == 0) for r, t in enumerate(self._trainers)))

    async def _load_broadcast(self, version: int, interrupt: set[str]) -> None:
        """One group of trainer rank 0 and every engine not on its GPU, formed on first use; an engine
        asleep still joins the broadcast (it receives, then loads when it wakes). Engines in
        ``interrupt`` answer their running requests at once."""
        receivers = sorted(i for i in self._engines if i != self.train_devices[0].id)
        if not self._broadcast_ready:
            await asyncio.gather(
                self._trainers[0].join_broadcast.remote(self._rendezvous.address, 0, len(receivers) + 1),
                *(
                    self._engines[i].join_broadcast.remote(self._rendezvous.address, r + 1, len(receivers) + 1)
                    for r, i in enumerate(receivers)
                ),
            )
            self._broadcast_ready = True
        layouts = await self._trainers[0].broadcast_layouts.remote(self.runtime.dtype, self.bucket_bytes)
        members = {d.id: self._actors[d.id] for d in self.train_devices} | {i: self._engines[i] for i in receivers}
        await asyncio.gather(  # one call a device: a trainer rank and an engine there act in turn
            *(
                actor.broadcast.remote(layouts, version, self.runtime.dtype, self.bucket_bytes, i in interrupt)
                for i, actor in members.items()
            )
        )

    async def export_weights(self, into: WeightExport) -> None:
        """Rank 0's full weights through the object store (every rank gathers), then into the region."""
        states = await asyncio.gather(*(t.state_dict.remote() for t in self._trainers))
        await asyncio.to_thread(_write_all, into, states[0])

    async def residency(self) -> dict[str, list[str]]:
        return {
            d.id: [*(["engine"] if d.id in self._awake else []), *(["trainer"] if d.id in self._trainer_loaded else [])]
            for d in self.devices
        }

    # -- suspend / resume / close ------------------------------------------------------------------
    async def suspend(self) -> None:
        """Pause all rollout: every engine sleeps (its requests come back aborted), every trainer rank
        is back on its device."""
        self._suspended = True
        self._routable.clear()
        await self._to_trainers(set(self._engines) | {d.id for d in self.train_devices})

    async def resume(self) -> None:
        """Wake the engines that were active (a shrunk engine, or a serving device's not lent, stays asleep)."""
        await self._to_engines(set(self._active))
        self._suspended = False
        self._routable.set()

    async def close(self) -> None:
        # the engines' own account, in the cluster's log: calls Ray delivered late, and the techniques' counts
        counts = await asyncio.gather(*(e.counts.remote() for e in self._engines.values()), return_exceptions=True)
        for device, count in zip(self._engines, counts):
            if not isinstance(count, dict):
                print(f"engine {device}: no count: {count!r}", file=sys.stderr)
                continue
            print(f"arrival order on {device}: {count['late']} requests came before an earlier one", file=sys.stderr)
            for option in self.counted:
                name, line = COUNTED[option]
                print(f"{name} on {device}: {line.format(**count)}", file=sys.stderr)
        # every trainer rank leaves its group before any process goes; one that fails to still lets the
        # others go, and everything below is released before its error is raised
        closed = await asyncio.gather(
            *(actor.close.remote() for actor in self._actors.values()), return_exceptions=True
        )
        for actor in self._actors.values():
            ray.kill(actor)
        ray.shutdown()
        self._rendezvous = None  # its store goes with the groups it served
        if self._ray_folder is not None:
            try:
                shutil.rmtree(self._ray_folder)
            except OSError as error:  # a folder of /tmp, not the run's: left, and said
                print(f"Ray's session folder {self._ray_folder} was not removed: {error}", file=sys.stderr)
        failed = [error for error in closed if isinstance(error, BaseException)]
        if failed:
            raise failed[0]


def _write_all(into: WeightExport, state: StateDict) -> None:
    written: set[int] = set()
    for name, tensor in state.items():
        if tensor.data_ptr() not in written:  # a tied embedding and head arrive as one tensor
            written.add(tensor.data_ptr())
            into.write(name, tensor)
