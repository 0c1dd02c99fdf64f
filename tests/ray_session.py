"""One Ray cluster the test session's real runs share (``RAY_ADDRESS``, set by conftest.py's ``shared_ray``
for the modules that ask): a candidate in the subprocess sandbox joins it instead of starting its own,
which costs ~5 s of a ~15 s run on 2 cores. The cluster
lives in a process of its own (``python tests/ray_session.py``), which prints the cluster's address,
offers the device resources the harness names, and shuts the cluster down when its stdin closes. Its
Python workers are forks of a warm process (``ray_worker_zygote.py``) instead of fresh interpreters."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager

DEVICES = 8  # device resources offered: the most any real CPU target of the tests uses


@contextmanager
def shared_ray_cluster():
    """The cluster's address while it runs (the caller sets ``RAY_ADDRESS`` where runs should join it)."""
    holder = subprocess.Popen(
        [sys.executable, __file__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"},
    )
    address = holder.stdout.readline().strip()
    if not address:
        holder.wait()
        raise RuntimeError(f"the shared Ray cluster did not start (exit code {holder.returncode})")
    try:
        yield address
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def _start_warm_workers(temp_dir: str) -> subprocess.Popen:
    """The warm worker process, ready, and the raylet's Python made its launcher (``sys.executable`` is
    what Ray starts its processes with)."""
    launcher = os.path.join(temp_dir, "python")
    zygote = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "ray_worker_zygote.py"), temp_dir, launcher],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    if zygote.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the warm Ray worker process did not start (exit code {zygote.wait()})")
    sys.executable = launcher
    return zygote


def main() -> None:
    import ray

    from targets.harness.target import DEVICE_RESOURCE

    temp_dir = tempfile.mkdtemp(prefix="vtray-shared-", dir="/tmp")
    zygote = _start_warm_workers(temp_dir)
    ray.init(
        num_cpus=os.cpu_count(),
        resources={f"{DEVICE_RESOURCE}{i}": 1.0 for i in range(DEVICES)},
        include_dashboard=False,
        configure_logging=False,
        _temp_dir=temp_dir,
    )
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # until the tests close it
    ray.shutdown()
    zygote.kill()
    zygote.wait()
    shutil.rmtree(temp_dir)  # its logs and sockets: ~6 MB of /tmp a test module otherwise


if __name__ == "__main__":
    main()
