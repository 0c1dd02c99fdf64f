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
run's start and end with its own clock (and hears there of each process forked for the run, so its
limits hold them too: the judges forked over ``--judges-fd``, a connection to the harness zygote, and
the candidate processes over ``--forks-fd``, a connection to the candidate zygote). The workload's
secret key comes in the environment (``TASK_KEY``, hex; taken out of it at once, so no process
started from here inherits it).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from targets.harness.clock import WallClock
from targets.harness.environments.adapters import UserEnvironmentError
from targets.harness.environments.seeds import RunSeed
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.isolation.zygote_client import ReportedForks, ZygoteClient, use_forks
from targets.harness.reward_model.service import JudgeProcessError
from targets.harness.strict_loop import run_strict
from targets.harness.target import Target
from targets.harness.trace import Trace

if TYPE_CHECKING:
    from targets.harness.isolation.processes import CandidateProcesses

PHASES = {"accuracy": ("accuracy",), "check": ("accuracy", "system", "audit"), "measure": ("system", "audit")}
TASK_KEY = "VIBETRAIN_TASK_KEY"
FORKED = "forked"  # a marks line ``forked PID``: a process forked for this run, for the watchdog


@contextlib.contextmanager
def progress_lines(phase: str):
    """The phase's logger (``vibetrain.<phase>``) writes timed lines to this process's output, the
    phase's log: a 0.6B check takes minutes, and one cut short still says where it was."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[{phase} %(asctime)s] %(message)s", "%H:%M:%S"))
    logger = logging.getLogger(f"vibetrain.{phase}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield logger
    finally:
        logger.removeHandler(handler)


def run_accuracy(target: Target, candidates: Callable[[], CandidateProcesses]) -> dict:
    with progress_lines("accuracy") as log:
        return _accuracy(target, candidates, log)


def _accuracy(target: Target, candidates: Callable[[], CandidateProcesses], log: logging.Logger) -> dict:
    started = time.monotonic()

    def said(what: str) -> None:
        log.info("%s (%.1f s in)", what, time.monotonic() - started)

    with candidates() as processes:
        processes.launch("components")  # first: its start-up runs while this process imports what follows
        from targets.harness.ipc.channel import Frame, SyncChannel
        from targets.harness.ipc.remote import RemoteComponents, raise_if_error
        from targets.harness.ipc.wire import put_runtime
        from targets.harness.judge.accuracy import (
            CheckDraw,
            check_engine,
            check_trainer,
            check_weight_sync,
            fixed_train_batches,
        )
        from targets.harness.tokenizer import defined_ids

        runtime, accuracy = target.runtime(), target.spec.accuracy
        channel = SyncChannel(processes.accept("components"))
        channel.send(Frame(kind="init", runtime=put_runtime(runtime)))
        components = RemoteComponents(channel)
        engine = components.make_engine_after(lambda: raise_if_error(channel.recv(), "build"))
        reference = target.reference_model()  # loads here while the candidate's process builds its engine
        said("reference model loaded")
        draw = CheckDraw.fresh(defined_ids(Path(runtime.model_path), reference.config.vocab_size))
        results = [check_engine(engine(), reference, accuracy, draw)]
        said(f"check 1 (engine): {'passed' if results[-1].passed else 'failed'}")
        batches = fixed_train_batches(reference, draw, temperature=runtime.workload.training.temperature)
        results.append(check_trainer(components.make_trainer, reference, runtime.workload.training, accuracy, batches))
        said(f"check 2 (trainer): {'passed' if results[-1].passed else 'failed'}")
        engine = components.make_engine()
        said("a second engine built")
        results.append(
            check_weight_sync(
                engine, lambda state, v: components.sync_engine(engine, state, v), reference, accuracy, draw=draw
            )
        )
        said(f"check 3 (weight sync): {'passed' if results[-1].passed else 'failed'}")
        components.close()
    return {"checks": [r.as_dict() for r in results]}


def run_system(
    target: Target,
    candidates: Callable[[], CandidateProcesses],
    out: Path,
    seed: RunSeed,
    steps: int,
    mark: Callable[[str], None],
    before_run: Callable[[], Awaitable[None]] | None = None,
) -> dict:
    from targets.harness.isolation.drive import drive_real, drive_simulated

    with candidates() as processes:
        if target.simulated:
            runtime, children_before, harness_before = target.runtime(), _children_cpu_s(), time.process_time()
            mark("run_start")  # virtual time: the parent's clock checks nothing here, the marks only keep the shape
            trace, summary = drive_simulated(target.spec, runtime, processes, steps, seed)
            mark("run_end")
            summary["harness_cpu_seconds"] = time.process_time() - harness_before
            processes.stop()  # reaps the controller process, so its CPU time is counted below
            # only a plain subprocess is reaped here: a sandbox's own process namespace keeps its CPU time
            counted = processes.sandbox.backend == "subprocess"
            cpu_s = _children_cpu_s() - children_before + processes.forked_cpu_seconds()
            summary["controller_cpu_seconds"] = cpu_s if counted else None
            trace.save(out / "trace.jsonl")
            return summary
        from targets.harness.ipc.weight_export import Layout, save_snapshot

        trace = Trace(WallClock())
        trace.stream_to(out / "trace.jsonl")  # what a run killed midway did stays on disk
        weights = out / "weights"
        weights.mkdir(exist_ok=True)

        def version_zero() -> Layout:  # the harness's own v0, written while the candidate's cluster starts
            state = target.reference_model().state_dict()
            save_snapshot(weights / "v0.safetensors", state)
            return Layout.of(state)

        try:
            with device_memory(target) as monitor:
                summary = run_strict(  # a callback that raises ends the run, never stalls it
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
                        before_run,
                    ),
                    asyncio.new_event_loop(),
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


def run_audit(target: Target, out: Path, steps: int, seed: RunSeed) -> dict:
    """The audit, its progress in this phase's log (a 0.6B replay takes minutes; a run cut short
    still says where it was). It knows what the run's episodes were drawn from (``seed``)."""
    from targets.harness.judge.audit import audit_directory

    with progress_lines("audit"):
        return {"result": audit_directory(target, out, steps, workload=seed).as_dict()}


def _die_with_parent(parent: int) -> None:
    """If whoever started this run goes away (a SIGKILLed orchestrator), take the whole run down:
    an orphan would keep writing into a directory a resumed run is about to reuse. ``parent`` is
    named by the launcher, not read here: a parent that died before this line ran has already handed
    the child to another (init), which it would then watch for ever."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m targets.harness.isolation.child")
    parser.add_argument("--parent-pid", type=int, required=True, help="the process whose death ends the run")
    parser.add_argument("--target", required=True)
    parser.add_argument("--stack", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--mode", choices=sorted(PHASES), required=True)
    parser.add_argument("--sandbox", required=True, help="bubblewrap | docker:IMAGE | subprocess")
    parser.add_argument(
        "--memory-mb", type=float, default=None, help="the run's memory limit, for what the watchdog does not see"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--execution", choices=["real", "simulated"], required=True)
    parser.add_argument("--marks-fd", type=int, default=None)
    parser.add_argument("--forks-fd", type=int, default=None, help="a connection to the candidate zygote")
    parser.add_argument("--judges-fd", type=int, default=None, help="a connection to the harness zygote")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    args.out.mkdir(parents=True, exist_ok=True)
    marks = os.fdopen(args.marks_fd, "w", buffering=1) if args.marks_fd is not None else None
    writing = threading.Lock()  # the accuracy phase may start processes beside the system run

    def mark(name: str) -> None:
        if marks is not None:
            with writing:
                marks.write(f"{name}\n")

    def forked(pid: int) -> None:  # a process forked for the run is not its child: the watchdog hears of each
        mark(f"{FORKED} {pid}")

    for fd, kind in ((args.forks_fd, "candidate"), (args.judges_fd, "harness")):
        if fd is not None:
            os.set_inheritable(fd, False)  # no process it starts may keep the connection open
            use_forks(ReportedForks(ZygoteClient(socket.socket(fileno=fd), kind), forked))

    seed = RunSeed(args.seed, bytes.fromhex(os.environ.pop(TASK_KEY, "")))
    target = Target.load(args.target, simulate=args.execution == "simulated")
    steps = args.steps or target.spec.workload.train_steps
    sandbox, stack = Sandbox.named(args.sandbox), args.stack.resolve()
    beside, model = None, target.model_path()

    def candidates() -> CandidateProcesses:  # a phase's processes; the watchdog hears of what they write
        from targets.harness.isolation.processes import CandidateProcesses

        memory = None if args.memory_mb is None else int(args.memory_mb * 2**20)
        return CandidateProcesses(
            sandbox, stack, args.out, target.gpu, lambda kind, p: mark(f"{kind} {p}"), memory, model
        )

    def accuracy() -> dict:
        return run_accuracy(target, candidates)

    if args.mode == "check" and accuracy_beside_start_up(target) and _ready_for_two_threads(target):
        beside = AccuracyBeside(lambda: record_phase(args.out, "accuracy", accuracy))
    phases = {
        "accuracy": accuracy,
        "system": lambda: run_system(target, candidates, args.out, seed, steps, mark, beside and beside.passed),
        "audit": lambda: run_audit(target, args.out, steps, seed),
    }
    try:
        for phase in PHASES[args.mode]:
            if phase == "accuracy" and beside is not None:
                continue  # it runs beside the system run's start-up
            if not record_phase(args.out, phase, phases[phase]):
                return 1
    finally:
        if beside is not None:
            beside.done.result()  # its outcome is written before this process ends, whatever happened here
    return 0


def record_phase(out: Path, phase: str, run: Callable[[], dict]) -> bool:
    """Runs one phase and writes ``<phase>.json``: ``ok`` with its result, or the error (the parent
    reports it; nothing is swallowed). Whether it succeeded. A user's environment that failed (its
    entry, its reset or a step raised, hung while resetting, answered out of contract) is marked
    ``fault: environment``, a reward model's process that failed ``fault: reward model``, and an audit
    that raised ``fault: harness`` (it reads only the harness's own trace and weights): the user's code
    or the harness's failed, not the candidate's."""
    started = time.monotonic()
    try:
        result = run()
    except AccuracyFailed:
        return False  # accuracy.json says why; the run never started
    except Exception as error:  # noqa: BLE001 - written for the parent, which reports it
        report = {"status": "error", "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        if isinstance(error, UserEnvironmentError):  # raised in this process, by the harness: no candidate sets it
            report.update(fault="environment", message=str(error))
        elif isinstance(error, JudgeProcessError):  # the reward model's process, the harness's own
            report.update(fault="reward model", message=str(error))
        elif phase == "audit":  # a verdict is a reason, never a crash: a crash is the harness's bug
            report.update(fault="harness", message=f"the audit raised {type(error).__name__}: {error}")
        (out / f"{phase}.json").write_text(json.dumps(report, indent=1))
        traceback.print_exc()
        return False
    result["phase_seconds"] = time.monotonic() - started
    (out / f"{phase}.json").write_text(json.dumps({"status": "ok", **result}, indent=1))
    return True


def _ready_for_two_threads(target: Target) -> bool:
    """What both threads need, done once here: the model's directory built (if it must be) and the
    modules both import loaded (torch among them), so no two threads import one module at once (the
    accuracy checks' own, transformers, only that thread imports before the gate). False when that
    failed: the accuracy phase then runs first, alone, and records the error where the parent reads it."""
    try:
        target.runtime()
        import targets.harness.ipc.remote  # noqa: F401
        import targets.harness.isolation.drive  # noqa: F401
    except Exception:  # noqa: BLE001 - not hidden: the accuracy phase meets it again and records it
        return False
    return True


def accuracy_beside_start_up(target: Target) -> bool:
    """A check's accuracy phase may run while the system run's cluster starts (Ray, actors, imports:
    seconds of a 2-core machine's time otherwise spent waiting) on a real CPU target only: on a GPU,
    the components and the cluster would hold the devices' memory at once; a simulated run counts the
    harness's own CPU time, which the accuracy phase would add to."""
    return not target.gpu and not target.simulated


class AccuracyFailed(RuntimeError):
    """The accuracy phase beside the start-up failed: the system run does not start."""


class AccuracyBeside:
    """The accuracy phase in a thread of its own, started now; ``passed`` is awaited by the real run
    while its cluster starts, before the run's own use of torch in this process and before anything
    of the run happens (so no measured second overlaps it)."""

    def __init__(self, run: Callable[[], bool]) -> None:
        self.done: concurrent.futures.Future[bool] = concurrent.futures.Future()

        def phase() -> None:
            try:
                self.done.set_result(run())
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits on it, never lost
                self.done.set_exception(error)

        threading.Thread(target=phase, name="accuracy-phase", daemon=True).start()

    async def passed(self) -> None:
        if not await asyncio.wrap_future(self.done):
            raise AccuracyFailed("the accuracy phase failed")


if __name__ == "__main__":
    sys.exit(main())
