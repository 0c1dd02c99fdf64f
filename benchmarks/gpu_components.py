"""The stack's components on one device, side by side in one run, against the device's own limits:
the paged engine's decode tokens/s vs transformers ``generate`` and as a fraction of the HBM roofline,
its prefill tokens/s, the FSDP2 trainer's step time and MFU, the in-process weight sync, sleep and
wake, and the trainer's offload and reload, each also as a fraction of a train step. Meant for the
GPU target; ``--device cpu`` runs the same code on the tiny CPU target (a smoke run: CPU numbers say
nothing about a GPU).

    python benchmarks/gpu_components.py [--target qwen3-0.6b-h100x1] [--batch 64] [--new-tokens 256] [--json F]

Decode is measured greedy and at temperature 1 (the system run samples); the train step cold (its
first call) and warm; the weight export as the harness runs it (the trainer writes a sealed region:
written, sealed, saved), each stage timed.

Roofline of a decode iteration: every running sequence's next token needs the weights read once
(shared by the batch) and its own KV read once, so tokens/s <= batch x HBM bandwidth / (weight bytes
+ the batch's KV bytes). Goals (issue "Real on a GPU"): decode >= 50% of it at batch 64; a sync of
0.6B under 0.5 s.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers_baseline import generate_greedy

from skills.recipes.fsdp_trainer import FSDPTrainer
from skills.recipes.kv_cache import KVPool
from skills.recipes.paged_engine import PagedEngine
from targets.api import SamplingParams, TrainBatch, Trajectory
from targets.hardware import HARDWARE_CATALOG, card_kind
from targets.harness.ipc.region_writer import RegionWriter, mapped
from targets.harness.ipc.weight_export import Layout, Region
from targets.harness.judge.accuracy import fixed_prompts
from targets.harness.model import load_model, model_dir
from targets.spec import HardwareSpec, load_target


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], repeat: int, device: str) -> list[float]:
    fn()  # warm-up (CUDA graphs, FlashInfer plans, allocator)
    times = []
    for _ in range(repeat):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def _graph_replay_ms(engine: PagedEngine, batch: int, replays: int = 50) -> float | None:
    """The GPU time of one captured decode step of ``batch`` rows, replayed back to back (CUDA events):
    against a whole step's time, how much of a decode iteration is kernels and how much the host's
    scheduling, uploads and sampling. None where the engine has no graph of that size."""
    if batch not in engine.graphs:
        return None
    graph = engine.graphs[batch][0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def _batch(prompts: list[list[int]], new_tokens: int) -> TrainBatch:
    """GRPO-shaped: prompt tokens masked out, response tokens with behaviour logprobs, +-1 advantages."""
    trajectories = []
    for i, prompt in enumerate(prompts):
        response = [(7 * i + j) % 50 + 1 for j in range(new_tokens)]
        trajectories.append(
            Trajectory(
                f"e{i}",
                f"g{i // 8}",
                prompt + response,
                [0] * len(prompt) + [1] * new_tokens,
                [0.0] * len(prompt) + [-2.0] * new_tokens,
                float(i % 2),
                [0],
            )
        )
    return TrainBatch(trajectories, [1.0 if i % 2 else -1.0 for i in range(len(prompts))])


def _figures(hardware: HardwareSpec) -> str:
    return f"{hardware.kind} ({hardware.hbm_bandwidth_gbs:g} GB/s, {hardware.bf16_tflops:g} TFLOP/s)"


def _card(target_hardware: HardwareSpec, device_name: str) -> tuple[HardwareSpec, str]:
    """The roofline and MFU of the card that runs, and a line saying whose figures they are: a session
    lent an H200 for the H100 target measures against the H200's 4.8 TB/s, not the H100's 3.35. The CPU,
    and a card of the target's own kind, keep the target's figures (a spec may override the catalog's).
    A card the catalog does not list (an H100 PCIe, an unknown one) is measured against the target's
    figures, and the line says so: its fractions are then of a card it is not."""
    kind = target_hardware.kind if device_name == "cpu" else card_kind(device_name)
    if kind == target_hardware.kind:
        return target_hardware, f"figures of the target's {_figures(target_hardware)}"
    if kind is None:
        note = (
            f"{device_name!r} is not in the catalog's card table (targets/hardware.py CARD_KINDS): "
            f"fractions below are of the target's {_figures(target_hardware)}, not this card's"
        )
        return target_hardware, note
    hardware = target_hardware.model_copy(update={"kind": kind, **HARDWARE_CATALOG[kind]})
    return hardware, f"figures of the catalog's {_figures(hardware)}"


def main(
    target: str = "qwen3-0.6b-h100x1",
    device: str = "cuda:0",
    batch: int = 64,
    prompt_tokens: int = 128,
    new_tokens: int = 256,
    train_batch: int = 32,
    repeat: int = 3,
    json_path: Path = typer.Option(None, "--json", help="also write every figure here"),
    fused_kernels: bool = typer.Option(True, help="off: the engine's torch ops only (gpu_run.py's fallback)"),
    attention: str = typer.Option("auto", help="the paged engine's attention kernel (sdpa: gpu_run.py's fallback)"),
) -> None:
    spec = load_target(target)
    device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    hardware, figures_of = _card(spec.hardware, device_name)
    path = str(model_dir(spec.model))
    dtype = spec.model.dtype
    console = Console()
    prompts = [(p * prompt_tokens)[:prompt_tokens] for p in fixed_prompts(batch)]  # equal lengths: no padding for HF
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)  # no stop tokens: exactly new_tokens each

    console.print(f"[bold]{target}[/bold] on {device} ({device_name}); roofline and MFU: {figures_of}")

    def paged_engine(fused: bool | None) -> PagedEngine:
        kv_tokens = batch * (prompt_tokens + new_tokens) * 2
        options = {"max_batch": batch, "attention": attention, "fused_kernels": fused}
        return PagedEngine(path, dtype, device=device, kv_tokens=kv_tokens, **options)

    engine = paged_engine(None if fused_kernels else False)  # None: where the attention kernel is a GPU one
    parameters = sum(
        t.numel()
        for name, t in engine.weights.items()
        if name != "lm_head.weight" or not spec.model.config.tie_word_embeddings
    )
    weight_bytes = parameters * torch.empty(0, dtype=engine.dtype).element_size()
    figures: dict = {
        "target": target,
        "device": device_name,
        "parameters": parameters,
        "attention": engine.attention_kind,
        "graphs": sorted(engine.graphs),
        "fused_kernels": engine.fused_kernels,
        "card_hbm_gbs": hardware.hbm_bandwidth_gbs,
        "card_bf16_tflops": hardware.bf16_tflops,
        "card_figures": figures_of,
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "repeat": repeat,
    }

    def record(**measured: object) -> None:
        """Each section's figures as soon as it has them: a run cut at its time limit keeps what it did."""
        figures.update(measured)
        console.log(", ".join(f"{k} {_short(v)}" for k, v in measured.items()))
        if json_path is not None:
            json_path.write_text(json.dumps(figures, indent=1))

    kv_per_token = KVPool.bytes_per_token(
        engine.model.layers, engine.model.kv_heads, engine.model.head_dim, engine.dtype
    )

    def decode() -> None:
        out = engine.generate(prompts, greedy)
        assert all(len(c.tokens) == new_tokens for c in out)

    sampled = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)  # as a system run decodes

    def decode_sampled() -> None:
        out = engine.generate(prompts, sampled)
        assert all(len(c.tokens) == new_tokens for c in out)

    prefill_params = SamplingParams(max_new_tokens=1, temperature=0.0)
    console.log(
        f"paged engine ({engine.attention_kind} attention, {len(engine.graphs)} decode graphs): decode, then prefill"
    )
    engine_times = _timed(decode, repeat, device)
    record(decode_greedy_run_s=engine_times)
    sampled_times = _timed(decode_sampled, repeat, device)
    record(decode_sampled_run_s=sampled_times)
    prefill_times = _timed(lambda: engine.generate(prompts, prefill_params), repeat, device)
    record(prefill_run_s=prefill_times)
    graph_ms = _graph_replay_ms(engine, batch)
    if graph_ms is not None:
        record(decode_graph_replay_ms=graph_ms)
    decode_s = statistics.median(engine_times) - statistics.median(prefill_times)  # the decode iterations alone
    mean_context = prompt_tokens + new_tokens / 2
    roofline = batch * hardware.hbm_bandwidth_gbs * 1e9 / (weight_bytes + batch * mean_context * kv_per_token)
    decode_rate = batch * (new_tokens - 1) / decode_s
    sampled_decode_s = statistics.median(sampled_times) - statistics.median(prefill_times)
    sampled_rate = batch * (new_tokens - 1) / sampled_decode_s

    record(  # the decode figures, as soon as they are known (a run cut short keeps them)
        decode_greedy_tok_s=decode_rate,
        decode_sampled_tok_s=sampled_rate,
        roofline_tok_s=roofline,
        decode_greedy_of_roofline=decode_rate / roofline,
        decode_sampled_of_roofline=sampled_rate / roofline,
        prefill_tok_s=batch * prompt_tokens / statistics.median(prefill_times),
    )
    console.log("sleep and wake")
    # sleep and wake, then the trainer beside the sleeping engine (as the local cluster runs them)
    sleep_times, wake_times, wake_kv_times = [], [], []
    for _ in range(repeat + 1):  # the first makes the pinned buffers the others reuse
        _synchronize(device)
        start = time.perf_counter()
        engine.sleep(["weights", "kv_cache"])
        _synchronize(device)
        sleep_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.wake(["weights"])
        _synchronize(device)
        woken = time.perf_counter()
        engine.wake(["kv_cache"])  # the cache made again, and the decode graphs captured over it
        _synchronize(device)
        wake_times.append(time.perf_counter() - start)
        wake_kv_times.append(time.perf_counter() - woken)
    engine.sleep(["weights", "kv_cache"])
    sleep_first_s, _, _ = sleep_times.pop(0), wake_times.pop(0), wake_kv_times.pop(0)
    record(sleep_first_s=sleep_first_s, sleep_s=sleep_times, wake_s=wake_times)
    record(wake_kv_cache_and_graphs_s=wake_kv_times)

    console.log("FSDP2 train step")
    trainer = FSDPTrainer(path, spec.workload.training.config(), dtype, device, micro_batch_tokens=8192)
    train_data = _batch(prompts[:train_batch], new_tokens)
    _synchronize(device)
    started = time.perf_counter()
    trainer.train_step(train_data)  # cold: the first step (allocations, kernel selection)
    _synchronize(device)
    cold_s = time.perf_counter() - started
    record(train_step_cold_s=cold_s)
    train_times = _timed(lambda: trainer.train_step(train_data), repeat, device)
    tokens = sum(len(t.tokens) for t in train_data.trajectories)
    train_s = statistics.median(train_times)
    checkpointing = device.startswith("cuda")  # one more forward per layer in the backward
    flops = (8 if checkpointing else 6) * parameters * tokens
    mfu = flops / train_s / (hardware.bf16_tflops * 1e12)

    engine.wake(["weights"])

    def sync() -> None:
        engine.load_weights(trainer.device_state(), trainer.version)

    console.log("weight sync")
    sync_times = _timed(sync, repeat, device)
    record(train_step_s=train_times, train_tokens=tokens, mfu=mfu, sync_s=sync_times)
    console.log("weight export, as the harness takes it")
    export = _export_stages(trainer, path, dtype, repeat)
    record(export_s=export)
    console.log("trainer offload and reload, as a switch on one device runs them")
    offload_times, reload_times = [], []
    for _ in range(repeat + 1):  # the first pins the host memory the others reuse
        _synchronize(device)
        start = time.perf_counter()
        trainer.offload(("optimizer",))
        trainer.offload(("params",))
        offloaded = time.perf_counter()
        trainer.reload()
        reloaded = time.perf_counter()
        offload_times.append(offloaded - start)
        reload_times.append(reloaded - offloaded)
    record(
        trainer_offload_first_s=offload_times[0],
        trainer_offload_s=offload_times[1:],
        trainer_reload_s=reload_times[1:],
    )
    trainer.close()
    trainer = None  # its memory back before the comparisons below

    unfused_times: list[float] = []
    if engine.fused_kernels:  # the same decode in torch ops, measured beside: what the fused kernels bought
        console.log("the same engine with the torch ops (fused_kernels=False)")
        unfused = paged_engine(False)
        unfused_times = _timed(lambda: unfused.generate(prompts, greedy), repeat, device)
        record(decode_unfused_run_s=unfused_times)
        unfused = None

    console.log("transformers generate")
    reference = load_model(model_dir(spec.model), dtype).to(device)
    input_ids = torch.tensor(prompts, device=device)

    def hf_generate() -> None:
        generate_greedy(reference, input_ids, new_tokens)

    hf_times = _timed(hf_generate, repeat, device)
    record(transformers_run_s=hf_times)
    reference = None

    table = Table(
        title=f"{target}: {parameters / 1e9:.3g}B parameters, {dtype}; decode batch {batch} x {new_tokens} new tokens "
        f"after {prompt_tokens}; train batch {train_batch}; {repeat} repeats (median, spread)"
    )
    for column in ("what", "median", "spread", "figure", "vs"):
        table.add_column(column, justify="right")

    def spread(times: list[float]) -> str:
        return f"{max(times) - min(times):.3f} s"

    hf_rate = batch * new_tokens / statistics.median(hf_times)
    engine_rate = batch * new_tokens / statistics.median(engine_times)
    table.add_row(
        "transformers generate",
        f"{statistics.median(hf_times):.3f} s",
        spread(hf_times),
        f"{hf_rate:,.0f} tok/s",
        "1.00x",
    )
    table.add_row(
        "paged engine, whole run",
        f"{statistics.median(engine_times):.3f} s",
        spread(engine_times),
        f"{engine_rate:,.0f} tok/s",
        f"{engine_rate / hf_rate:.2f}x transformers",
    )
    table.add_row(
        "paged engine, decode only",
        f"{decode_s:.3f} s",
        "-",
        f"{decode_rate:,.0f} tok/s",
        f"{decode_rate / roofline:.0%} of roofline {roofline:,.0f} tok/s",
    )
    if graph_ms is not None:
        step_ms = decode_s / (new_tokens - 1) * 1e3
        table.add_row(
            f"one decode step's graph alone (batch {batch})",
            f"{graph_ms:.3f} ms",
            "-",
            f"a step: {step_ms:.3f} ms",
            f"{graph_ms / step_ms:.0%} of a step on the GPU, the rest the host's",
        )
    if unfused_times:
        unfused_s = statistics.median(unfused_times) - statistics.median(prefill_times)
        table.add_row(
            "decode only, torch ops (unfused)",
            f"{unfused_s:.3f} s",
            "-",
            f"{batch * (new_tokens - 1) / unfused_s:,.0f} tok/s",
            f"fused: {unfused_s / decode_s:.2f}x faster",
        )
    prefill_s = statistics.median(prefill_times)
    table.add_row(
        "prefill", f"{prefill_s:.3f} s", spread(prefill_times), f"{batch * prompt_tokens / prefill_s:,.0f} tok/s", ""
    )
    table.add_row(
        "train step",
        f"{train_s:.3f} s",
        spread(train_times),
        f"{tokens:,} tokens",
        f"MFU {mfu:.1%} of {hardware.bf16_tflops:g} TFLOP/s",
    )
    for name, times in (
        ("weight sync (in place)", sync_times),
        ("sleep (weights + KV)", sleep_times),
        ("wake: the KV cache and the decode graphs", wake_kv_times),
        ("wake", wake_times),
        ("trainer offload (optimizer, then parameters)", offload_times[1:]),
        ("trainer reload", reload_times[1:]),
    ):
        median = statistics.median(times)
        table.add_row(name, f"{median:.3f} s", spread(times), "", f"{median / train_s:.0%} of a train step")
    table.add_row(
        "paged engine, decode at temperature 1",
        f"{sampled_decode_s:.3f} s",
        "-",
        f"{sampled_rate:,.0f} tok/s",
        f"{sampled_rate / roofline:.0%} of roofline",
    )
    table.add_row("train step, cold (the first)", f"{cold_s:.3f} s", "-", "", f"{cold_s / train_s:.1f}x a warm one")
    table.add_row("sleep, the first", f"{sleep_first_s:.3f} s", "-", "", "its host memory pinned then")
    table.add_row("trainer offload, the first", f"{offload_times[0]:.3f} s", "-", "", "its host memory pinned then")
    for stage, times in export.items():
        table.add_row(f"weight export: {stage}", f"{statistics.median(times):.3f} s", spread(times), "", "")
    console.print(table)
    record(transformers_tok_s=hf_rate)


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)


def _export_stages(trainer: FSDPTrainer, path: str, dtype: str, repeat: int) -> dict[str, list[float]]:
    """The harness's export of the trainer's weights, stage by stage, as a system run takes it: the
    cluster maps the region the harness handed over ahead (its pages faulted in while the step trains),
    writes it after the step (through the pinned staging buffers) and unmaps it, the harness seals it
    (the train call is answered here), then saves it in the background."""
    layout = Layout.of(load_model(Path(path), dtype).state_dict())
    stages: dict[str, list[float]] = {
        "map (ahead, while the step trains)": [],
        "write (on the train call)": [],
        "seal": [],
        "save (in the background)": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(repeat + 1):
            region = Region(layout)
            started = time.perf_counter()
            memory = mapped(os.dup(region.fd))
            ready = time.perf_counter()
            writer = RegionWriter(memory, layout)
            trainer.export_to(writer)
            writer.close()
            written = time.perf_counter()
            region.seal()
            sealed = time.perf_counter()
            region.save(Path(scratch) / f"v{i}.safetensors")
            saved = time.perf_counter()
            region.close()
            if i:  # the first makes the process's pinned staging buffers
                stages["map (ahead, while the step trains)"].append(ready - started)
                stages["write (on the train call)"].append(written - ready)
                stages["seal"].append(sealed - written)
                stages["save (in the background)"].append(saved - sealed)
    return stages


if __name__ == "__main__":
    typer.run(main)
