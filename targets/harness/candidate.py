"""Runs a candidate in a child process with limits: its own process group (killed whole on any
limit), its output captured to a log. A watchdog polls the child's process tree: wall time,
resident memory summed over the tree, and the number of processes (a fork bomb). A crash, a hang,
a memory blow-up or a fork storm becomes a clear cause, never a hung or starved judge.

``launcher`` wraps the command and environment (a sandbox: bubblewrap, Docker); by default the
child runs as a plain subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# What each ``--mode`` of ``python -m targets.harness.runner`` runs, in order (one child process).
PHASES = {"accuracy": ("accuracy",), "system": ("system",), "check": ("accuracy", "system")}

Launcher = Callable[[list[str], dict, Path, Path], tuple[list[str], dict]]
"""(command, environment, stack directory, output directory) -> (command, environment)."""


@dataclass(frozen=True)
class Limits:
    time_s: float = 600.0
    memory_mb: float = 12_000.0  # resident memory of the whole process tree
    processes: int = 128  # Ray itself runs a few dozen


@dataclass
class CandidateRun:
    ok: bool
    cause: str
    out: Path
    results: dict[str, dict] = field(default_factory=dict)  # phase -> what the runner wrote for it


def _process_tree(root: int) -> list[int]:
    """``root`` and every descendant, from /proc (parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
        children.setdefault(parent, []).append(int(entry))
    tree, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        tree.append(pid)
        frontier += children.get(pid, [])
    return tree


def _resident_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def _kill_tree(process: subprocess.Popen) -> None:
    pids = _process_tree(process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids:  # anything that left the process group
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def _watch(process: subprocess.Popen, limits: Limits) -> str:
    """Wait for the child; returns '' when it exited, else why it was killed."""
    deadline = time.monotonic() + limits.time_s
    while True:
        try:
            process.wait(timeout=0.5)
            return ""
        except subprocess.TimeoutExpired:
            pass
        tree = _process_tree(process.pid)
        if time.monotonic() > deadline:
            why = f"exceeded its time limit of {limits.time_s:g}s"
        elif len(tree) > limits.processes:
            why = f"ran {len(tree)} processes, over its limit of {limits.processes} (a fork storm?)"
        elif (resident := _resident_mb(tree)) > limits.memory_mb:
            why = f"used {resident:.0f} MB of resident memory, over its limit of {limits.memory_mb:g} MB"
        else:
            continue
        _kill_tree(process)
        return why


def run_candidate(target: str, stack_dir: Path, out: Path, mode: str, time_limit_s: float | Limits, seed: int = 0,
                  steps: int | None = None, execution: str | None = None, launcher: Launcher | None = None,
                  extra_args: tuple[str, ...] = ()) -> CandidateRun:
    """``mode``: ``accuracy``, ``system`` or ``check`` (both phases in one child process);
    ``execution``: ``real`` or ``simulated`` to override the target's."""
    limits = time_limit_s if isinstance(time_limit_s, Limits) else Limits(time_s=time_limit_s)
    stack_dir, out = Path(stack_dir).resolve(), Path(out).resolve()  # the child may run in another directory
    if not (stack_dir / "stack" / "__init__.py").exists():
        return CandidateRun(False, f"{stack_dir} has no stack/__init__.py: not a candidate directory", out)
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "targets.harness.runner", "--target", str(target), "--stack", str(stack_dir),
               "--out", str(out), "--mode", mode, "--seed", str(seed), *extra_args]
    if steps is not None:
        command += ["--steps", str(steps)]
    if execution is not None:
        command += ["--execution", execution]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    if launcher is not None:
        command, env = launcher(command, env, stack_dir, out)
    log_path = out / f"{mode}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        killed = _watch(process, limits)
    results = {phase: json.loads((out / f"{phase}.json").read_text()) for phase in PHASES[mode] if (out / f"{phase}.json").exists()}
    if killed:
        running = next((p for p in PHASES[mode] if p not in results), PHASES[mode][-1])
        return CandidateRun(False, f"{running} run {killed} (killed)", out, results)
    if process.returncode != 0:
        failed = next((p for p in PHASES[mode] if results.get(p, {}).get("status") != "ok"), mode)
        cause = results.get(failed, {}).get("error") or f"exited with code {process.returncode}: " + " | ".join(log_path.read_text().splitlines()[-5:])
        return CandidateRun(False, f"{failed} run failed: {cause}", out, results)
    return CandidateRun(True, "", out, results)
