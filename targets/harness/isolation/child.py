"""The harness's child process: ``python -m targets.harness.isolation.child --target T --stack DIR --out DIR ...``.

It is trusted harness code, and it never runs candidate code itself: every phase starts sandboxed
candidate processes and reaches them over channels. Phases, in order (``--mode``):

* ``accuracy``: checks 1-3 on the stack's components (a ``components`` process);
* ``system``: a system run (a ``controller`` process, and on real targets a ``cluster`` process),
  writing the harness trace (``trace.jsonl``) and the weights of every version (``weights/``);
* ``audit``: the system-run audit of that trace, training replay included.

``check`` runs all three; ``measure`` runs system and audit (every measured run is audited exactly
like the check's). Each phase writes ``<phase>.json`` (``ok`` or the error); the first error ends
the child with a non-zero exit. ``--marks-fd`` is a pipe to the parent, which times the system
run's start and end with its own clock. The workload's secret key comes in the environment
(``TASK_KEY``, hex; taken out of it at once, so no process started from here inherits it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from targets.harness.clock import WallClock
from targets.harness.environments.seeds import RunSeed
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.target import Target
from targets.harness.trace import Trace

PHASES = {"accuracy": ("accuracy",), "check": ("accuracy", "system", "audit"), "measure": ("system", "audit")}
TASK_KEY = "VIBETRAIN_TASK_KEY"


def run_accuracy(target: Target, sandbox: Sandbox, stack_dir: Path, out: Path) -> dict:
    from targets.harness.ipc.channel import Frame, SyncChannel
    from targets.harness.ipc.remote import RemoteComponents, raise_if_error
    from targets.harness.ipc.wire import put_runtime
    from targets.harness.isolation.processes import CandidateProcesses
    from targets.harness.judge.accuracy import check_engine, check_trainer, check_weight_sync

    runtime, accuracy = target.runtime(), target.spec.accuracy
    with CandidateProcesses(sandbox, stack_dir, out, gpus=target.gpu) as processes:
        processes.launch("components")
        channel = SyncChannel(processes.accept("components"))
        channel.send(Frame(kind="init", runtime=put_runtime(runtime)))
        components = RemoteComponents(channel)
        engine = components.make_engine_after(lambda: raise_if_error(channel.recv(), "build"))
        reference = target.reference_model()  # loads here while the candidate's process builds its engine
        results = [check_engine(engine(), reference, accuracy)]
        results.append(check_trainer(components.make_trainer, reference, runtime.workload.training, accuracy))
        engine = components.make_engine()
        results.append(
            check_weight_sync(engine, lambda state, v: components.sync_engine(engine, state, v), reference, accuracy)
        )
        components.close()
    return {"checks": [r.as_dict() for r in results]}


def run_system(
    target: Target, sandbox: Sandbox, stack_dir: Path, out: Path, seed: RunSeed, steps: int, mark: Callable[[str], None]
) -> dict:
    from targets.harness.isolation.drive import drive_real, drive_simulated
    from targets.harness.isolation.processes import CandidateProcesses

    with CandidateProcesses(sandbox, stack_dir, out, gpus=target.gpu) as processes:
        if target.simulated:
            runtime, children_before, harness_before = target.runtime(), _children_cpu_s(), time.process_time()
            mark("run_start")  # virtual time: the parent's clock checks nothing here, the marks only keep the shape
            trace, summary = drive_simulated(target.spec, runtime, processes, steps, seed)
            mark("run_end")
            summary["harness_cpu_seconds"] = time.process_time() - harness_before
            processes.stop()  # reaps the controller process, so its CPU time is counted below
            # only a plain subprocess is reaped here: a sandbox's own process namespace keeps its CPU time
            counted = sandbox.backend == "subprocess"
            summary["controller_cpu_seconds"] = _children_cpu_s() - children_before if counted else None
            trace.save(out / "trace.jsonl")
            return summary
        from targets.harness.ipc.weight_export import Layout, save_snapshot

        trace = Trace(WallClock())
        weights = out / "weights"
        weights.mkdir(exist_ok=True)

        def version_zero() -> Layout:  # the harness's own v0, written while the candidate's cluster starts
            state = target.reference_model().state_dict()
            save_snapshot(weights / "v0.safetensors", state)
            return Layout.of(state)

        try:
            with device_memory(target) as monitor:
                summary = asyncio.run(
                    drive_real(
                        target.spec,
                        target.runtime(),
                        processes,
                        steps,
                        seed,
                        trace,
                        weights,
                        mark,
                        version_zero,
                    )
                )
            if monitor is not None:
                names = target.spec.hardware.device_ids()
                summary["device_memory_mb"] = {names[i]: mb for i, mb in monitor.peaks_mb.items()}
                summary["peak_device_memory_mb"] = max(monitor.peaks_mb.values())
        finally:
            trace.save(out / "trace.jsonl")
    peak_kb = max(
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    )
    return {**summary, "peak_process_memory_mb": peak_kb / 1024}


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of the child processes reaped so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def device_memory(target: Target):
    """NVML sampling of the GPUs for a GPU target's real run; nothing to sample on CPU."""
    if not target.gpu:
        return contextlib.nullcontext()
    from targets.harness.isolation.device_memory import DeviceMemoryMonitor

    return DeviceMemoryMonitor(target.spec.hardware.count)


def run_audit(target: Target, out: Path, steps: int) -> dict:
    from targets.harness.judge.audit import audit_directory

    return {"result": audit_directory(target, out, steps).as_dict()}


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
    parser = argparse.ArgumentParser(prog="python -m targets.harness.isolation.child")
    parser.add_argument("--target", required=True)
    parser.add_argument("--stack", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--mode", choices=sorted(PHASES), required=True)
    parser.add_argument("--sandbox", required=True, help="bubblewrap | docker:IMAGE | subprocess")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--execution", choices=["real", "simulated"], required=True)
    parser.add_argument("--marks-fd", type=int, default=None)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    marks = os.fdopen(args.marks_fd, "w", buffering=1) if args.marks_fd is not None else None

    def mark(name: str) -> None:
        if marks is not None:
            marks.write(f"{name}\n")

    seed = RunSeed(args.seed, bytes.fromhex(os.environ.pop(TASK_KEY, "")))
    target = Target.load(args.target, simulate=args.execution == "simulated")
    steps = args.steps or target.spec.workload.train_steps
    sandbox = Sandbox.named(args.sandbox)
    for phase in PHASES[args.mode]:
        started = time.monotonic()
        try:
            if phase == "accuracy":
                result = run_accuracy(target, sandbox, args.stack.resolve(), args.out)
            elif phase == "system":
                result = run_system(target, sandbox, args.stack.resolve(), args.out, seed, steps, mark)
            else:
                result = run_audit(target, args.out, steps)
            result["phase_seconds"] = time.monotonic() - started
            (args.out / f"{phase}.json").write_text(json.dumps({"status": "ok", **result}, indent=1))
        except Exception as error:  # the parent reports it; nothing is swallowed
            (args.out / f"{phase}.json").write_text(
                json.dumps(
                    {
                        "status": "error",
                        "error": f"{type(error).__name__}: {error}",
                        "traceback": traceback.format_exc(),
                    }
                )
            )
            traceback.print_exc()
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
