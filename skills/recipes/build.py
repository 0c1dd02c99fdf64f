"""The stack's entry point: ``build(runtime)`` wires the recipes named in ``params.json``.

Building is cheap: the engine, trainer and Ray cluster modules (torch, transformers, Ray) are
imported when a component is made, so a run on the simulator never loads them."""

from __future__ import annotations

import json
from pathlib import Path

from targets.api import Runtime, Stack

from .colocate import Colocate
from .static_split import StaticSplit
from .time_multiplex import TimeMultiplex
from .weight_sync import DEFAULT_BUCKET_BYTES, merge, to_buckets

CONTROLLERS = {"colocate": Colocate, "static_split": StaticSplit, "time_multiplex": TimeMultiplex}


def build(runtime: Runtime) -> Stack:
    params = json.loads(Path(__file__).with_name("params.json").read_text())
    # VAL: VAL_SUBSET (value=[params["controller"]], of=CONTROLLERS)
    controller = CONTROLLERS[params["controller"]](runtime, params)
    rollout, train = controller.placement(list(runtime.devices))
    config = runtime.workload.training
    threads = params.get("threads_per_actor", 1)
    bucket_bytes = params.get("bucket_bytes", DEFAULT_BUCKET_BYTES)
    engine = params.get("engine", "torch")
    batch_window_s = params.get("batch_window_s", 0.002)

    async def make_cluster():
        from .ray_cluster import RayCluster

        return await RayCluster.start(runtime, rollout, train, config, threads=threads, engine=engine, batch_window_s=batch_window_s)

    def make_engine():
        from .engine_server import make_engine as make_engine_of_kind

        return make_engine_of_kind(engine, runtime.model_path, runtime.dtype, "engine")

    def make_trainer(state, training_config):
        from .grpo_trainer import GRPOTrainer

        return GRPOTrainer(runtime.model_path, training_config, runtime.dtype, state=state, micro_batch=params.get("micro_batch", 16))

    def sync_engine(engine, state, version: int) -> None:
        engine.load_weights(merge(to_buckets(state, bucket_bytes)), version)

    return Stack(controller, make_cluster, make_engine, make_trainer, sync_engine)
