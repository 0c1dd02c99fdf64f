"""One Ray cluster the test session's real runs share (``RAY_ADDRESS``, set by conftest.py's ``shared_ray``
for the modules that ask): a candidate in the subprocess sandbox joins it instead of starting its own,
which costs ~5 s of a ~15 s run on 2 cores. The cluster
lives in a process of its own (``python tests/ray_session.py``), which prints the cluster's address,
offers the device resources the harness names, and shuts the cluster down when its stdin closes."""

from __future__ import annotations

import os
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


def main() -> None:
    import ray

    from targets.harness.target import DEVICE_RESOURCE

    ray.init(
        num_cpus=os.cpu_count(),
        resources={f"{DEVICE_RESOURCE}{i}": 1.0 for i in range(DEVICES)},
        include_dashboard=False,
        configure_logging=False,
        _temp_dir=tempfile.mkdtemp(prefix="vtray-shared-", dir="/tmp"),
    )
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # until the tests close it
    ray.shutdown()


if __name__ == "__main__":
    main()
