"""The GPU paths of the recipes, on CUDA (run with ``pytest -m gpu`` where a GPU is lent; skipped
elsewhere): the paged engine on FlashInfer in bf16 passes checks 1 and 3 within bf16 tolerances and
its CUDA-graph decode gives the eager tokens; in float32 (SDPA) it passes the CPU target's strict
tolerances; sleep gives the device memory back; the FSDP2 trainer passes check 2 on CUDA and
offloads; the local cluster time-shares one GPU; NCCL broadcast where there are two GPUs."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import multiprocessing

import pytest
import torch

from targets.api import SamplingParams
from targets.harness.judge.accuracy import (
    check_engine,
    check_trainer,
    check_weight_sync,
    fixed_prompts,
    fixed_train_batches,
)
from targets.harness.model import model_dir
from targets.spec import AccuracySpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("no_process_group_left_behind"),
]

# bf16 keeps 8 significant bits: each matmul's output is off by ~2^-9 relative, and the tiny model's
# logits (a few units) come out ~1e-2 apart from a float32 reference after its layers; greedy may
# then pick the other of two tokens closer than that. The 0.6B GPU target states the same bounds.
BF16 = AccuracySpec(logprob_atol=0.1, greedy_tie_margin=0.1, update_rtol=0.1)


@pytest.fixture
def path(tiny_spec) -> str:
    return str(model_dir(tiny_spec.model))


@pytest.fixture
def reference(tiny_model):
    return tiny_model.to("cuda")


def _engine(path: str, dtype: str = "bfloat16", **options):
    from skills.recipes.paged_engine import PagedEngine

    return PagedEngine(path, dtype, device="cuda:0", **options)


def test_flashinfer_engine_in_bf16_passes_checks_1_and_3(path, reference):
    pytest.importorskip("flashinfer")
    engine = _engine(path, attention="flashinfer")
    assert engine.attention_kind == "flashinfer"
    result = check_engine(engine, reference, BF16)
    assert result.passed, result.reasons
    result = check_weight_sync(engine, engine.load_weights, reference, BF16)
    assert result.passed, result.reasons


def test_triton_engine_in_bf16_passes_checks_1_and_3_with_its_decode_graphs(path, reference):
    """What a GPU machine without FlashInfer runs (the lent ones): Triton decode steps, captured."""
    pytest.importorskip("triton")
    engine = _engine(path, attention="triton")
    assert engine.attention_kind == "triton" and engine.graphs
    result = check_engine(engine, reference, BF16)
    assert result.passed, result.reasons
    result = check_weight_sync(engine, engine.load_weights, reference, BF16)
    assert result.passed, result.reasons


def test_triton_engine_without_the_fused_kernels_passes_checks_1_and_3(path, reference):
    """The same engine with its norms, RoPE and activation as torch ops: what ``gpu_run.py`` gives the
    check when the fused kernels fail the test above and this one passes (``engine_fallback``)."""
    pytest.importorskip("triton")
    engine = _engine(path, attention="triton", fused_kernels=False)
    assert engine.attention_kind == "triton" and engine.graphs and not engine.fused_kernels
    result = check_engine(engine, reference, BF16)
    assert result.passed, result.reasons
    result = check_weight_sync(engine, engine.load_weights, reference, BF16)
    assert result.passed, result.reasons


def test_sdpa_engine_in_bf16_passes_checks_1_and_3(path, reference):
    """The last fallback's engine as the check runs it (bf16, SDPA, no graphs, no Triton kernel): what
    ``gpu_run.py`` gives the check when both Triton engines failed their tests and this one passes."""
    engine = _engine(path, attention="sdpa", fused_kernels=False)
    assert engine.attention_kind == "sdpa" and not engine.graphs and not engine.fused_kernels
    result = check_engine(engine, reference, BF16)
    assert result.passed, result.reasons
    result = check_weight_sync(engine, engine.load_weights, reference, BF16)
    assert result.passed, result.reasons


def test_cuda_graph_decode_gives_the_eager_tokens(path):
    graphs, eager = _engine(path, max_batch=16), _engine(path, max_batch=16, cuda_graphs=False)
    assert graphs.graphs and not eager.graphs
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    prompts = fixed_prompts(12)
    a, b = graphs.generate(prompts, params), eager.generate(prompts, params)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    worst = max(abs(x - y) for ca, cb in zip(a, b) for x, y in zip(ca.logprobs, cb.logprobs))
    assert worst < 1e-2, worst


def test_float32_engine_on_cuda_passes_the_strict_checks(path, reference, tiny_spec):
    engine = _engine(path, "float32")
    assert engine.attention_kind == "sdpa"
    result = check_engine(engine, reference, tiny_spec.accuracy)
    assert result.passed, result.reasons


def test_sleep_gives_the_memory_back_and_wake_serves_the_same(path, reference):
    from skills.recipes.kv_cache import KVPool

    engine = _engine(path, kv_tokens=1 << 20)  # a KV cache large enough to see (16 MiB per 64K tokens here)
    kv_bytes = KVPool.bytes_per_token(
        engine.model.layers, engine.model.kv_heads, engine.model.head_dim, engine.dtype
    ) * (1 << 20)
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.weights.values())
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    engine.sleep(["weights", "kv_cache"])
    asleep = torch.cuda.memory_allocated()
    assert awake - asleep >= kv_bytes + weight_bytes, (awake, asleep, kv_bytes, weight_bytes)
    engine.wake(["weights"])
    engine.wake(["kv_cache"])
    assert check_engine(engine, reference, BF16).passed


def _cuda_bytes_of(trainer) -> int:
    """What the trainer's own tensors (parameters, gradients, optimizer moments) hold on the GPU, each
    storage once. Not ``memory_allocated``: the allocator also holds cuBLAS's workspace (32 MiB per
    stream on an H100, made by the trainer's first matmul), which no offload gives back; the first H100
    run failed on exactly that (offload "kept" 33,554,432 bytes)."""
    params = list(trainer.module.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [
        value
        for state in trainer.optimizer.state.values()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and key != "step"
    ]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local if t.is_cuda}
    return sum(storages.values())


def test_fsdp_trainer_on_cuda_passes_check_2_and_offloads(path, tiny_model, tiny_spec):
    from skills.recipes.fsdp_trainer import FSDPTrainer

    config = tiny_spec.workload.training.config()
    trainers = []

    def make(state, c):
        trainers.append(FSDPTrainer(path, c, "bfloat16", "cuda:0", state=state, micro_batch_tokens=128))
        return trainers[-1]

    result = check_trainer(make, copy.deepcopy(tiny_model), config, BF16)
    assert result.passed, (result.reasons, result.details)
    trainer = trainers[0]
    for other in trainers[1:]:
        other.close()
    held, allocated = _cuda_bytes_of(trainer), torch.cuda.memory_allocated()
    trainer.offload()
    assert held > 0 and _cuda_bytes_of(trainer) == 0, "offload left parameters or optimizer state on the GPU"
    assert allocated - torch.cuda.memory_allocated() >= held, "the allocator did not get the trainer's memory back"
    trainer.reload()
    trainer.train_step(fixed_train_batches(tiny_model)[0])
    assert trainer.version == 3


def test_the_local_cluster_time_shares_one_gpu(tiny_spec):
    from local_round import one_round

    from targets.harness.target import Target

    base = Target.load("tiny-qwen3-cpu").runtime()
    runtime = dataclasses.replace(base, accelerator="cuda", devices=base.devices[:1], dtype="bfloat16")
    awake, trained, back = asyncio.run(
        one_round(runtime, tiny_spec.workload.training.config(), memory=torch.cuda.memory_allocated)
    )
    assert back < awake * 1.5 and trained > 0  # after resume the trainer's copy is back on the host


def _broadcast_receiver(rendezvous: str, layouts, queue) -> None:
    from skills.recipes.weight_sync import BroadcastGroup

    torch.cuda.set_device(1)
    group = BroadcastGroup(rendezvous, 1, 2, "cuda:1")
    queue.put({k: float(v.float().sum()) for bucket in group.receive(layouts) for k, v in bucket.items()})


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_broadcast_reaches_an_engine_on_another_gpu(tiny_model):
    from skills.recipes.rendezvous import Rendezvous
    from skills.recipes.weight_sync import BroadcastGroup

    state = {k: v.to("cuda:0") for k, v in tiny_model.state_dict().items()}
    rendezvous = Rendezvous()
    layouts = BroadcastGroup.layouts(state, torch.bfloat16, 1 << 16)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    receiver = context.Process(target=_broadcast_receiver, args=(rendezvous.address, layouts, queue))
    receiver.start()
    sender = BroadcastGroup(rendezvous.address, 0, 2, "cuda:0")  # kept until the receiver has it all
    sender.send(state, torch.bfloat16, 1 << 16)
    torch.cuda.synchronize()  # NCCL's wait orders the stream only
    received = queue.get(timeout=120)
    receiver.join(timeout=60)
    del sender
    assert received == {k: float(v.to(torch.bfloat16).float().sum()) for k, v in state.items()}


def test_gpu_tensors_reach_the_export_region_exactly_through_the_staging_buffers(monkeypatch):
    """The weight export's GPU path (``region_writer.StagedCopy``): bf16 and float32 tensors, one of several
    chunks, one not contiguous, land in the region bit for bit as float32, the last chunk by the close."""
    import mmap
    import os

    from targets.harness.ipc import region_writer
    from targets.harness.ipc.weight_export import Layout, Region

    monkeypatch.setattr(region_writer, "_staging", region_writer.StagedCopy(chunk=1000))  # several chunks a tensor
    generator = torch.Generator(device="cuda").manual_seed(0)
    state = {
        "a": torch.randn(37, 91, device="cuda", generator=generator).to(torch.bfloat16),
        "b": torch.randn(3000, device="cuda", generator=generator),
        "c": torch.randn(64, 48, device="cuda", generator=generator).t(),  # not contiguous
    }
    layout = Layout.of({name: tensor.cpu() for name, tensor in state.items()})
    region = Region(layout)
    writer = region_writer.RegionWriter(region_writer.mapped(os.dup(region.fd)), layout)
    for name, tensor in state.items():
        writer.write(name, tensor)
    writer.close()
    region.seal()
    with mmap.mmap(region.fd, layout.nbytes, prot=mmap.PROT_READ) as memory:
        flat = torch.frombuffer(bytearray(memory), dtype=torch.float32)
    region.close()
    for slot in layout.slots:
        start = slot.offset // 4
        written = flat[start : start + slot.numel].view(slot.shape)
        assert torch.equal(written, state[slot.names[0]].float().cpu()), slot.names


def test_the_harness_sees_a_gpu_allocation_through_nvml():
    from targets.harness.isolation.device_memory import DeviceMemoryMonitor

    # The allocator serves what it already holds without asking the driver (NVML sees nothing): ask for
    # 1 GiB more than it holds unused, after giving back what it can.
    torch.cuda.empty_cache()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    with DeviceMemoryMonitor(1, interval_s=0.01) as monitor:
        before = dict(monitor.peaks_mb)
        block = torch.empty(cached + (1 << 30), dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        import time

        time.sleep(0.1)
        del block
    assert monitor.peaks_mb[0] - before[0] >= 1000, (before, monitor.peaks_mb)


@pytest.mark.skipif(__import__("shutil").which("bwrap") is None, reason="needs bubblewrap")
def test_a_sandboxed_candidate_sees_the_gpu_and_still_cannot_write_outside(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from targets.harness.isolation.sandbox import Sandbox

    work = tmp_path / "work"
    work.mkdir()
    outside = Path(__file__).resolve().parents[1] / "written-from-the-sandbox"
    probe = (
        "import torch, pathlib; print('cuda', torch.cuda.is_available(), torch.ones(1, device='cuda').item()); "
        f"pathlib.Path('{work}/ok').write_text('x')\n"
        f"try:\n    pathlib.Path('{outside}').write_text('x')\nexcept OSError:\n    print('refused-outside')"
    )
    command, env = Sandbox("bubblewrap").wrap(
        [sys.executable, "-c", probe], dict(os.environ), writable=[work], gpus=True
    )
    done = subprocess.run(command, capture_output=True, text=True, env=env or None, timeout=300, check=False)
    assert "cuda True 1.0" in done.stdout and "refused-outside" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert (work / "ok").exists() and not outside.exists()
