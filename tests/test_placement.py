"""GPU placement of the Ray cluster, on CPU with Ray told it has two GPUs (it only counts them): an
engine and a trainer rank that share a device land on that device's GPU, half each; actors of two
devices land on two GPUs; a third full actor does not fit a shared GPU."""

from __future__ import annotations

import asyncio
import tempfile

import pytest
import ray

from skills.recipes.ray_cluster import actor_options, placement_group_of
from targets.api import Device, Runtime, TrainingConfig, Workload


@pytest.fixture(scope="module")
def fake_gpus():
    ray.init(
        num_cpus=2,
        num_gpus=2,
        include_dashboard=False,
        configure_logging=False,
        _temp_dir=tempfile.mkdtemp(prefix="vtray-", dir="/tmp"),
    )
    yield
    ray.shutdown()


@ray.remote
class Probe:
    """Stands in for an engine or a trainer rank: reports the GPUs Ray gave it."""

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
        temperature=1.0,
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


def test_engine_and_trainer_sharing_a_device_get_its_gpu_and_other_devices_other_gpus(fake_gpus):
    runtime = _runtime(2)
    group = asyncio.run(placement_group_of(runtime))
    gpu0, gpu1 = runtime.devices
    engine0 = Probe.options(**actor_options(runtime, gpu0, True, group)).remote()
    trainer0 = Probe.options(**actor_options(runtime, gpu0, True, group)).remote()
    engine1 = Probe.options(**actor_options(runtime, gpu1, False, group)).remote()
    seen = ray.get([engine0.gpus.remote(), trainer0.gpus.remote(), engine1.gpus.remote()], timeout=60)
    assert len(seen[0]) == 1 and seen[0] == seen[1], seen
    assert len(seen[2]) == 1 and seen[2] != seen[0], seen
    # the shared GPU is full: a whole-GPU actor for device 0 cannot be placed
    extra = Probe.options(**actor_options(runtime, gpu0, False, group)).remote()
    ready, _ = ray.wait([extra.gpus.remote()], timeout=3)
    assert not ready
    ray.kill(extra)
    ray.util.remove_placement_group(group)


def test_cpu_devices_are_custom_resources():
    runtime = Runtime(
        "unused", "float32", (Device("cpu:0", "cpu", 0),), "vt_device_", (0,), _runtime(1).workload, "cpu"
    )
    assert asyncio.run(placement_group_of(runtime)) is None
    assert actor_options(runtime, runtime.devices[0], True, None) == {"num_cpus": 0, "resources": {"vt_device_0": 0.5}}
