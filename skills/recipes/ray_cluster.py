"""The real ``targets.api.Cluster`` on Ray: an engine actor on every device that may roll out, a
data-parallel trainer rank on every training device, each pinned to its device by the target's
custom Ray resource (a GPU on GPU targets, a logical device on CPU targets).

The cluster starts Ray itself (in the candidate's cluster process), one custom resource per device,
and shuts it down on ``close``. Mechanism only; the controller decides when to shrink, train, sync
and expand. ``generate`` goes to
the active engine with the fewest requests outstanding; ``shrink`` stops routing to the devices,
aborts what they serve (the caller retries elsewhere) and offloads their engines; ``expand`` reloads
them and brings them to the latest weights before routing to them again.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
from typing import Sequence

import ray

from targets.api import Aborted, Completion, Device, GenerateRequest, Runtime, StateDict, TrainBatch, TrainingConfig

from .engine_server import EngineServer
from .grpo_trainer import GRPOTrainer
from .weight_sync import publish


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCluster:
    def __init__(self, runtime: Runtime, rollout: Sequence[Device], train: Sequence[Device], engines: dict, trainers: list) -> None:
        self.runtime, self.devices = runtime, list(runtime.devices)
        self.rollout_devices, self.train_devices = list(rollout), list(train)
        self._engines = engines  # device id -> actor
        self._trainers = trainers
        self._active = {d.id for d in rollout}
        self._outstanding = {d.id: 0 for d in rollout}
        self._engine_version = {d.id: 0 for d in rollout}
        self._routable = asyncio.Event()
        self._routable.set()
        self._suspended = False
        self.version = 0
        self._published: tuple[int, list] | None = None
        self._start = time.monotonic()

    @classmethod
    async def start(cls, runtime: Runtime, rollout: Sequence[Device], train: Sequence[Device], config: TrainingConfig,
                    threads: int = 1, engine: str = "torch", batch_window_s: float = 0.002) -> "RayCluster":
        if not ray.is_initialized():
            ray.init(num_cpus=os.cpu_count(), resources={f"{runtime.device_resource}{d.index}": 1.0 for d in runtime.devices},
                     include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="vtray-", dir="/tmp"), configure_logging=False)

        def on(device: Device) -> dict:
            return {"num_cpus": 0, "resources": {f"{runtime.device_resource}{device.index}": 0.5}}

        Engine = ray.remote(EngineServer)
        Trainer = ray.remote(GRPOTrainer)
        engines = {d.id: Engine.options(**on(d)).remote(runtime.model_path, runtime.dtype, d.id, threads, batch_window_s, engine=engine)
                   for d in rollout}
        init = f"tcp://127.0.0.1:{_free_port()}"
        trainers = [
            Trainer.options(**on(d)).remote(
                runtime.model_path, config, runtime.dtype, rank=rank, world_size=len(train), init_method=init, threads=threads
            )
            for rank, d in enumerate(train)
        ]
        await asyncio.gather(*(e.weight_version.remote() for e in engines.values()), *(t.state_dict.remote() for t in trainers[:1]))
        return cls(runtime, rollout, train, engines, trainers)

    # -- clock -------------------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self._start

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    # -- rollout -----------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> Completion:
        while True:  # no await between the look and clear(): a wake-up cannot be missed
            candidates = [] if self._suspended else list(self._active)
            if candidates:
                break
            self._routable.clear()
            await self._routable.wait()
        device = min(candidates, key=lambda d: self._outstanding[d])
        self._outstanding[device] += 1
        try:
            completion = await self._engines[device].generate.remote(request.prompt, request.params)
        finally:
            self._outstanding[device] -= 1
        if completion.finish_reason == "abort":
            raise Aborted(f"{request.episode_id} turn {request.turn} aborted on {device}")
        return completion

    async def shrink(self, devices: Sequence[Device]) -> None:
        ids = {d.id for d in devices}
        if not self._active - ids:
            raise ValueError(f"shrinking {sorted(ids)} would leave no active rollout engine")
        self._active -= ids
        await asyncio.gather(*(self._engines[i].abort.remote() for i in ids))
        await asyncio.gather(*(self._engines[i].offload.remote() for i in ids))

    async def expand(self, devices: Sequence[Device]) -> None:
        ids = [d.id for d in devices if d.id not in self._active]
        await asyncio.gather(*(self._engines[i].reload.remote() for i in ids))
        stale = [i for i in ids if self._engine_version[i] != self.version]
        if stale:
            await self._load(stale, self.version)
        self._active |= set(ids)
        self._routable.set()

    # -- training and weights ----------------------------------------------------------------------
    async def train(self, batch: TrainBatch, devices: Sequence[Device]) -> int:
        if {d.id for d in devices} != {d.id for d in self.train_devices}:
            raise ValueError(f"this cluster trains on {[d.id for d in self.train_devices]}, not {[d.id for d in devices]}")
        versions = await asyncio.gather(*(t.train_step.remote(batch) for t in self._trainers))
        if len(set(versions)) != 1:
            raise RuntimeError(f"trainer ranks disagree on the version: {versions}")
        self.version = versions[0]
        return self.version

    async def sync_weights(self, version: int, devices: Sequence[Device]) -> None:
        if version != self.version:
            raise ValueError(f"can only sync the latest version {self.version}, not {version}")
        await self._load([d.id for d in devices if d.id in self._active], version)

    async def _load(self, device_ids: list[str], version: int) -> None:
        if self._published is None or self._published[0] != version:
            state = await self._trainers[0].state_dict.remote()
            self._published = (version, publish(state))
        buckets = self._published[1]
        await asyncio.gather(*(self._engines[i].load_weights.remote(buckets, version) for i in device_ids))
        for i in device_ids:
            self._engine_version[i] = version

    async def export_weights(self) -> StateDict:
        return await self._trainers[0].state_dict.remote()

    # -- suspend / resume / close ------------------------------------------------------------------
    async def suspend(self) -> None:
        self._suspended = True
        self._routable.clear()
        await asyncio.gather(*(self._engines[i].abort.remote() for i in self._active))

    async def resume(self) -> None:
        self._suspended = False
        self._routable.set()

    async def close(self) -> None:
        for trainer in self._trainers:
            await trainer.close.remote()
        for actor in [*self._engines.values(), *self._trainers]:
            ray.kill(actor)
        ray.shutdown()
