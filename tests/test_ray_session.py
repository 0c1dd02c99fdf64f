"""The test session's shared Ray cluster (ray_session.py) starts its Python workers warm: each is a fork
of ray_worker_zygote.py with torch already imported, and still a Ray worker that runs actors; a worker
the warm process cannot fork starts fresh, as Ray would start it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.ray_worker_zygote import write_launcher

pytestmark = pytest.mark.slow

DRIVER = textwrap.dedent(
    """
    import json, os, sys
    import ray

    @ray.remote
    class Probe:
        def __init__(self):
            self.torch_at_start = "torch" in sys.modules  # nothing of this actor imports it

        def report(self):
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                parent = f.read().replace(b"\\0", b" ").decode()
            import torch

            threads = torch.get_num_threads()  # a fresh worker's: the OMP_NUM_THREADS Ray gives it
            return {"torch_at_start": self.torch_at_start, "parent": parent, "threads": threads, "sum": sum(range(10))}

    ray.init(configure_logging=False)
    probe = Probe.remote()  # held: an actor whose last handle goes is cancelled before it starts
    print(json.dumps(ray.get(probe.report.remote())))
    """
)


def test_an_actor_of_the_shared_cluster_runs_in_a_warm_fork(shared_ray):
    done = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["sum"] == 45 and report["threads"] == 1
    assert report["torch_at_start"] and "ray_worker_zygote.py" in report["parent"], report


def test_a_worker_the_zygote_cannot_fork_starts_fresh(tmp_path):
    launcher = write_launcher(str(tmp_path / "python"), str(tmp_path / "no-zygote.sock"))
    script = tmp_path / "default_worker.py"
    script.write_text("import sys; print('fresh', 'torch' in sys.modules, sys.argv[1:])")
    done = subprocess.run([launcher, str(script), "--x=1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "fresh False ['--x=1']"
    assert "warm worker refused, starting a fresh one" in done.stderr
    other = subprocess.run([launcher, "-c", "import os; print(os.getpid() > 0)"], capture_output=True, text=True)
    assert other.stdout.strip() == "True" and not other.stderr  # not a worker: the interpreter itself, silently
    assert os.access(launcher, os.X_OK)
