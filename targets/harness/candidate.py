"""Runs a candidate in a child process with a time limit: its own process group (killed whole on
timeout), its output captured to a log. A crash or a hang becomes a clear cause, never a hung judge."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CandidateRun:
    ok: bool
    cause: str
    out: Path
    result: dict


def run_candidate(target: str, stack_dir: Path, out: Path, mode: str, time_limit_s: float, seed: int = 0, steps: int | None = None) -> CandidateRun:
    if not (stack_dir / "stack" / "__init__.py").exists():
        return CandidateRun(False, f"{stack_dir} has no stack/__init__.py: not a candidate directory", out, {})
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "targets.harness.runner", "--target", target, "--stack", str(stack_dir),
               "--out", str(out), "--mode", mode, "--seed", str(seed)]
    if steps is not None:
        command += ["--steps", str(steps)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    log_path = out / f"{mode}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            process.wait(timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return CandidateRun(False, f"{mode} run exceeded its time limit of {time_limit_s:g}s (killed)", out, {})
    result_path = out / f"{mode}.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    if process.returncode != 0:
        cause = result.get("error") or f"exited with code {process.returncode}: " + " | ".join(log_path.read_text().splitlines()[-5:])
        return CandidateRun(False, f"{mode} run failed: {cause}", out, result)
    return CandidateRun(True, "", out, result)
