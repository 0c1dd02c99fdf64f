"""The stack's entry point: ``build(runtime)`` wires the recipes named in ``params.json``.

Building is cheap: the engine, trainer and cluster modules (torch, transformers, Ray) are imported
when a component is made, so a run on the simulator never loads them. The cluster is local (engine
and trainer in one process, time-sharing the device) on a one-device target, Ray otherwise."""

from __future__ import annotations

import json
from pathlib import Path

from targets.api import Declared, EngineSettings, Runtime, Stack

from .colocate import Colocate
from .reward_placement import place_reward
from .static_split import StaticSplit
from .time_multiplex import TimeMultiplex

CONTROLLERS = {"colocate": Colocate, "static_split": StaticSplit, "time_multiplex": TimeMultiplex}
ENGINE_OPTIONS = ("block_size", "kv_tokens", "kv_memory_fraction", "max_batch", "cuda_graphs", "attention")
ENGINE_OPTIONS += ("speculative_tokens", "speculative_ngram", "speculative_batch")  # the speculative_decoding skill
ENGINE_OPTIONS += ("prefill_chunk",)  # the chunked_prefill skill
ENGINE_OPTIONS += ("fused_kernels",)  # null: with a GPU attention kernel; false: torch ops (gpu_run.py's fallback)
TRAINER_OPTIONS = ("micro_batch_tokens", "logprob_chunk", "checkpointing")
STRUCTURE = ("controller", "engine", "cluster", "threads_per_actor", "rollout_devices", "train_devices", "bucket_bytes")
TECHNIQUE_PARAMS = (  # what the controllers, the router, the harvester and the reward placement read
    *("abort_stale", "affinity_ratio", "async_ratio", "checkpoint_level", "engine_scale", "env_prestart"),
    *("harvest_margin", "host_kv", "prestart_at"),
    *("kv_routing", "overlap_sync", "partial_rollout", "redundant_envs", "reward_devices", "reward_placement"),
    *("route_admit", "route_slack", "serving_harvest", "shrink_at", "stream_train", "tail_round"),
)
KNOWN_PARAMS = STRUCTURE + ENGINE_OPTIONS + TRAINER_OPTIONS + TECHNIQUE_PARAMS
OPTION_VALUES: dict[str, tuple] = {  # options no skill declares a range for (the search never moves them)
    "engine": ("paged", "vllm"),
    "cluster": ("local", "ray"),
    "attention": ("auto", "flashinfer", "triton", "sdpa"),
    "fused_kernels": (None, True, False),  # None: with a GPU attention kernel
    "cuda_graphs": (True, False),
    "checkpointing": (None, True, False),  # None: on GPU
}
OPTION_COUNTS = ("kv_tokens", "max_batch", "logprob_chunk", "threads_per_actor")  # whole numbers from 1


def option_problem(name: str, value) -> str | None:
    """Why ``value`` cannot be the option ``name`` (one of ``OPTION_VALUES``, ``OPTION_COUNTS`` or
    ``kv_memory_fraction``), or None. Types are strict: the text "False" is not false (it is truthy,
    and would turn on what it names), nor is 1 true."""
    if name in OPTION_VALUES:
        allowed = OPTION_VALUES[name]
        if not any(type(value) is type(a) and value == a for a in allowed):
            return f"{name} must be one of {', '.join(json.dumps(a) for a in allowed)}, not {json.dumps(value)}"
    elif name in OPTION_COUNTS:
        if not (type(value) is int and value >= 1) and not (name == "kv_tokens" and value is None):
            none = " or null (sized from memory)" if name == "kv_tokens" else ""
            return f"{name} must be a whole number from 1{none}, not {json.dumps(value)}"
    elif name == "kv_memory_fraction" and not (type(value) in (int, float) and 0 < value <= 1):
        return f"kv_memory_fraction must be a number in (0, 1], not {json.dumps(value)}"
    return None


# The switch of each technique only some controllers read, its value when off, and those controllers (its
# SKILL.md's ``controllers``; tests/test_recipes.py holds the two to each other): on under another, it
# would do nothing, silently.
CONTROLLER_TECHNIQUES: dict[str, tuple[object, tuple[str, ...]]] = {
    "abort_stale": (0, ("static_split", "time_multiplex")),
    "env_prestart": (0, ("colocate",)),
    "overlap_sync": (0, ("time_multiplex",)),
    "partial_rollout": (0, ("static_split", "time_multiplex")),
    "shrink_at": (1.0, ("time_multiplex",)),
    "serving_harvest": (0, ("static_split", "time_multiplex")),
    "stream_train": (0, ("time_multiplex",)),
    "tail_round": (0, ("static_split", "time_multiplex")),
}


def _validate_params(params: dict) -> None:
    """Every name in params.json is one a recipe reads: a misspelt one would otherwise be ignored, its
    technique silently off. A stack that adds a parameter of its own adds its name here. The options no
    skill declares a range for are checked here too (the skills' ranges are the annotations below), and a
    technique switched on under a controller that never reads it is refused."""
    unknown = sorted(set(params) - set(KNOWN_PARAMS))
    if unknown:
        raise ValueError(
            f"params.json names {unknown}, which no recipe of this stack reads; known: {sorted(KNOWN_PARAMS)}"
        )
    controller = params.get("controller")
    for name, (off, controllers) in CONTROLLER_TECHNIQUES.items():
        if params.get(name, off) != off and controller not in controllers:
            raise ValueError(
                f"params {name} {params[name]!r}: only {' and '.join(controllers)} read it; under {controller} "
                f"it would do nothing (set it to {off!r}, or switch the controller)"
            )
    problems = [problem for name, value in params.items() if (problem := option_problem(name, value))]
    if problems:
        raise ValueError(f"params.json: {'; '.join(problems)}")


VLLM_NAMES = {"kv_memory_fraction": "gpu_memory_utilization", "max_batch": "max_num_seqs"}


def vllm_options(params: dict, max_sequence: int, cuda: bool = True) -> dict:
    """The engine options in vLLM's names (the longest sequence the workload makes, the cache's share of
    memory, the batch bound, graphs or eager); the paged engine's own options that vLLM has no
    equivalent of are refused rather than dropped. ``block_size`` (every starter's) stays the paged
    engine's: vLLM picks its block size per attention backend (its CPU backend takes multiples of 32)."""
    for own in ("speculative_tokens", "host_kv", "prefill_chunk"):
        if params.get(own, 0):
            raise ValueError(f"{own}: the paged engine's (its skill's recipe), not vLLM's")
    own = [k for k in ("kv_tokens", "attention", "fused_kernels") if k in params and params[k] not in (None, "auto")]
    if own:
        raise ValueError(f"params {own}: the paged engine's options; vLLM sizes its cache by kv_memory_fraction")
    if not cuda and "kv_memory_fraction" in params:
        raise ValueError("params kv_memory_fraction: vLLM on CPU sizes its cache by VLLM_CPU_KVCACHE_SPACE (GiB)")
    options = {"max_model_len": max_sequence, **{VLLM_NAMES[k]: params[k] for k in VLLM_NAMES if k in params}}
    if "cuda_graphs" in params:
        options["enforce_eager"] = not params["cuda_graphs"]
    return options


def build(runtime: Runtime) -> Stack:
    params = json.loads(Path(__file__).with_name("params.json").read_text())
    _validate_params(params)
    runtime, reward, reward_devices = place_reward(runtime, params)  # a dedicated judge's devices set aside
    # VAL: VAL_SUBSET (value=[params["controller"]], of=CONTROLLERS)
    controller = CONTROLLERS[params["controller"]](runtime, params)
    rollout, train = controller.placement(list(runtime.devices))
    config = runtime.workload.training
    engine = params.get("engine", "paged")
    # VAL: VAL_SUBSET (value=[engine], of=["paged", "vllm"])
    harvest = bool(params.get("serving_harvest", 0))  # a serving pool's engines: the Ray cluster's to lend
    cluster = params.get("cluster", "local" if len(runtime.devices) == 1 and not harvest else "ray")
    # VAL: VAL_SUBSET (value=[cluster], of=["local", "ray"])
    if harvest and cluster == "local":
        raise ValueError("params serving_harvest: a serving pool's devices are lent to a Ray cluster; set cluster ray")
    threads = params.get("threads_per_actor", 1)
    bucket_bytes = params.get("bucket_bytes")  # None: weight_sync's default (imported with torch, when used)
    # VAL: VAL_INT_RANGE (value=params.get("bucket_bytes", 1 << 26), min=1 << 20, max=1 << 30)
    engine_options = {k: params[k] for k in ENGINE_OPTIONS if k in params}
    # VAL: VAL_INT_RANGE (value=params.get("host_kv", 0), min=0, max=1024)
    host_kv_tokens = params.get("host_kv", 0) * runtime.workload.max_sequence  # the kv_host_tier skill, an engine
    if host_kv_tokens:
        engine_options["host_kv_tokens"] = host_kv_tokens
    if engine == "vllm":
        engine_options = vllm_options(params, runtime.workload.max_sequence, runtime.accelerator == "cuda")
    trainer_options = {k: params[k] for k in TRAINER_OPTIONS if k in params}
    device = "cuda:0" if runtime.accelerator == "cuda" else "cpu"
    if runtime.device_memory_bytes:  # before anything starts: a trainer that cannot fit fails with the arithmetic
        from .fsdp_trainer import check_fits

        check_fits(runtime.model_path, len(train), runtime.device_memory_bytes)

    engine_scale = params.get("engine_scale", 1)
    # VAL: VAL_SUBSET (value=[engine_scale], of=[1, 2, 4])

    async def make_cluster():
        if engine_scale != 1:  # the engine_scale skill: merged engines are the simulator's
            raise ValueError(
                f"engine_scale {engine_scale}: a real cluster's engines here span {runtime.engine_devices} "
                "device(s) each (the recipes shard no engine across devices); set engine_scale 1"
            )
        if cluster == "local":
            from .local_cluster import LocalCluster

            return await LocalCluster.start(
                runtime,
                config,
                engine=engine,
                threads=threads,
                engine_options=engine_options,
                trainer_options=trainer_options,
            )
        from .ray_cluster import RayCluster
        from .weight_sync import DEFAULT_BUCKET_BYTES

        return await RayCluster.start(
            runtime,
            rollout,
            train,
            config,
            lendable=runtime.serving_devices if harvest else (),
            engine=engine,
            threads=threads,
            engine_options=engine_options,
            trainer_options=trainer_options,
            bucket_bytes=DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes,
        )

    def make_engine():
        from .engine_server import make_engine as make_engine_of_kind

        return make_engine_of_kind(engine, runtime.model_path, runtime.dtype, "engine", device=device, **engine_options)

    def make_trainer(state, training_config):
        from .fsdp_trainer import FSDPTrainer

        return FSDPTrainer(runtime.model_path, training_config, runtime.dtype, device, state=state, **trainer_options)

    def sync_engine(engine, state, version: int) -> None:
        from .weight_sync import DEFAULT_BUCKET_BYTES, merge, to_buckets

        engine.load_weights(
            merge(to_buckets(state, DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes)), version
        )

    # VAL: VAL_INT_RANGE (value=params.get("abort_stale", 0), min=0, max=1)
    # VAL: VAL_INT_RANGE (value=params.get("redundant_envs", 0), min=0, max=runtime.workload.group_size)
    # VAL: VAL_INT_RANGE (value=params.get("kv_routing", 0), min=0, max=1)
    # VAL: VAL_INT_RANGE (value=params.get("partial_rollout", 0), min=0, max=1)
    # VAL: VAL_INT_RANGE (value=params.get("tail_round", 0), min=0, max=runtime.workload.groups_per_step)
    # VAL: VAL_INT_RANGE (value=params.get("speculative_tokens", 0), min=0, max=8)
    # VAL: VAL_INT_RANGE (value=params.get("prefill_chunk", 0), min=0, max=1 << 20)
    # VAL: VAL_INT_RANGE (value=params.get("checkpoint_level", 0), min=0, max=2)
    # VAL: VAL_INT_RANGE (value=params.get("serving_harvest", 0), min=0, max=1)
    # VAL: VAL_INT_RANGE (value=params.get("stream_train", 0), min=0, max=1)
    # VAL: VAL_INT_RANGE (value=params.get("env_prestart", 0), min=0, max=1)
    # The audit bounds the spares by what is declared, holds the run to the declared staleness bound,
    # and lets only a stack declaring tail_round defer groups.
    declared = Declared(
        redundant_per_group=params.get("redundant_envs", 0),
        async_ratio=params.get("async_ratio"),
        partial_rollout=bool(params.get("partial_rollout", 0)),
        tail_round=params.get("tail_round", 0),
        env_prestart=params.get("env_prestart", 0) == 1,
    )
    # what the simulator models of the engines (on a real cluster the engine options above do it)
    engine_settings = EngineSettings(
        speculative_tokens=params.get("speculative_tokens", 0),
        speculative_batch=params.get("speculative_batch", 64),
        reward=reward,
        reward_devices=reward_devices,
        engine_scale=engine_scale,
        host_kv_tokens=host_kv_tokens,
        prefill_chunk=params.get("prefill_chunk", 0),
    )
    return Stack(controller, make_cluster, make_engine, make_trainer, sync_engine, declared, engine_settings)
