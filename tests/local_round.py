"""One rollout-train-sync round on the one-device local cluster, shared by its CPU and GPU tests."""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Callable

from targets.api import GenerateRequest, Runtime, SamplingParams, TrainBatch, TrainingConfig, Trajectory


async def one_round(
    runtime: Runtime, config: TrainingConfig, memory: Callable[[], int] = lambda: 0
) -> tuple[int, int, int]:
    """Generates with the engine resident, suspends (trainer resident), trains, syncs, resumes and
    generates again under the new version; returns ``memory()`` with the engine awake, while
    training, and after resuming."""
    from skills.recipes.local_cluster import LocalCluster

    cluster = await LocalCluster.start(runtime, config, engine_options={"kv_tokens": 8192})
    device = cluster.devices[0]
    try:
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1)
        completions = await asyncio.gather(
            *(cluster.generate(GenerateRequest(f"e{i}", 0, [1, 2, 3], params)) for i in range(8))
        )
        assert all(c.weight_version == 0 and c.finish_reason in ("stop", "length") for c in completions)
        assert await cluster.residency() == {device.id: ["engine"]}
        awake = memory()
        await cluster.suspend()
        assert await cluster.residency() == {device.id: ["trainer"]}
        trajectories = [
            Trajectory(
                f"e{i}",
                f"g{i // 4}",
                [1, 2, 3, *c.tokens],
                [0, 0, 0] + [1] * len(c.tokens),
                [0.0, 0.0, 0.0, *c.logprobs],
                float(i % 2),
                [c.weight_version],
            )
            for i, c in enumerate(completions)
        ]
        version = await cluster.train(TrainBatch(trajectories, [1.0 if i % 2 else -1.0 for i in range(8)]), [device])
        trained = memory()
        await _exports_what_it_trained(cluster, runtime)
        await cluster.sync_weights(version, [device])
        await cluster.resume()
        assert await cluster.residency() == {device.id: ["engine"]}
        back = memory()
        again = await cluster.generate(GenerateRequest("e9", 0, [1, 2, 3], params))
        assert again.weight_version == version == 1
        return awake, trained, back
    finally:
        await cluster.close()


async def _exports_what_it_trained(cluster, runtime: Runtime) -> None:
    """The export the harness asks for after a step: into a sealed region, every weight in float32."""
    import torch

    from targets.harness.ipc.region_writer import RegionWriter, mapped
    from targets.harness.ipc.weight_export import Layout, Region
    from targets.harness.model import load_model

    layout = Layout.of(load_model(runtime.model_path, runtime.dtype).state_dict())
    region = Region(layout)
    writer = RegionWriter(mapped(os.dup(region.fd)), layout)
    try:
        await cluster.export_weights(writer)
    finally:
        writer.close()
    assert writer.written() == [slot.names[0] for slot in layout.slots]
    region.seal()
    with mmap.mmap(region.fd, layout.nbytes, prot=mmap.PROT_READ) as memory:
        flat = torch.frombuffer(bytearray(memory), dtype=torch.float32)  # a copy: torch warns of read-only buffers
    region.close()
    trained = await asyncio.to_thread(cluster.trainer.state_dict)
    for slot in layout.slots:
        start = slot.offset // 4
        got = flat[start : start + slot.numel].view(slot.shape)
        assert torch.equal(got, trained[slot.names[0]].float().cpu()), slot.names
