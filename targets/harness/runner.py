"""Runs one candidate in this (child) process: ``python -m targets.harness.runner ...``.

Two phases: ``accuracy`` runs checks 1-3 on the stack's components; ``system`` starts Ray with one
custom resource per device, runs the controller for the target's steps and writes the harness
trace (``trace.jsonl``) and the weights of every version (``weights/v<N>.safetensors``) to --out.
``--mode check`` runs both in this one process (one torch import and model load instead of two).
Each phase writes ``<phase>.json`` saying ``ok`` or carrying the error; the exit code is non-zero
on error, and a phase that errors ends the run.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib
import io
import json
import os
import pstats
import resource
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from targets.api import Device, Runtime
from targets.harness.candidate import PHASES
from targets.harness.clock import WallClock
from targets.harness.model import load_model, model_dir, proxy_model
from targets.harness.tokenizer import EOS, VOCAB
from targets.harness.trace import Trace
from targets.spec import TargetSpec, load_target

DEVICE_RESOURCE = "vt_device_"


def execution_of(spec: TargetSpec) -> str:
    """``real`` or ``simulated``; ``auto`` is real when this machine has the target's devices."""
    if spec.execution != "auto":
        return spec.execution
    if spec.hardware.kind == "cpu":
        return "real"
    import torch

    return "real" if torch.cuda.is_available() and torch.cuda.device_count() >= spec.hardware.count else "simulated"


def runtime_for(spec: TargetSpec) -> Runtime:
    """On a simulated target the components run (for accuracy checks 1-3) on a tiny model of the
    same family: the checks prove the code right, and the target's own model may not fit here."""
    devices = [Device(f"{spec.hardware.kind}:{i}", spec.hardware.kind, i) for i in range(spec.hardware.count)]
    model = spec.model if execution_of(spec) == "real" else proxy_model(spec.model)
    return Runtime(str(model_dir(model)), model.dtype, devices, DEVICE_RESOURCE, (VOCAB.ids[EOS],))


def import_stack(stack_dir: Path):
    sys.path.insert(0, str(stack_dir))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(stack_dir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return importlib.import_module("stack")


def run_accuracy(spec: TargetSpec, stack, runtime: Runtime) -> dict:
    from targets.harness.accuracy import check_engine, check_trainer, check_weight_sync

    built = stack.build(spec, runtime)
    reference = load_model(Path(runtime.model_path), runtime.dtype)
    results = [check_engine(built.make_engine(), reference, spec.accuracy)]
    results.append(check_trainer(built.make_trainer, reference, spec.workload.training.config(), spec.accuracy))
    engine = built.make_engine()
    results.append(check_weight_sync(engine, lambda state, v: built.sync_engine(engine, state, v), reference, spec.accuracy))
    return {"checks": [{"name": r.name, "passed": r.passed, "reasons": r.reasons, "details": r.details} for r in results]}


def run_system_mode(spec: TargetSpec, stack, runtime: Runtime, out: Path, seed: int, steps: int) -> dict:
    if execution_of(spec) == "simulated":
        from targets.harness.sim.run import run_simulated_mode

        return run_simulated_mode(spec, stack, runtime, out, seed, steps)
    import ray
    from safetensors.torch import save_file

    from targets.harness.system_run import run_system

    ray.init(
        num_cpus=os.cpu_count(), resources={f"{DEVICE_RESOURCE}{d.index}": 1.0 for d in runtime.devices},
        include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="vtray-", dir="/tmp"), configure_logging=False,
    )
    trace = Trace(WallClock())
    weights = {0: {k: v.detach().clone() for k, v in load_model(Path(runtime.model_path), runtime.dtype).state_dict().items()}}
    try:
        asyncio.run(run_system(spec, stack.build(spec, runtime), steps, seed, trace, weights))
    finally:
        trace.save(out / "trace.jsonl")
        (out / "weights").mkdir(exist_ok=True)
        for version, state in weights.items():
            save_file({k: v.contiguous() for k, v in state.items()}, out / "weights" / f"v{version}.safetensors")
        ray.shutdown()
    # Every actor is a descendant process, reaped by now: the largest one's peak resident memory.
    peak_kb = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return {"steps": steps, "versions": sorted(weights), "peak_process_memory_mb": peak_kb / 1024}


def _write_profile(profiler: cProfile.Profile, path: Path, top: int = 25) -> None:
    """The harness process's hottest functions by cumulative time (engines and trainers are other
    processes: their time shows here as waiting)."""
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).strip_dirs().sort_stats("cumulative").print_stats(top)
    path.write_text(stream.getvalue())


def _die_with_parent() -> None:
    """If whoever started this run goes away (a SIGKILLed orchestrator), take the whole run down:
    an orphan would keep writing into a directory a resumed run is about to reuse."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    parser = argparse.ArgumentParser(prog="python -m targets.harness.runner")
    parser.add_argument("--target", required=True)
    parser.add_argument("--stack", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--mode", choices=sorted(PHASES), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--execution", choices=["real", "simulated"], default=None, help="override the spec's execution")
    parser.add_argument("--profile", action="store_true", help="cProfile the system phase; top functions to profile.txt")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    loaded = None
    for phase in PHASES[args.mode]:
        result_path = args.out / f"{phase}.json"
        try:
            if loaded is None:
                spec = load_target(args.target)
                if args.execution:
                    spec = spec.model_copy(update={"execution": args.execution})
                loaded = (spec, import_stack(args.stack.resolve()), runtime_for(spec))
            spec, stack, runtime = loaded
            if phase == "accuracy":
                result = run_accuracy(spec, stack, runtime)
            elif args.profile:
                profiler = cProfile.Profile()
                result = profiler.runcall(run_system_mode, spec, stack, runtime, args.out, args.seed, args.steps or spec.workload.train_steps)
                _write_profile(profiler, args.out / "profile.txt")
            else:
                result = run_system_mode(spec, stack, runtime, args.out, args.seed, args.steps or spec.workload.train_steps)
            result_path.write_text(json.dumps({"status": "ok", **result}, indent=1))
        except Exception as error:  # the parent reports it; nothing is swallowed
            result_path.write_text(json.dumps({"status": "error", "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}))
            traceback.print_exc()
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
