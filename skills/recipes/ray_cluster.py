"""The real ``targets.api.Cluster`` on Ray: an engine actor on every device that may roll out, an FSDP2
trainer rank on every training device.

Placement: on GPU targets a placement group with one GPU bundle per device, an engine and a trainer
rank that share a device taking half of its GPU each; on CPU targets one custom Ray resource per
logical device. Ray starts here (the candidate's cluster process) and stops on ``close``.

Memory: a device hosting both an engine and a trainer rank gives it to one at a time. ``shrink`` (or
``suspend``) puts the engines to sleep and brings the trainers back; ``expand`` (or ``resume``)
offloads the trainers' optimizer state, wakes the engines' weights, syncs them, offloads the
trainers' parameters and wakes the KV caches. ``train`` refuses devices whose engine is awake.

Weight sync, by placement: the object store on CPU; on GPU, CUDA IPC from trainer rank 0 to an engine
on its own GPU and a broadcast group (NCCL) to engines on other GPUs.

Mechanism only; the controller decides when to shrink, train, sync and expand. ``generate`` goes to the
active engine that served the episode's previous turn (its prefix is cached there) unless that engine
has clearly more in flight than the least loaded one, else to the least loaded.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import Sequence

import ray

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
from .weight_sync import DEFAULT_BUCKET_BYTES, BroadcastGroup, IPCExport, Layout, merge, open_ipc, publish

STICKY_SLACK = 4  # requests an engine may have beyond the least loaded one and still keep its episodes


async def placement_group_of(runtime: Runtime):
    """On GPU, one bundle (a GPU and a CPU) per device, packed onto as few nodes as fit; bundle i is
    device i. None on CPU (devices are custom resources there)."""
    if runtime.accelerator != "cuda":
        return None
    from ray.util.placement_group import placement_group

    group = placement_group([{"GPU": 1, "CPU": 1} for _ in runtime.devices], strategy="PACK")
    await group.ready()
    return group


def actor_options(runtime: Runtime, device: Device, shared: bool, placement) -> dict:
    """Where the actor of an engine or a trainer rank on ``device`` runs: the device's bundle on GPU,
    its custom resource on CPU; half of it when an engine and a trainer rank share the device."""
    share = 0.5 if shared else 1.0
    if runtime.accelerator == "cuda":
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": 0,
            "num_gpus": share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement, placement_group_bundle_index=device.index
            ),
        }
    return {"num_cpus": 0, "resources": {f"{runtime.device_resource}{device.index}": share}}


class EngineActor(EngineServer):
    """An engine server as a Ray actor, with the receiving ends of the GPU transports."""

    def join_broadcast(self, rendezvous: str, rank: int, world_size: int) -> None:
        self._group = BroadcastGroup(rendezvous, rank, world_size, self.engine.device)

    async def receive_broadcast(self, layouts: list[Layout], version: int, interrupt: bool = False) -> bool:
        """Every member receives every broadcast; an engine whose weights sleep drops what it got
        (it is brought up to date when it wakes). Returns whether the weights were loaded."""
        buckets = await asyncio.to_thread(self._group.receive, layouts)
        if self.engine.offloaded:
            return False
        await self.load_state(merge(buckets), version, interrupt)
        return True

    async def load_ipc(self, handles: list, version: int, interrupt: bool = False) -> None:
        await self.load_state(merge(open_ipc(handles)), version, interrupt)


class TrainerActor(FSDPTrainer):
    """A trainer rank as a Ray actor, with the sending ends of the GPU transports (rank 0)."""

    def join_broadcast(self, rendezvous: str, world_size: int) -> None:
        self._group = BroadcastGroup(rendezvous, 0, world_size, self.device)

    def broadcast_weights(self, dtype: str, bucket_bytes: int) -> None:
        state = self.device_state()
        if self.rank == 0:
            import torch

            self._group.send(state, getattr(torch, dtype), bucket_bytes)

    def broadcast_layouts(self, dtype: str, bucket_bytes: int) -> list[Layout]:
        import torch

        return BroadcastGroup.layouts(self.module.state_dict(), getattr(torch, dtype), bucket_bytes)

    def export_ipc(self, dtype: str, bucket_bytes: int) -> list | None:
        import torch

        state = self.device_state()
        if self.rank != 0:
            return None
        self._ipc = IPCExport(state, self.device, getattr(torch, dtype), bucket_bytes)
        return self._ipc.handles

    def release_ipc(self) -> None:
        self._ipc.release()


class RayCluster:
    def __init__(
        self,
        runtime: Runtime,
        rollout: Sequence[Device],
        train: Sequence[Device],
        engines: dict,
        trainers: list,
        bucket_bytes: int,
        rendezvous: Rendezvous,
        speculating: bool = False,
    ) -> None:
        self.runtime, self.devices = runtime, list(runtime.devices)
        self._rendezvous = rendezvous  # held while the cluster lives: its groups meet (and NCCL connects) through it
        self.rollout_devices, self.train_devices = list(rollout), list(train)
        self.cuda = runtime.accelerator == "cuda"
        self.bucket_bytes = bucket_bytes
        self._engines = engines  # device id -> actor
        self._trainers = trainers
        self._shared = {d.id for d in rollout} & {d.id for d in train}
        self._awake = {d.id for d in rollout}  # engines holding their device
        self._active = {d.id for d in rollout}  # engines taking requests
        self._trainer_loaded = {d.id for d in train} - self._shared
        self._outstanding = {d.id: 0 for d in rollout}
        self._engine_version = {d.id: 0 for d in rollout}
        self._sticky: dict[str, str] = {}
        self._routable = asyncio.Event()
        self._routable.set()
        self._suspended = False
        self._broadcast_ready = False
        self.version = 0
        self._published: tuple[int, list] | None = None
        self.speculating = speculating  # the engines draft tokens (speculative_decoding): their count is logged
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
    ) -> RayCluster:
        cuda = runtime.accelerator == "cuda"
        if not ray.is_initialized():
            resources = {} if cuda else {f"{runtime.device_resource}{d.index}": 1.0 for d in runtime.devices}
            ray.init(
                num_cpus=os.cpu_count(),
                resources=resources,
                include_dashboard=False,
                configure_logging=False,
                _temp_dir=tempfile.mkdtemp(prefix="vtray-", dir="/tmp"),
            )
        shared = {d.id for d in rollout} & {d.id for d in train}
        placement = await placement_group_of(runtime)

        def on(device: Device) -> dict:
            return actor_options(runtime, device, device.id in shared, placement)

        torch_device = "cuda:0" if cuda else "cpu"  # Ray shows each actor only its own GPU
        Engine, Trainer = ray.remote(EngineActor), ray.remote(TrainerActor)
        engines = {
            d.id: Engine.options(**on(d)).remote(
                runtime.model_path, runtime.dtype, d.id, threads, engine, torch_device, **(engine_options or {})
            )
            for d in rollout
        }
        rendezvous = Rendezvous()
        trainers = [
            Trainer.options(**on(d)).remote(
                runtime.model_path,
                config,
                runtime.dtype,
                torch_device,
                rank=rank,
                world_size=len(train),
                rendezvous=rendezvous.address,
                threads=threads,
                **(trainer_options or {}),
            )
            for rank, d in enumerate(train)
        ]
        await asyncio.gather(
            *(e.weight_version.remote() for e in engines.values()),
            *(t.offload.remote() for t, d in zip(trainers, train) if d.id in shared),
        )
        speculating = bool((engine_options or {}).get("speculative_tokens"))
        return cls(runtime, rollout, train, engines, trainers, bucket_bytes, rendezvous, speculating)

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
            completion = await self._engines[device].generate.remote(request.prompt, request.params, request.episode_id)
        finally:
            self._outstanding[device] -= 1
        if completion.finish_reason == "abort":
            raise Aborted(f"{request.episode_id} turn {request.turn} aborted on {device}", completion)
        return completion

    async def _to_trainers(self, ids: set[str]) -> None:
        """Engines on ``ids`` to sleep, then the trainer ranks there back on the device."""
        asleep = [i for i in ids if i in self._awake]
        versions = await asyncio.gather(*(self._engines[i].sleep.remote() for i in asleep))
        self._engine_version.update(zip(asleep, versions))  # -1: the engine discarded its weights
        self._awake -= set(asleep)
        ranks = [r for r, d in enumerate(self.train_devices) if d.id in ids and d.id not in self._trainer_loaded]
        await asyncio.gather(*(self._trainers[r].reload.remote() for r in ranks))
        self._trainer_loaded |= {self.train_devices[r].id for r in ranks}

    async def _to_engines(self, ids: set[str]) -> None:
        """Trainer ranks on ``ids`` offload their optimizer state, engines there wake their weights and
        sync, the ranks offload their parameters, the engines wake their KV caches."""
        waking = [i for i in ids if i in self._engines and i not in self._awake]
        if not waking:
            return
        ranks = [r for r, d in enumerate(self.train_devices) if d.id in ids and d.id in self._trainer_loaded]
        await asyncio.gather(*(self._trainers[r].offload.remote(("optimizer",)) for r in ranks))
        await asyncio.gather(*(self._engines[i].wake.remote(["weights"]) for i in waking))
        self._awake |= set(waking)
        stale = [i for i in waking if self._engine_version[i] != self.version]
        if stale:
            await self._load(stale, self.version)
        await asyncio.gather(*(self._trainers[r].offload.remote(("params",)) for r in ranks))
        self._trainer_loaded -= {self.train_devices[r].id for r in ranks}
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
        versions = await asyncio.gather(*(t.train_step.remote(batch) for t in self._trainers))
        if len(set(versions)) != 1:
            raise RuntimeError(f"trainer ranks disagree on the version: {versions}")
        self.version = versions[0]
        return self.version

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
            for i in device_ids:
                self._engine_version[i] = version
        else:
            async with self._loading:  # one broadcast group and one IPC buffer: loads take turns
                ipc = [i for i in device_ids if i == self.train_devices[0].id]
                if ipc:
                    await self._load_ipc(ipc[0], version, interrupt)
                if [i for i in device_ids if i not in ipc]:
                    await self._load_broadcast(version, set(device_ids) if interrupt else set())

    async def _load_ipc(self, device_id: str, version: int, interrupt: bool) -> None:
        handles = (
            await asyncio.gather(*(t.export_ipc.remote(self.runtime.dtype, self.bucket_bytes) for t in self._trainers))
        )[0]
        await self._engines[device_id].load_ipc.remote(handles, version, interrupt)
        await self._trainers[0].release_ipc.remote()
        self._engine_version[device_id] = version

    async def _load_broadcast(self, version: int, interrupt: set[str]) -> None:
        """One group of trainer rank 0 and every engine not on its GPU, formed on first use; an engine
        asleep still joins the broadcast (it receives, then loads when it wakes). Engines in
        ``interrupt`` answer their running requests at once."""
        receivers = sorted(i for i in self._engines if i != self.train_devices[0].id)
        if not self._broadcast_ready:
            await asyncio.gather(
                self._trainers[0].join_broadcast.remote(self._rendezvous.address, len(receivers) + 1),
                *(
                    self._engines[i].join_broadcast.remote(self._rendezvous.address, r + 1, len(receivers) + 1)
                    for r, i in enumerate(receivers)
                ),
            )
            self._broadcast_ready = True
        layouts = await self._trainers[0].broadcast_layouts.remote(self.runtime.dtype, self.bucket_bytes)
        results = await asyncio.gather(
            *(t.broadcast_weights.remote(self.runtime.dtype, self.bucket_bytes) for t in self._trainers),
            *(self._engines[i].receive_broadcast.remote(layouts, version, i in interrupt) for i in receivers),
        )
        for i, loaded in zip(receivers, results[len(self._trainers) :]):
            if loaded:
                self._engine_version[i] = version

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
        await self._to_engines(set(self._engines))
        self._suspended = False
        self._routable.set()

    async def close(self) -> None:
        if self.speculating:  # the speculative_decoding skill's own account, in the cluster's log
            counts = await asyncio.gather(
                *(e.speculation.remote() for e in self._engines.values()), return_exceptions=True
            )
            for device, count in zip(self._engines, counts):
                said = (
                    f"{count[1]} of {count[0]} drafted tokens kept"
                    if isinstance(count, tuple)
                    else f"no count: {count!r}"
                )
                print(f"speculative decoding on {device}: {said}", file=sys.stderr)
        for trainer in self._trainers:
            await trainer.close.remote()
        for actor in [*self._engines.values(), *self._trainers]:
            ray.kill(actor)
        ray.shutdown()
        self._rendezvous = None  # its store goes with the groups it served


def _write_all(into: WeightExport, state: StateDict) -> None:
    written: set[int] = set()
    for name, tensor in state.items():
        if tensor.data_ptr() not in written:  # a tied embedding and head arrive as one tensor
            written.add(tensor.data_ptr())
            into.write(name, tensor)
