"""The ``targets.api.Cluster`` for a stack on one device: the engine and the trainer live in this one
process and time-share the device. While rolling out, the engine holds the device and the trainer is
offloaded to host memory; ``suspend`` puts the engine to sleep (its weights discarded: it wakes to
the trainer's, copied in place) and brings the trainer back (a shrink of the only device is refused:
it would leave no rollout engine); ``resume`` (or an expand) offloads
the trainer, wakes the engine's weights, copies the new weights in place (engine and trainer share a
process: no serialization, device to device on GPU), then wakes its KV cache. Engine and trainer
never hold memory on the device at the same time, and ``residency`` says so to the harness.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence

from targets.api import (
    Aborted,
    Completion,
    Device,
    GenerateRequest,
    Runtime,
    TrainBatch,
    TrainingConfig,
    WeightExport,
)

from .engine_server import EngineServer
from .fsdp_trainer import FSDPTrainer


class SwitchTimes:
    """Each stage of a switch between engine and trainer, timed and said in one line of the cluster's
    log: where a resume's seconds go (the H200 run's took 3.6-9.6 s and said nothing)."""

    def __init__(self, what: str) -> None:
        self.what, self.stages, self.last = what, [], time.perf_counter()

    def done(self, stage: str) -> None:
        now = time.perf_counter()
        self.stages.append(f"{stage} {now - self.last:.2f} s")
        self.last = now

    def say(self) -> None:
        print(f"{self.what}: {', '.join(self.stages)}", file=sys.stderr, flush=True)


class LocalCluster:
    def __init__(self, runtime: Runtime, server: EngineServer, trainer: FSDPTrainer, device: Device) -> None:
        self.devices, self.device = list(runtime.devices), device
        self.server, self.trainer = server, trainer
        self.version = 0
        self._engine_version = 0
        self._engine_awake = True
        self._routable = asyncio.Event()
        self._routable.set()

    @classmethod
    async def start(
        cls,
        runtime: Runtime,
        config: TrainingConfig,
        engine: str = "paged",
        threads: int = 0,
        engine_options: dict | None = None,
        trainer_options: dict | None = None,
    ) -> LocalCluster:
        if len(runtime.devices) != 1:
            raise ValueError(f"a local cluster runs on one device, not {len(runtime.devices)}: use the Ray cluster")
        torch_device = "cuda:0" if runtime.accelerator == "cuda" else "cpu"
        device = runtime.devices[0]
        server = EngineServer(
            runtime.model_path,
            runtime.dtype,
            device.id,
            threads=threads,
            engine=engine,
            device=torch_device,
            **(engine_options or {}),
        )
        trainer = await asyncio.to_thread(
            FSDPTrainer, runtime.model_path, config, runtime.dtype, torch_device, **(trainer_options or {})
        )
        await asyncio.to_thread(trainer.offload)
        return cls(runtime, server, trainer, device)

    # -- clock (the harness keeps the one that measures) ----------------------------------------------------
    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    # -- rollout -----------------------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> Completion:
        while not self._engine_awake:
            self._routable.clear()
            await self._routable.wait()
        completion = await self.server.generate(request.prompt, request.params, request.episode_id)
        if completion.finish_reason == "abort":
            raise Aborted(f"{request.episode_id} turn {request.turn} aborted on {self.device.id}", completion)
        return completion

    async def _to_trainer(self) -> None:
        if self._engine_awake:
            self._engine_awake = False
            times = SwitchTimes(f"to the trainer on {self.device.id}")
            # discarded, not copied out: the trainer's next version is loaded when the engine wakes
            self._engine_version = await self.server.sleep(discard_weights=True)  # -1 then
            times.done("engine asleep")
            await asyncio.to_thread(self.trainer.reload)
            times.done("trainer reloaded")
            times.say()

    async def _to_engine(self) -> None:
        """verl's order: optimizer state out, engine weights in, weights copied device to device,
        trainer parameters out, then the KV cache."""
        if not self._engine_awake:
            times = SwitchTimes(f"to the engine on {self.device.id}")
            await asyncio.to_thread(self.trainer.offload, ("optimizer",))
            times.done("optimizer out")
            await self.server.wake(["weights"])
            times.done("engine weights in")
            if self._engine_version != self.version:
                await self._load(self.version)
                times.done(f"version {self.version} loaded")
            await asyncio.to_thread(self.trainer.offload, ("params",))
            times.done("trainer parameters out")
            await self.server.wake(["kv_cache"])
            times.done("KV cache (and decode graphs)")
            self._engine_awake = True
            self._routable.set()
            times.say()

    async def shrink(self, devices: Sequence[Device]) -> None:
        raise ValueError("shrinking the only device would leave no rollout engine: suspend, train, then resume")

    async def expand(self, devices: Sequence[Device]) -> None:
        await self._to_engine()

    async def suspend(self) -> None:
        await self._to_trainer()

    async def resume(self) -> None:
        await self._to_engine()

    # -- training and weights ---------------------------------------------------------------------------------
    async def train(self, batch: TrainBatch, devices: Sequence[Device]) -> int:
        self._trainer_holds_device()
        self.version = await asyncio.to_thread(self.trainer.train_step, batch)
        return self.version

    async def train_part(self, batch: TrainBatch, devices: Sequence[Device]) -> None:
        self._trainer_holds_device()
        await asyncio.to_thread(self.trainer.train_part, batch)

    def _trainer_holds_device(self) -> None:
        if self._engine_awake:
            raise ValueError(
                f"the engine on {self.device.id} is awake: suspend it before training there "
                "(engine and trainer never hold the device at once)"
            )

    async def _load(self, version: int, interrupt: bool = False) -> None:
        state = await asyncio.to_thread(self.trainer.device_state)
        await self.server.load_state(state, version, interrupt)
        self._engine_version = version

    async def sync_weights(self, version: int, devices: Sequence[Device], interrupt: bool = False) -> None:
        if version != self.version:
            raise ValueError(f"can only sync the latest version {self.version}, not {version}")
        if self._engine_awake:  # asleep, it is brought to the latest version when it wakes
            await self._load(version, interrupt)

    async def export_weights(self, into: WeightExport) -> None:
        await asyncio.to_thread(self.trainer.export_to, into)

    async def residency(self) -> dict[str, list[str]]:
        return {self.device.id: ["engine"] if self._engine_awake else ["trainer"]}

    async def close(self) -> None:
        try:
            await self.server.close()
        finally:  # the trainer's rank leaves its group whatever the engine's close raised
            self.trainer.close()
