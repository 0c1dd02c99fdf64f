"""Runs a candidate in a child process with a time limit: its own process group (killed whole on
timeout), its output captured to a log. A crash or a hang becomes a clear cause, never a hung judge."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# What each ``--mode`` of ``python -m targets.harness.runner`` runs, in order (one child process).
PHASES = {"accuracy": ("accuracy",), "system": ("system",), "check": ("accuracy", "system")}


@dataclass
class CandidateRun:
    ok: bool
    cause: str
    out: Path
    results: dict[str, dict] = field(default_factory=dict)  # phase -> what the runner wrote for it


def run_candidate(target: str, stack_dir: Path, out: Path, mode: str, time_limit_s: float, seed: int = 0,
                  steps: int | None = None, execution: str | None = None) -> CandidateRun:
    """``mode``: ``accuracy``, ``system`` or ``check`` (both phases in one child process);
    ``execution``: ``real`` or ``simulated`` to override the target's."""
    if not (stack_dir / "stack" / "__init__.py").exists():
        return CandidateRun(False, f"{stack_dir} has no stack/__init__.py: not a candidate directory", out)
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "targets.harness.runner", "--target", target, "--stack", str(stack_dir),
               "--out", str(out), "--mode", mode, "--seed", str(seed)]
    if steps is not None:
        command += ["--steps", str(steps)]
    if execution is not None:
        command += ["--execution", execution]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    log_path = out / f"{mode}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            process.wait(timeout=time_limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            timed_out = True
    results = {phase: json.loads((out / f"{phase}.json").read_text()) for phase in PHASES[mode] if (out / f"{phase}.json").exists()}
    if timed_out:
        running = next((p for p in PHASES[mode] if p not in results), PHASES[mode][-1])
        return CandidateRun(False, f"{running} run exceeded its time limit of {time_limit_s:g}s (killed)", out, results)
    if process.returncode != 0:
        failed = next((p for p in PHASES[mode] if results.get(p, {}).get("status") != "ok"), mode)
        cause = results.get(failed, {}).get("error") or f"exited with code {process.returncode}: " + " | ".join(log_path.read_text().splitlines()[-5:])
        return CandidateRun(False, f"{failed} run failed: {cause}", out, results)
    return CandidateRun(True, "", out, results)
