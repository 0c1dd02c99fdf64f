"""GPU placement of the Ray cluster, on CPU with Ray told it has two GPUs (it only counts them): each
device's actor (its engine, its trainer rank, or both) lands on a GPU of its own, and holds all of it:
a second actor for the same device waits."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest
import ray

from skills.recipes.ray_cluster import actor_options, placement_group_of
from targets.api import Device, Runtime, TrainingConfig, Workload


@pytest.fixture(scope="module")
def fake_gpus():
    environment = dict(os.environ)  # ray.init leaves RAY_AUTH_MODE=token behind, which later drivers would inherit
    with tempfile.TemporaryDirectory(prefix="vtray-", dir="/tmp") as folder:  # a short path: Ray's sockets
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, configure_logging=False, _temp_dir=folder)
        yield
        ray.shutdown()
    os.environ.clear()
    os.environ.update(environment)


@ray.remote
class Probe:
    """Stands in for a device's actor: reports the GPUs Ray gave it."""

    def gpus(self) -> list:
        return [str(g) for g in ray.get_gpu_ids()]


def _runtime(devices: int) -> Runtime:
    workload = Workload(
        batch_size=4,
        group_size=2,
        async_ratio=0,
        max_async_ratio=0,
        prompt_tokens=8,
        observation_tokens=8,
        response_tokens=4,
        max_sequence=32,
        training=TrainingConfig(),
    )
    return Runtime(
        "unused",
        "bfloat16",
        tuple(Device(f"gpu:{i}", "h100", i) for i in range(devices)),
        "vt_device_",
        (0,),
        workload,
        "cuda",
    )


def test_each_device_s_actor_gets_a_gpu_of_its_own_and_all_of_it(fake_gpus):
    runtime = _runtime(2)
    group = asyncio.run(placement_group_of(runtime))
    gpu0, gpu1 = runtime.devices
    device0 = Probe.options(**actor_options(runtime, gpu0, group)).remote()
    device1 = Probe.options(**actor_options(runtime, gpu1, group)).remote()
    seen = ray.get([device0.gpus.remote(), device1.gpus.remote()], timeout=60)
    assert len(seen[0]) == 1 and len(seen[1]) == 1 and seen[0] != seen[1], seen
    # device 0's GPU is held whole: a second actor for device 0 cannot be placed
    extra = Probe.options(**actor_options(runtime, gpu0, group)).remote()
    ready, _ = ray.wait([extra.gpus.remote()], timeout=3)
    assert not ready
    ray.kill(extra)
    ray.util.remove_placement_group(group)


def test_cpu_devices_are_custom_resources():
    runtime = Runtime(
        "unused", "float32", (Device("cpu:0", "cpu", 0),), "vt_device_", (0,), _runtime(1).workload, "cpu"
    )
    assert asyncio.run(placement_group_of(runtime)) is None
    assert actor_options(runtime, runtime.devices[0], None) == {"num_cpus": 0, "resources": {"vt_device_0": 1.0}}
