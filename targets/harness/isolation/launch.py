"""Launching the harness child with limits: a fork of the zygote (``zygote.py``: the imports every
child needs, made once per orchestrator), in its own process group (killed whole on any limit), its
output captured to a log, and a watchdog over the whole process tree (the harness and the candidate
processes it starts, the judge processes the harness zygote forked for it, and in the subprocess
sandbox the candidate processes the candidate zygote forked for it): wall time, resident memory
summed over the tree, the number of processes and of threads (a fork or thread bomb), and the disk the
candidate's logs and scratch folders hold (``written.py``). A crash, a
hang, a memory blow-up or a fork storm becomes a clear cause, never a hung or starved judge.

The parent also keeps its own time: the child tells it (over a pipe) the moment the system run
starts and ends, and the parent stamps both with its own clock, an independent measurement of the
run's duration that the harness trace must agree with.
"""

from __future__ import annotations

import json
import os
import select
import time
from dataclasses import dataclass, field
from pathlib import Path

from targets.harness.isolation.child import FORKED, PHASES, TASK_KEY
from targets.harness.isolation.containers import OWNER_ENV, owned_containers
from targets.harness.isolation.process_tree import (
    children_of,
    kill_forked,
    kill_tree,
    process_tree,
    resident_bound_mb,
    resident_mb,
    thread_count,
    wait_exited,
)
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.isolation.written import DiskWatch
from targets.harness.isolation.zygote_client import FORKS_FD, JUDGES_FD, MARKS_FD, ZygoteChild, zygote
from targets.harness.target import Target

KILLED_EXIT_S = 10.0  # how long a killed run's processes get to be gone (a SIGKILL acts when each next runs)


@dataclass(frozen=True)
class Limits:
    time_s: float = 600.0
    memory_mb: float = 12_000.0  # resident memory of the whole process tree
    processes: int = 128  # Ray itself runs a few dozen
    threads: int = 8192  # over the whole tree: a one-GPU check's Ray and torch run well under a thousand
    disk_mb: float = 4_000.0  # the candidate's logs and scratch folders (written.py); its caches are in its tmpfs

    @classmethod
    def of(cls, target: Target, time_s: float | None = None) -> Limits:
        """The target's ``limits`` (by default sized by its model and a real reward model's, whose
        processes are in the tree too; a simulated target runs a tiny proxy model here), the time
        overridden when given."""
        spec, parameters = target.spec, 0
        if not target.simulated:
            judge = spec.workload.reward_model
            parameters = int(spec.model.param_counts().total + (judge.model.param_counts().total if judge else 0))
        memory_mb, seconds = spec.limits.resolved(parameters)
        return cls(time_s=seconds if time_s is None else time_s, memory_mb=memory_mb)


@dataclass
class HarnessRun:
    ok: bool
    cause: str
    out: Path
    results: dict[str, dict] = field(default_factory=dict)  # phase -> what the child wrote for it
    marks: dict[str, float] = field(default_factory=dict)  # run_start / run_end, on the parent's monotonic clock

    @property
    def parent_seconds(self) -> float | None:
        """The system run's duration as this (parent) process measured it."""
        if "run_start" in self.marks and "run_end" in self.marks:
            return self.marks["run_end"] - self.marks["run_start"]
        return None


def _forks_running(forkers: list[int], children: dict[int, list[int]]) -> set[int]:
    """The zygotes' children now: a pid the run was told of counts only while it is one of them (a pid
    that ended and was reused is not ours)."""
    return {pid for forker in forkers for pid in children.get(forker, ())}


def _run_tree(child: int, forked: list[int], forkers: list[int], children: dict[int, list[int]]) -> list[int]:
    """The run's processes, from one read of the process table (``children``): the harness child's tree,
    and the tree of each process forked for it (judges, candidate processes) that is still running."""
    running = _forks_running(forkers, children)
    return [p for root in (child, *(pid for pid in forked if pid in running)) for p in process_tree(root, children)]


def _kill_run(child: int, forked: list[int], forkers: list[int]) -> list[int]:
    """The harness child's tree, and each forked process's (``kill_forked``). Returns those of them
    still running ``KILLED_EXIT_S`` after the signal (normally none)."""
    children = children_of()
    doomed = _run_tree(child, forked, forkers, children)
    kill_tree(child)
    kill_forked(forked, _forks_running(forkers, children))
    return wait_exited(doomed, [child, *forked], KILLED_EXIT_S)


def killed_cause(phases: tuple[str, ...], results: dict, killed: str) -> str:
    """Why a killed run failed: the phase it was in, or, when every phase had answered, the run itself
    (a process lingering past it, a candidate's growing, or its way out)."""
    running = next((p for p in phases if p not in results), None)
    if running is None:
        return f"the run, after every phase answered, {killed} (killed)"
    return f"{running} run {killed} (killed)"


def _watch(
    process: ZygoteChild,
    limits: Limits,
    marks_fd: int,
    exits_fd: int,
    marks: dict[str, float],
    forked: list[int],
    forkers: list[int],
    disk: DiskWatch | None = None,
) -> str:
    """Wait for the child, stamping its marks as they arrive (and adding to ``forked`` each process it
    says was forked for it, to ``disk`` each path it says the candidate writes); returns '' when it
    exited, else why it was killed. ``exits_fd``: where the child's exit is said (its zygote's
    connection), so that its end is seen when it happens."""
    disk = DiskWatch() if disk is None else disk
    deadline = time.monotonic() + limits.time_s
    pending = b""
    open_fd = True
    while True:
        watched = ([marks_fd] if open_fd else []) + [exits_fd]
        readable, _, _ = select.select(watched, [], [], 0.25)
        if marks_fd in readable:
            chunk = os.read(marks_fd, 4096)
            now = time.monotonic()
            if not chunk:
                open_fd = False
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                name = line.decode(errors="replace")
                if name.startswith(f"{FORKED} "):
                    forked.append(int(name.split()[1]))
                elif not disk.heard(name):
                    marks.setdefault(name, now)
        if process.poll() is not None:
            return ""
        tree = _run_tree(process.pid, forked, forkers, children_of())
        if time.monotonic() > deadline:
            why = f"exceeded its time limit of {limits.time_s:g}s"
        elif len(tree) > limits.processes:
            why = f"ran {len(tree)} processes, over its limit of {limits.processes} (a fork storm?)"
        elif (threads := thread_count(tree)) > limits.threads:
            why = f"ran {threads} threads, over its limit of {limits.threads} (a thread storm?)"
        elif excess := disk.excess(limits.disk_mb):
            why = excess
        else:
            try:
                resident = resident_bound_mb(tree)  # cheap, from above: the exact measure only past the limit
                if resident > limits.memory_mb:
                    resident = resident_mb(tree)
            except PermissionError as error:  # a process made itself unreadable: its memory is not counted
                why = f"hid a process's memory from the harness ({error}): the memory limit cannot be held"
            else:
                if resident <= limits.memory_mb:
                    continue
                why = f"used {resident:.0f} MB of resident memory, over its limit of {limits.memory_mb:g} MB"
        left = _kill_run(process.pid, forked, forkers)
        process.wait()
        disk.after_kill()
        if left:
            why += f" ({len(left)} of its processes still running {KILLED_EXIT_S:g}s after they were killed)"
        return why


def run_harness(
    target: Target,
    stack_dir: Path,
    out: Path,
    mode: str,
    limits: Limits,
    sandbox: Sandbox,
    seed: int = 0,
    steps: int | None = None,
    task_key: bytes = b"",
) -> HarnessRun:
    """``mode``: ``accuracy``, ``check`` (accuracy, system, audit) or ``measure`` (system, audit).
    ``task_key``: the secret the workload is drawn with (``environments/seeds.py``), handed to the
    child in its environment, never on a command line."""
    stack_dir, out = Path(stack_dir).resolve(), Path(out).resolve()  # the child runs elsewhere
    if not (stack_dir / "stack" / "__init__.py").exists():
        return HarnessRun(False, f"{stack_dir} has no stack/__init__.py: not a candidate directory", out)
    out.mkdir(parents=True, exist_ok=True)
    argv = [  # what ``python -m targets.harness.isolation.child`` takes; run by a fork of the zygote
        "--target",
        target.ref,
        "--stack",
        str(stack_dir),
        "--out",
        str(out),
        "--mode",
        mode,
        "--seed",
        str(seed),
        "--sandbox",
        sandbox.name,
        "--execution",
        target.execution,
        "--marks-fd",
        str(MARKS_FD),
        "--memory-mb",
        f"{limits.memory_mb:g}",
    ]
    if steps is not None:
        argv += ["--steps", str(steps)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", TASK_KEY: task_key.hex()}
    marks: dict[str, float] = {}
    disk = DiskWatch()  # what the candidate writes, as the child names it
    forked: list[int] = []  # the processes forked for this run: judges, and candidate processes (subprocess sandbox)
    forks = None
    harness = zygote()  # started (on first use) before the candidate zygote is waited for: both warm at once
    forkers = [harness.process.pid]
    argv += ["--parent-pid", str(harness.process.pid)]  # its parent: the run ends with it
    if sandbox.backend == "subprocess":  # warm candidate processes, forked by the candidate zygote
        candidates = zygote("candidate")
        forkers.append(candidates.process.pid)
        forks = candidates.connect()
        argv += ["--forks-fd", str(FORKS_FD)]
    judges = harness.connect()  # the run's judge processes, forked warm by the harness zygote
    argv += ["--judges-fd", str(JUDGES_FD)]
    log_path = out / f"{mode}.log"
    # the candidates' Docker containers (none in another sandbox) are removed once the run's processes
    # are, however they ended: a killed client leaves its container running
    with owned_containers(sandbox.backend) as owner:
        if owner is not None:
            env[OWNER_ENV] = owner
        read_fd, write_fd = os.pipe()  # after the zygotes: one that failed to start leaves no descriptor open
        try:
            with log_path.open("w") as log:
                # in the order MARKS_FD, JUDGES_FD, FORKS_FD say: the zygote places them at passed_fd(0), (1), (2)
                extra = [write_fd, judges.fileno()] + ([] if forks is None else [forks.fileno()])
                process = harness.spawn(argv, env, log.fileno(), *extra)  # in a session of its own
                os.close(write_fd)
                write_fd = -1
                for connection in (judges, forks):  # the child holds them: when it ends, what it forked is killed
                    if connection is not None:
                        connection.close()
                try:
                    killed = _watch(process, limits, read_fd, process.owner.fileno(), marks, forked, forkers, disk)
                finally:
                    if process.poll() is None:  # this process is going away (Ctrl-C, SIGTERM): the run's too
                        _kill_run(process.pid, forked, forkers)
                        process.wait()
                        disk.after_kill()
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
            for connection in (judges, forks):
                if connection is not None and connection.fileno() >= 0:
                    connection.close()
    phases = PHASES[mode]
    results = {p: json.loads((out / f"{p}.json").read_text()) for p in phases if (out / f"{p}.json").exists()}
    if killed:
        return HarnessRun(False, killed_cause(phases, results, killed), out, results, marks)
    if process.returncode != 0:
        failed = next((p for p in phases if results.get(p, {}).get("status") != "ok"), mode)
        ended = process.owner.went_away or f"exited with code {process.returncode}"  # a zygote's death kills it
        cause = results.get(failed, {}).get("error") or f"{ended}: " + " | ".join(
            log_path.read_text().splitlines()[-5:]
        )
        return HarnessRun(False, f"{failed} run failed: {cause}", out, results, marks)
    return HarnessRun(True, "", out, results, marks)
