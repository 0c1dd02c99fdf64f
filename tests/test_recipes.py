"""Recipes against the judge's checks and their own contracts, on CPU: the paged engine passes checks
1 and 3 (also after sleep and wake, also on a MoE model), aborts one request of a running batch while
the others finish right, reuses freed KV blocks and an episode's prefix, and survives preemption;
the FSDP2 trainer passes check 2 alone and over two gloo ranks, and keeps float32 master weights
where a bf16 trainer's updates round away; weight sync buckets and the broadcast group round-trip."""

from __future__ import annotations

import asyncio
import copy
import multiprocessing
import threading
from pathlib import Path

import pytest
import torch

from skills.recipes.fsdp_trainer import FSDPTrainer
from skills.recipes.kernel_choice import choose_attention
from skills.recipes.paged_engine import PagedEngine
from skills.recipes.rendezvous import Rendezvous, connect
from skills.recipes.weight_sync import BroadcastGroup, merge, pack, to_buckets, unpack
from targets.api import SamplingParams, TrainBatch
from targets.harness.judge.accuracy import (
    check_engine,
    check_trainer,
    check_weight_sync,
    fixed_prompts,
    reference_greedy,
)
from targets.harness.model import load_model, model_dir, proxy_model
from targets.harness.reference.trainer import ReferenceTrainer
from targets.spec import AccuracySpec, load_target

pytestmark = pytest.mark.usefixtures("no_process_group_left_behind")


@pytest.fixture(scope="module")
def path(tiny_spec) -> str:
    return str(model_dir(tiny_spec.model))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


# -- the paged engine ---------------------------------------------------------------------------------


def test_paged_engine_passes_engine_and_sync_checks_also_after_sleep_and_wake(path, tiny_model, tiny_spec):
    engine = PagedEngine(path, block_size=4, kv_tokens=1024)
    assert check_engine(engine, tiny_model, tiny_spec.accuracy).passed
    result = check_weight_sync(engine, engine.load_weights, tiny_model, tiny_spec.accuracy, version=5)
    assert result.passed, result.reasons
    engine.sleep()
    assert engine.offloaded and engine.pool is None
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[3, 4]], _greedy(2))
    engine.wake(["weights"])
    engine.load_weights(tiny_model.state_dict(), version=6)  # the order a sync uses: weights, load, then the cache
    engine.wake(["kv_cache"])
    result = check_engine(engine, tiny_model, tiny_spec.accuracy)
    assert result.passed and engine.weight_version == 6, result.reasons


@pytest.mark.parametrize("speculative", [0, 2])
def test_sampled_logprobs_are_those_of_the_tempered_distribution(path, tiny_model, speculative):
    """At temperature 0.6 a token is drawn from softmax(logits / 0.6), and its logprob is that
    distribution's (``SamplingParams``): the trainer's ratio is taken of the policy that sampled. The
    engine once returned the unscaled softmax's, a ratio against another distribution than the draw's."""
    engine = PagedEngine(path, block_size=4, kv_tokens=1024, speculative_tokens=speculative)
    prompts = fixed_prompts(4)
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.6, seed=3))
    for prompt, completion in zip(prompts, completions):
        want = _logprobs_under(tiny_model, prompt, completion.tokens, 0.6)
        assert completion.logprobs == pytest.approx(want, abs=1e-4)
        assert completion.logprobs != pytest.approx(_logprobs_under(tiny_model, prompt, completion.tokens), abs=1e-3)


def test_an_engine_that_discarded_its_weights_serves_nothing_until_a_whole_version_is_loaded(
    path, tiny_model, tiny_spec
):
    """What the local cluster's suspend does (the trainer's next version is loaded on wake anyway): no
    copy out, the tensors freed, version -1; a load that leaves a tensor uninitialised is refused."""
    engine = PagedEngine(path, block_size=4, kv_tokens=1024)
    before = engine.generate([[3, 4, 5]], _greedy(6))[0].tokens
    engine.sleep(discard_weights=True)
    assert engine.weight_version == -1 and engine.weights["model.norm.weight"].numel() == 0
    engine.wake()
    with pytest.raises(RuntimeError, match="discarded at sleep"):
        engine.generate([[3, 4]], _greedy(2))
    state = tiny_model.state_dict()
    with pytest.raises(KeyError, match="model.norm.weight"):
        engine.load_weights({k: v for k, v in state.items() if k != "model.norm.weight"}, version=1)
    engine.load_weights(state, version=1)
    assert engine.generate([[3, 4, 5]], _greedy(6))[0].tokens == before
    assert check_engine(engine, tiny_model, tiny_spec.accuracy).passed


def test_a_dense_layer_computes_q_k_v_in_one_gemm_and_gate_up_in_another(path, tiny_model, tiny_spec, monkeypatch):
    """A decode step of a small model is a chain of tiny kernels (the H200's 0.6B engine: 6.8 ms an
    iteration against a 0.54 ms roofline): four GEMMs a layer, not seven, plus the head."""
    engine = PagedEngine(path, block_size=4, kv_tokens=1024)
    layers = engine.model.layers
    assert sorted(engine.store.fused) == sorted(
        f"model.layers.{i}.{name}"
        for i in range(layers)
        for name in ("self_attn.qkv_proj.weight", "self_attn.qk_norm.weight", "mlp.gate_up_proj.weight")
    )
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: calls.append(a[1].shape) or linear(*a, **k))
    request = engine.submit([3, 4, 5], _greedy(2))
    engine.step()  # the prompt
    calls.clear()
    engine.step()  # one decode step
    assert request.finish == "length" and len(calls) == 4 * layers + 1, calls
    monkeypatch.undo()
    assert check_engine(engine, tiny_model, tiny_spec.accuracy).passed


def test_fused_weights_keep_their_names_as_views_through_a_load_a_sleep_and_a_discard(path, tiny_model):
    """A load by the checkpoint's names fills the fused tensors; a sleep to host memory frees each storage
    once (the views too) and a wake brings back the same values, the names views of the new memory; a
    load after a discard must cover every part of a fused tensor."""
    from skills.recipes.engine_weights import EngineWeights
    from skills.recipes.qwen3_model import load_checkpoint

    _, weights = load_checkpoint(path, "cpu", torch.float32)
    store = EngineWeights(weights, tiny_model.config.num_hidden_layers)
    qkv, k = store.fused["model.layers.1.self_attn.qkv_proj.weight"], weights["model.layers.1.self_attn.k_proj.weight"]
    state = tiny_model.state_dict()
    for name, tensor in state.items():
        weights[name].copy_(tensor + 1)
    assert torch.equal(k, state["model.layers.1.self_attn.k_proj.weight"] + 1)
    assert torch.equal(qkv[len(weights["model.layers.1.self_attn.q_proj.weight"]) :][: len(k)], k)
    before = {name: tensor.clone() for name, tensor in weights.items()}
    store.copy_to_host(pin=False)
    store.free()
    assert all(t.numel() == 0 for t in [*weights.values(), *store.fused.values()])
    store.allocate("cpu")
    assert all(torch.equal(weights[name], tensor) for name, tensor in before.items())
    k.fill_(7.0)  # the name is a view of the new fused tensor, not a copy of it
    assert float(store.fused["model.layers.1.self_attn.qkv_proj.weight"].max()) == 7.0
    store.free()
    store.allocate("cpu")  # discarded (no host copy since the last wake): a load must cover every part
    assert store.missing_from({n: t for n, t in state.items() if n != "model.layers.1.self_attn.k_proj.weight"}) == [
        "model.layers.1.self_attn.k_proj.weight"
    ]
    assert store.missing_from(state) == []


def test_attention_is_flashinfer_only_where_it_is_installed_and_asked_for_by_name_or_fits(monkeypatch, capsys):
    """The GPU machine has no FlashInfer: its first run crashed at the engine's import of it. ``auto``
    takes the Triton decode kernel there (SDPA where Triton is missing too); naming a kind that cannot
    run is an error that says why."""
    import importlib.util

    real = importlib.util.find_spec
    installed = {"flashinfer": False, "triton": True}

    def find_spec(name):
        return (object() if installed[name] else None) if name in installed else real(name)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert choose_attention("auto", "cuda:0", torch.bfloat16) == "triton"
    with pytest.raises(ValueError, match="FlashInfer is not installed"):
        choose_attention("flashinfer", "cuda:0", torch.bfloat16)
    with pytest.raises(ValueError, match="needs a GPU device"):
        choose_attention("triton", "cpu", torch.float32)
    installed["triton"] = False
    assert choose_attention("auto", "cuda:0", torch.bfloat16) == "sdpa"
    said = capsys.readouterr().err  # a GPU falling back to SDPA (no CUDA graphs) is said, not silent
    assert "attention: torch SDPA on cuda:0, without CUDA graphs: FlashInfer is not installed and Triton" in said
    with pytest.raises(ValueError, match="Triton is not installed"):
        choose_attention("triton", "cuda:0", torch.bfloat16)
    installed["flashinfer"] = True
    assert choose_attention("auto", "cuda:0", torch.bfloat16) == "flashinfer"
    assert choose_attention("auto", "cuda:0", torch.float32) == "sdpa"
    assert choose_attention("auto", "cpu", torch.bfloat16) == "sdpa"
    with pytest.raises(ValueError, match="attention must be one of"):
        choose_attention("xformers", "cuda:0", torch.bfloat16)
    installed.update(flashinfer=False, triton=True)  # Triton's kernel wants powers of two: SDPA for 96
    assert choose_attention("auto", "cuda:0", torch.bfloat16, head_dim=96) == "sdpa"
    assert "head dim 96 or block size 16 is no power of two" in capsys.readouterr().err
    with pytest.raises(ValueError, match="power-of-two head dim"):
        choose_attention("triton", "cuda:0", torch.bfloat16, head_dim=96)


def test_fused_kernels_are_chosen_where_they_can_run_and_refused_where_not(monkeypatch):
    from skills.recipes.kernel_choice import choose_fused

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert choose_fused(None, "triton", "cuda:0", 128) and choose_fused(None, "flashinfer", "cuda:0", 128)
    assert not choose_fused(None, "sdpa", "cuda:0", 128) and not choose_fused(None, "triton", "cuda:0", 96)
    assert not choose_fused(False, "triton", "cuda:0", 128)
    with pytest.raises(ValueError, match="needs a GPU device"):
        choose_fused(True, "sdpa", "cpu", 128)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        choose_fused(True, "triton", "cuda:0", 96)


TRITON_DECODE_CHECK = """
import torch
from skills.recipes.paged_engine import PagedEngine
from skills.recipes.triton_attention import paged_decode
from targets.api import SamplingParams
from targets.harness.judge.accuracy import fixed_prompts

torch.manual_seed(0)  # the kernel against attention written out, on a scattered block table and a GQA group
blocks, size, kv_heads, dim, heads, lengths = 40, 16, 2, 64, 6, [1, 17, 50, 33]
k, v = torch.randn(blocks, size, kv_heads, dim), torch.randn(blocks, size, kv_heads, dim)
order, tables = torch.randperm(blocks).tolist(), []
for n in lengths:
    tables.append([order.pop() for _ in range((n + size - 1) // size)])
width = max(map(len, tables))
padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
q = torch.randn(len(lengths), heads, dim)
out = paged_decode(q, k, v, padded, torch.tensor(lengths, dtype=torch.int32))
worst = 0.0
for b, n in enumerate(lengths):
    rows = torch.tensor([tables[b][p // size] * size + p % size for p in range(n)])
    keys = k.view(-1, kv_heads, dim)[rows].repeat_interleave(heads // kv_heads, 1)
    values = v.view(-1, kv_heads, dim)[rows].repeat_interleave(heads // kv_heads, 1)
    weights = (torch.einsum("hd,lhd->hl", q[b], keys) * dim**-0.5).softmax(-1)
    worst = max(worst, float((torch.einsum("hl,lhd->hd", weights, values) - out[b]).abs().max()))
assert worst < 1e-5, worst

from skills.recipes import fused_ops  # the fused kernels against the torch ops they replace
from skills.recipes.qwen3_model import TorchOps

T, n, heads, kv_heads, dim = 5, 96, 4, 2, 64
h, d, w = torch.randn(T, n), torch.randn(T, n), torch.randn(n)
qk_norm, angles = torch.randn(2 * dim), torch.randn(T, dim // 2)
cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
qkv = torch.randn(2 * T, (heads + 2 * kv_heads) * dim)[::2]  # a fused projection's output, rows 2 apart
slots = torch.tensor([9, 0, 4, 17, 3])  # each token's cache row, scattered
rows = (torch.randn(20, kv_heads, dim), torch.randn(20, kv_heads, dim))  # a layer's key and value rows
caches = [tuple(t.clone() for t in rows) for _ in range(2)]
q_fused = fused_ops.rope_into_cache(qkv, qk_norm, cos, sin, 1e-6, (heads, kv_heads), (*caches[0], slots))
q_torch = TorchOps.rope_into_cache(qkv, qk_norm, cos, sin, 1e-6, (heads, kv_heads), (*caches[1], slots))
gate_up = torch.randn(T, 2 * 3000)
pairs = [
    *zip(fused_ops.add_rms_norm(h, d, w, 1e-6), TorchOps.add_rms_norm(h, d, w, 1e-6)),
    (fused_ops.add_rms_norm(h, None, w, 1e-6)[1], TorchOps.add_rms_norm(h, None, w, 1e-6)[1]),
    (q_fused, q_torch),
    *zip(caches[0], caches[1]),  # the keys and values written at the slots, the other rows untouched
    (caches[1][1][slots], qkv[:, (heads + kv_heads) * dim :].reshape(T, kv_heads, dim)),  # values as they came
    (fused_ops.silu_mul(gate_up), TorchOps.silu_mul(gate_up)),
    (TorchOps.silu_mul(gate_up), torch.nn.functional.silu(gate_up[:, :3000]) * gate_up[:, 3000:]),
]
assert all(a.shape == b.shape for a, b in pairs)
fused_worst = max(float((a - b).abs().max()) for a, b in pairs)
assert fused_worst < 1e-5, fused_worst  # float32: the interpreter rounds bf16 by truncation, a GPU to nearest

params = SamplingParams(max_new_tokens=6, temperature=0.0)
prompts = fixed_prompts(5)
engines = [PagedEngine(PATH, "float32", attention=kind, max_batch=8) for kind in ("triton", "sdpa")]
assert engines[0].attention_kind == "triton" and engines[0].fused_kernels and not engines[1].fused_kernels
a, b = (engine.generate(prompts, params) for engine in engines)
assert [c.tokens for c in a] == [c.tokens for c in b]
print("worst", worst, "logprobs", max(abs(x - y) for p, r in zip(a, b) for x, y in zip(p.logprobs, r.logprobs)))
"""


def _interpreted(script: str) -> str:
    """``script`` run by Triton's interpreter on CPU tensors (in a process of its own: the interpreter is
    chosen when Triton is imported); its output."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_triton_decode_kernel_matches_attention_and_the_engine_decodes_the_sdpa_tokens(path):
    """The decode kernel the engine takes on a GPU without FlashInfer (what the lent machines are), run
    by Triton's interpreter on CPU: the scores and values of a scattered block table; the fused norm,
    RoPE and activation kernels against the torch ops; and an engine on both greedy-decoding the
    SDPA engine's tokens with the torch ops (its prefill steps are SDPA's)."""
    assert "worst" in _interpreted(f"PATH = {path!r}\n" + TRITON_DECODE_CHECK)


def test_every_triton_kernel_launch_names_its_fp_fusion():
    """Triton 3.10 turns fused multiply-add off by default: a launch that names none would change its
    kernel's rounding on an upgrade with nothing here changed. Every ``kernel[grid](...)`` names it."""
    import ast
    import inspect

    from skills.recipes import fused_ops, triton_attention

    launches = [
        node
        for module in (fused_ops, triton_attention)
        for node in ast.walk(ast.parse(inspect.getsource(module)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)  # kernel[grid](...)
    ]
    assert len(launches) == 4, [ast.unparse(n.func) for n in launches]
    for launch in launches:
        fusion = [k for k in launch.keywords if k.arg == "enable_fp_fusion"]
        assert fusion and ast.unparse(fusion[0].value) == "FP_FUSION", ast.unparse(launch.func)


def test_every_triton_kernel_compiles_for_an_h100_without_a_gpu():
    """Triton's interpreter runs a kernel as Python, so it passes code the compiler refuses (a name an
    ``if`` reassigns with another type compiles nowhere). Each kernel the engine takes on a GPU is
    compiled here to an sm_90 cubin (H100, H200) with the 0.6B target's shapes: front end and ptxas,
    no GPU needed."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from skills.recipes import fused_ops, triton_attention
    from skills.recipes.fused_ops import FP_FUSION

    bf16, i32 = "*bf16", "i32"
    kernels = [
        (
            fused_ops._add_rms_norm,
            dict(h=bf16, delta=bf16, weight=bf16, total=bf16, out=bf16, n=i32, eps="fp32"),
            dict(HAS_DELTA=has_delta, BLOCK=1024),
        )
        for has_delta in (True, False)
    ] + [
        (
            fused_ops._rope_into_cache,
            dict(qkv=bf16, qk_norm=bf16, cos=bf16, sin=bf16, q_out=bf16, k_rows=bf16, v_rows=bf16, slots="*i64")
            | dict(stride=i32, eps="fp32"),
            dict(Q_HEADS=16, KV_HEADS=8, HALF=64),
        ),
        (fused_ops._silu_mul, dict(gate_up=bf16, out=bf16, n=i32, width=i32), dict(BLOCK=1024)),
        (
            triton_attention._paged_decode,
            dict(q=bf16, k_cache=bf16, v_cache=bf16, tables="*i32", lengths="*i32", out=bf16, scale="fp32")
            | {name: i32 for name in ("q_stride_b", "q_stride_h", "cache_stride_block", "cache_stride_pos")}
            | {name: i32 for name in ("cache_stride_h", "tables_stride_b", "out_stride_b", "out_stride_h")},
            dict(GROUP=2, GROUP_P2=2, DIM=128, BLOCK_SIZE=16, TOKENS=16),
        ),
    ]
    for kernel, arguments, constants in kernels:
        signature = arguments | dict.fromkeys(constants, "constexpr")
        source = ASTSource(kernel, signature, constants)  # with the fusion each launch names
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": FP_FUSION})
        assert compiled.asm["cubin"], kernel


GRAPHED_DECODE_CHECK = """
import torch
from skills.recipes.paged_engine import PagedEngine
from targets.api import SamplingParams
from targets.harness.judge.accuracy import fixed_prompts


class Replayed:  # a CUDA graph's stand-in: a replay runs the captured step again on the same buffers
    step = None

    def replay(self):
        self.step()


torch.cuda.graph_pool_handle, torch.cuda.synchronize, torch.cuda.CUDAGraph = (lambda: None), (lambda *a: None), Replayed
torch.cuda.graph = lambda graph, pool=None: __import__("contextlib").nullcontext()
engine = PagedEngine(PATH, "float32", attention="triton", max_batch=8, block_size=4, kv_tokens=512)
engine._graph_batch, engine.separate_prefill = 8, True  # what a GPU engine sets
engine._capture_graphs()
for graph, static, out in engine.graphs.values():
    graph.step = lambda static=static, out=out: out.copy_(
        engine.model.logits(engine.model.hidden(static["tokens"], static["positions"], engine.attention))
    )
assert sorted(engine.graphs) == [1, 2, 4, 8]

made, replays, real_tensor, real_replay, real_sample = [], [], torch.tensor, engine._replay, engine._sample
torch.tensor = lambda *a, **k: made.append(1) or real_tensor(*a, **k)
replayed = False


def counted(layout, tokens):
    global replayed
    made.clear()
    replayed = True
    return real_replay(layout, tokens)


def sampled(batch, logits):
    global replayed
    out = real_sample(batch, logits)
    if replayed:  # host tensors made in the replayed step, its draw included: each one an upload on a GPU
        replays.append(len(made))
    replayed = False
    return out


engine._replay, engine._sample = counted, sampled
params = SamplingParams(max_new_tokens=6, temperature=0.0)
prompts = fixed_prompts(5)  # five rows in the graph of eight: three padding rows on the dummy block
graphed = engine.generate(prompts, params)
sdpa = PagedEngine(PATH, "float32", attention="sdpa", max_batch=8, block_size=4, kv_tokens=512)
eager = sdpa.generate(prompts, params)
assert [c.tokens for c in graphed] == [c.tokens for c in eager]
assert len(replays) >= 5 and set(replays) == {1}, replays  # every decode step replayed, its inputs in one upload
replays.clear()  # a system run's steps: one temperature, the engine's generator; the draw sends nothing up
assert all(len(c.tokens) == 6 for c in engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0)))
assert len(replays) >= 5 and set(replays) == {1}, replays
torch.tensor = real_tensor
worst = max(abs(x - y) for p, r in zip(graphed, eager) for x, y in zip(p.logprobs, r.logprobs))
print("replays", len(replays), "logprobs", worst)
"""


def test_graphed_decode_steps_send_their_inputs_in_one_upload_and_decode_the_eager_tokens(path):
    """The decode steps a GPU engine replays from CUDA graphs, on CPU: a stand-in graph reruns the captured
    step on the buffers the graph reads, with the Triton kernels interpreted. Every decode step replays,
    padded to its graph's size on the dummy block, and makes one host tensor (one upload on a GPU, not
    five; at temperature 1 too: the draw sends nothing up), and the tokens are the eager SDPA engine's."""
    assert "replays" in _interpreted(f"PATH = {path!r}\n" + GRAPHED_DECODE_CHECK)


def test_paged_engine_runs_a_mixture_of_experts_model():
    spec = load_target("qwen3-235b-a22b-h800x160")
    moe = proxy_model(spec.model)
    reference = load_model(model_dir(moe))
    engine = PagedEngine(str(model_dir(moe)), block_size=8, kv_tokens=1024)
    result = check_engine(engine, reference, spec.accuracy)
    assert engine.model.moe and result.passed, result.reasons


def test_aborting_one_request_leaves_the_others_right(path, tiny_model):
    engine = PagedEngine(path, block_size=4, kv_tokens=2048)
    prompts = fixed_prompts(4)
    requests = [engine.submit(p, _greedy(20)) for p in prompts]
    for _ in range(5):
        engine.step()
    engine.abort(requests[1].id)
    while not all(r.finish for r in requests):
        engine.step()
    assert requests[1].finish == "abort" and 0 < len(requests[1].generated) < 20
    for i in (0, 2, 3):
        assert requests[i].finish == "length"
        assert requests[i].generated == reference_greedy(tiny_model, [prompts[i]], 20)[0].tokens, i


@pytest.mark.parametrize("separate", [False, True])
def test_separated_prefill_leaves_every_decode_step_pure_and_the_tokens_unchanged(path, tiny_model, separate):
    """Requests admitted while others decode: a mixed step runs eagerly on a GPU (no captured graph
    replays it). Separated, each step prefills or decodes, never both, decode waits at most one step,
    and the tokens are the reference's."""
    engine = PagedEngine(path, block_size=4, kv_tokens=2048, separate_prefill=separate)
    steps: list[list[int]] = []
    forward = engine._forward
    engine._forward = lambda layout, tokens, *rows: (steps.append(list(layout.new)), forward(layout, tokens, *rows))[1]
    prompts = fixed_prompts(6)
    requests = [engine.submit(p, _greedy(12)) for p in prompts[:4]]
    for _ in range(3):
        engine.step()
    requests += [engine.submit(p, _greedy(12)) for p in prompts[4:]]
    while not all(r.finish for r in requests):
        engine.step()
    mixed = [new for new in steps if max(new) > 1 and min(new) == 1]
    assert bool(mixed) is not separate, steps
    if separate:
        prefills = [i for i, new in enumerate(steps) if min(new) > 1]
        assert all(b - a > 1 for a, b in zip(prefills, prefills[1:])), steps  # a decode step between
    for prompt, request in zip(prompts, requests):
        assert request.generated == reference_greedy(tiny_model, [prompt], 12)[0].tokens


def _assert_the_references_tokens_and_logprobs(tiny_model, prompt: list[int], request, tokens: int) -> None:
    """The request's ``tokens`` greedy tokens are the reference's for ``prompt``, each logprob the reference's."""
    from targets.harness.reference.engine import next_token_logits

    assert request.generated == reference_greedy(tiny_model, [prompt], tokens)[0].tokens
    sequence = list(prompt)
    for token, logprob in zip(request.generated, request.logprobs):
        expected = next_token_logits(tiny_model, [sequence])[0].log_softmax(-1)[token]
        assert logprob == pytest.approx(float(expected), abs=1e-4)
        sequence.append(token)


@pytest.mark.parametrize("separate", [False, True])
def test_chunked_prefill_computes_prompts_in_chunks_beside_decoding_and_changes_no_token(path, tiny_model, separate):
    """With ``prefill_chunk`` a step computes at most that many prompt tokens (the rest wait for the next
    step) beside every decoding request, which gains its token each (mixed) step; a request samples only
    once its whole prompt is computed; tokens are the reference's and logprobs its own, chunked or not."""

    engine = PagedEngine(path, block_size=4, kv_tokens=2048, prefill_chunk=5, separate_prefill=separate)
    steps: list[list[int]] = []
    forward = engine._forward
    engine._forward = lambda layout, tokens, *rows: (steps.append(list(layout.new)), forward(layout, tokens, *rows))[1]
    prompts = fixed_prompts(4)
    long_prompt = prompts[3] + [(5 * i + 1) % 60 + 2 for i in range(23)]
    requests = [engine.submit(p, _greedy(12)) for p in prompts[:3]]
    while not all(len(r.generated) >= 2 for r in requests):
        engine.step()
    steps.clear()
    late = engine.submit(long_prompt, _greedy(12))
    while not all(r.finish for r in [*requests, late]):
        engine.step()
    prompt_tokens = [sum(n for n in new if n > 1) for new in steps]
    assert max(prompt_tokens) <= 5 and sum(prompt_tokens) >= len(long_prompt) - 5, steps
    chunked = [new for new in steps if any(n > 1 for n in new)]
    assert len(chunked) >= len(long_prompt) // 5, steps  # the prompt took several steps
    if not separate:  # the decoding requests take part in each of those steps
        assert all(new.count(1) == 3 for new in chunked[: len(long_prompt) // 5 - 1]), steps
    for prompt, request in zip(prompts[:3], requests):
        assert request.generated == reference_greedy(tiny_model, [prompt], 12)[0].tokens
    _assert_the_references_tokens_and_logprobs(tiny_model, long_prompt, late, 12)


def test_kv_blocks_of_finished_and_aborted_requests_are_reused(path):
    engine = PagedEngine(path, block_size=4, kv_tokens=64)  # 16 blocks
    total = engine.blocks.free_blocks
    first = engine.submit([3, 4, 5, 6, 7], _greedy(8))
    second = engine.submit([8, 9, 10], _greedy(30))
    engine.step()
    used = total - engine.blocks.free_blocks
    assert used > 0
    engine.abort(second.id)
    while not first.finish:
        engine.step()
    engine.step()
    assert engine.blocks.free_blocks == total  # every block back (no episode: no prefix kept)
    third = engine.submit([11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25], _greedy(40))
    while not third.finish:
        engine.step()
    assert third.finish == "length"  # needed blocks that the earlier requests had held


def test_the_next_turn_of_an_episode_reuses_its_prefix(path, tiny_model):
    engine = PagedEngine(path, block_size=4, kv_tokens=1024)
    prompt = fixed_prompts(1)[0] + [5, 6, 7, 8, 9, 10, 11]
    first = engine.submit(prompt, _greedy(6), episode="g0/e0")
    while not first.finish:
        engine.step()
    kept = list(engine.blocks.prefixes["g0/e0"].blocks)  # the first turn's whole blocks, kept for the episode
    assert len(kept) == (len(prompt) + 5) // 4  # its last sampled token was never computed
    following = prompt + first.generated + [12, 13, 14]
    second = engine.submit(following, _greedy(6), episode="g0/e0")
    engine._drain_control()
    engine._admit()
    assert second.blocks[: len(kept)] == kept and second.computed == 4 * len(kept)  # only the rest is prefilled
    while not second.finish:
        engine.step()
    assert second.generated == reference_greedy(tiny_model, [following], 6)[0].tokens
    # and says so (``Completion.cached_tokens``, which calibration reads): the first turn reused nothing
    assert [engine.completion(r).cached_tokens for r in (first, second)] == [0, 4 * len(kept)]


def test_a_request_that_waited_for_a_slot_says_how_long(path):
    """``Completion.queued_s`` (calibration's: a request waiting is not decoding): with one slot, the
    second request waits while the first decodes, and says so; the first waited for nothing."""
    engine = PagedEngine(path, block_size=4, kv_tokens=256, max_batch=1)
    first, second = (engine.submit(prompt, _greedy(12)) for prompt in fixed_prompts(2))
    while not first.finish:
        engine.step()
    assert not second.generated  # never admitted while the first ran
    first_ran = engine.completion(first)
    waited = engine.completion(second).queued_s  # so far
    while not second.finish:
        engine.step()
    done = engine.completion(second)
    assert first_ran.queued_s < 0.1 * waited and done.queued_s == pytest.approx(waited, rel=0.5, abs=0.05)
    assert done.queued_s > 0 and done.cached_tokens == 0


@pytest.mark.parametrize("host_kv_tokens", [0, 512])
def test_an_evicted_prefix_comes_back_from_the_host_tier_with_the_same_tokens(path, tiny_model, host_kv_tokens):
    """Another episode's turn evicts the first episode's prefix (the cache holds one context); with a
    host tier the next turn reloads it (no prefill of its blocks), without one it prefills it all
    again, and either way its tokens and logprobs are the reference's. A weight load drops the tier."""

    engine = PagedEngine(path, block_size=4, kv_tokens=48, host_kv_tokens=host_kv_tokens)
    prompt = fixed_prompts(1)[0] + [5, 6, 7, 8, 9, 10, 11]
    first = engine.submit(prompt, _greedy(6), episode="g0/e0")
    while not first.finish:
        engine.step()
    other = engine.submit([(7 * i + 3) % 60 + 2 for i in range(30)], _greedy(6), episode="g0/e1")  # needs its blocks
    while not other.finish:
        engine.step()
    assert "g0/e0" not in engine.blocks.prefixes  # evicted
    following = prompt + first.generated + [12, 13, 14]
    second = engine.submit(following, _greedy(6), episode="g0/e0")
    engine._drain_control()
    engine._admit()
    whole = 4 * ((len(prompt) + 5) // 4)  # the first turn's whole blocks
    assert second.computed == (whole if host_kv_tokens else 0)
    while not second.finish:
        engine.step()
    assert engine.completion(second).cached_tokens == (whole if host_kv_tokens else 0)  # and says so
    _assert_the_references_tokens_and_logprobs(tiny_model, following, second, 6)
    if host_kv_tokens:
        assert engine.host_kv.restored_tokens == whole and engine.host_kv.saved_tokens >= whole
        engine.load_weights({}, 1)
        assert not engine.host_kv.saved  # computed under the old weights


@pytest.mark.parametrize("host_kv_tokens", [0, 512], ids=["recomputed", "from the host tier"])
def test_a_full_cache_preempts_and_recomputes_without_changing_the_tokens(path, tiny_model, host_kv_tokens):
    """A preempted request recomputes its context when readmitted, or with a host tier reloads the whole
    blocks it had computed (saved as it left, as vLLM's KV offloading keeps them): the tokens are the
    reference's either way."""
    engine = PagedEngine(path, block_size=4, kv_tokens=96, host_kv_tokens=host_kv_tokens)  # 24 blocks, 6 x 8 wanted
    prompts, step, preempted = fixed_prompts(6), engine.step, []

    def watched_step():  # a request back in the queue with tokens decoded: one the full cache preempted
        finished = step()
        preempted.extend(r for r in engine.waiting if r.generated and r not in preempted)
        return finished

    engine.step = watched_step
    requests = [engine.submit(p, _greedy(20), episode=f"g0/e{k}") for k, p in enumerate(prompts)]
    while not all(r.finish for r in requests):
        engine.step()
    assert preempted  # the cache was full: the plant of this test acted
    for prompt, request in zip(prompts, requests, strict=True):
        assert engine.completion(request).tokens == reference_greedy(tiny_model, [prompt], 20)[0].tokens
    if host_kv_tokens:  # each preempted request came back from the host, none recomputed whole
        assert engine.host_kv.restored_tokens >= 4 * len(preempted)


def test_paged_engine_sampling_matches_its_own_logprobs(path, tiny_model):
    """Sampled tokens' logprobs equal a teacher-forced forward of the same sequence."""
    from targets.harness.reference.engine import next_token_logits

    engine = PagedEngine(path, block_size=4, kv_tokens=2048)
    prompts = fixed_prompts(6)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, stop_token_ids=(1,)))
    for prompt, completion in zip(prompts, out, strict=True):
        sequence = list(prompt)
        for token, logprob in zip(completion.tokens, completion.logprobs, strict=True):
            expected = next_token_logits(tiny_model, [sequence])[0].log_softmax(-1)[token]
            assert logprob == pytest.approx(float(expected), abs=1e-4)
            sequence.append(token)
    assert sum(len(c.tokens) for c in out) > len(out)  # tokens compared, not only a stop at once


def _repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so prompt-lookup drafts find matches from the first step."""
    return [[5, 6, 7, 8, 9] * 4 + [5, 6], [11, 12, 13] * 5 + [11], [20, 21, 22, 23] * 3 + [20, 21], [30, 31] * 6]


class _HalfWrongDrafts(PagedEngine):
    """Every other step's drafts one id off what was found: drafts the model refuses."""

    steps = 0

    def _drafts(self, batch):
        self.steps += 1
        return [[t + self.steps % 2 for t in draft] for draft in super()._drafts(batch)]


@pytest.mark.parametrize("engine_class", [PagedEngine, _HalfWrongDrafts])
def test_speculative_greedy_decoding_keeps_every_token_and_logprob(path, tiny_model, engine_class):
    """Greedy decoding with drafts gives the plain engine's tokens (and the reference's), whether the
    drafts are kept or refused: the kept drafts' keys are cached, the refused ones overwritten."""
    prompts = _repetitive_prompts()
    plain = PagedEngine(path, block_size=4, kv_tokens=2048).generate(prompts, _greedy(24))
    engine = engine_class(path, block_size=4, kv_tokens=2048, speculative_tokens=4, speculative_ngram=1)
    drafted = engine.generate(prompts, _greedy(24))
    assert engine.accepted > 0, (engine.drafted, engine.accepted)
    if engine_class is _HalfWrongDrafts:
        assert engine.drafted > engine.accepted
    for prompt, a, b in zip(prompts, plain, drafted):
        assert b.tokens == a.tokens == reference_greedy(tiny_model, [prompt], 24)[0].tokens
        assert b.finish_reason == a.finish_reason
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "temperatures, seeded",
    [([0.7], False), ([0.7, 1.3, 0.0], False), ([0.7], True)],
    ids=["one-temperature", "mixed-temperatures", "own-seed"],
)
def test_each_way_of_sampling_draws_tokens_with_the_models_probability(path, temperatures, seeded):
    """``_sample``'s three ways: every row from the engine's generator at one temperature (a system
    run's step: no upload), rows at several temperatures (greedy among them), a request with its own
    seed. Over 12,000 draws a row each way, each token's frequency is its probability at the row's
    temperature (within 4.5 standard errors), a greedy row always takes the argmax, and each
    log-probability is that of the distribution drawn from: the row's temperature's (a greedy row's, the
    unscaled one)."""
    engine = PagedEngine(path, block_size=4, kv_tokens=256)
    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(1)) * 2
    rows, calls = 400, 30
    batch = []
    for i in range(rows):
        request = type("R", (), {})()
        temperature = temperatures[i % len(temperatures)]
        request.params = SamplingParams(max_new_tokens=8, temperature=temperature)
        request.generator = torch.Generator().manual_seed(i) if seeded else None
        batch.append(request)
    counts = {t: torch.zeros(6) for t in temperatures}
    expected_logp = {t: torch.log_softmax(logits[0] / (t or 1.0), -1) for t in temperatures}
    for _ in range(calls):
        tokens, logprobs = engine._sample(batch, logits.expand(rows, -1).contiguous())
        for request, token, logprob in zip(batch, tokens, logprobs):
            counts[request.params.temperature][token] += 1
            assert logprob == pytest.approx(float(expected_logp[request.params.temperature][token]), abs=1e-5)
    for temperature, seen in counts.items():
        runs = seen.sum()
        if temperature == 0:
            assert seen[int(logits[0].argmax())] == runs
            continue
        probs = torch.softmax(logits[0] / temperature, -1)
        error = (probs * (1 - probs) / runs).sqrt()
        assert ((seen / runs - probs).abs() <= 4.5 * error + 1e-4).all(), (temperature, seen / runs, probs)


def test_speculative_sampling_draws_each_token_with_the_models_probability(path):
    """The verification's refusal-and-redraw, run 20,000 times on one distribution and a draft of two
    tokens: each first token's frequency is its probability (within 4.5 standard errors), the second
    token given the first is kept too, and a draft the model finds unlikely is mostly refused."""
    engine = PagedEngine(path, block_size=4, kv_tokens=256, speculative_tokens=2)
    request = type("R", (), {})()
    request.params, request.generator = SamplingParams(max_new_tokens=8, temperature=0.7), None
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=generator) * 2
    probs = torch.softmax(logits / 0.7, dim=-1)
    draft = [int(probs[0].argmin()), int(probs[1].argmax())]  # an unlikely first token, a likely second
    counts, runs = torch.zeros(6), 20_000
    for _ in range(runs):
        tokens, logprobs = engine._verify(request, draft, logits)
        counts[tokens[0]] += 1
        assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0] / 0.7, -1)[tokens[0]]), abs=1e-6)
    error = (probs[0] * (1 - probs[0]) / runs).sqrt()
    assert ((counts / runs - probs[0]).abs() <= 4.5 * error + 1e-4).all(), (counts / runs, probs[0])
    assert engine.accepted < 0.2 * runs and engine.drafted == 2 * runs


# -- the FSDP2 trainer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fsdp_trainer_passes_the_trainer_check_in_micro_batches_and_chunks(path, tiny_model, tiny_spec, temperature):
    """At temperature 1 and below it: the recipe's chunked logprobs are of the tempered policy, as the
    reference's (``TrainingConfig``), with a KL term on too so the reference policy's are checked as well."""
    import dataclasses

    config = dataclasses.replace(tiny_spec.workload.training.config(), temperature=temperature, kl_coef=0.1)
    result = check_trainer(
        lambda state, c: FSDPTrainer(path, c, state=state, micro_batch_tokens=64, logprob_chunk=5),
        tiny_model,
        config,
        tiny_spec.accuracy,
    )
    assert result.passed, result.reasons


def test_the_kl_term_is_judged_once_the_policy_has_left_its_anchor(path, tiny_model, tiny_spec):
    """Check 2 starts every trainer at its KL anchor, where the k3 term's gradient is exactly 0: a trainer
    that ignored the KL term passed (a review of the reference). Over four steps at a rate that moves the
    policy off the anchor, the FSDP2 trainer follows the reference's KL, and a trainer without the term or
    weighing it tenfold is rejected."""
    import dataclasses

    from targets.harness.judge.accuracy import fixed_train_batches
    from targets.harness.reference.trainer import ReferenceTrainer

    config = dataclasses.replace(tiny_spec.workload.training.config(), lr=1e-2, kl_coef=1.0)
    batches = fixed_train_batches(tiny_model, sizes=(8, 8, 8, 8))

    class Without(ReferenceTrainer):  # no KL term at all
        def __init__(self, model, config):
            super().__init__(model, dataclasses.replace(config, kl_coef=0.0))

    class Tenfold(ReferenceTrainer):  # the KL term weighed wrong
        def __init__(self, model, config):
            super().__init__(model, dataclasses.replace(config, kl_coef=10 * config.kl_coef))

    def planted(cls):
        def make(state, c):
            model = copy.deepcopy(tiny_model)
            model.load_state_dict(dict(state))
            return cls(model.float(), c)

        return make

    honest = check_trainer(
        lambda state, c: FSDPTrainer(path, c, state=state), tiny_model, config, tiny_spec.accuracy, batches
    )
    assert honest.passed, honest.reasons
    for cls in (Without, Tenfold):
        result = check_trainer(planted(cls), tiny_model, config, tiny_spec.accuracy, batches)
        assert not result.passed and "update over" in " ".join(result.reasons), (cls.__name__, result.details)


class _Streamed:
    """A trainer driven as stream training drives it: each batch's groups but the last as parts of one
    group each (``train_part``), the last group as the step itself. ``parts=False``: a trainer that
    drops its parts (what the judge must see)."""

    def __init__(self, trainer: FSDPTrainer, parts: bool = True) -> None:
        self.trainer, self.parts = trainer, parts

    @property
    def version(self) -> int:
        return self.trainer.version

    def train_step(self, batch: TrainBatch) -> int:
        groups = list(dict.fromkeys(t.group_id for t in batch.trajectories))

        def of(group: str) -> TrainBatch:
            pairs = [(t, a) for t, a in zip(batch.trajectories, batch.advantages) if t.group_id == group]
            return TrainBatch([t for t, _ in pairs], [a for _, a in pairs])

        for group in groups[:-1] if self.parts else []:
            self.trainer.train_part(of(group))
        return self.trainer.train_step(of(groups[-1]))

    def state_dict(self):
        return self.trainer.state_dict()


@pytest.mark.parametrize("parts", [True, False], ids=["streamed", "parts dropped"])
def test_a_step_trained_in_parts_is_the_reference_step_on_the_whole_batch(path, tiny_model, tiny_spec, parts):
    """Stream training's trainer: parts' gradients summed, the step's own added, the sum divided by the
    whole batch's response tokens, then clipped and stepped: the trainer check's two steps pass (two
    and three groups a batch). Dropping the parts fails it: the check sees the difference."""
    result = check_trainer(
        lambda state, c: _Streamed(FSDPTrainer(path, c, state=state, micro_batch_tokens=64), parts),
        tiny_model,
        tiny_spec.workload.training.config(),
        tiny_spec.accuracy,
    )
    assert result.passed == parts, result.reasons


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_the_trainers_own_qwen3_is_transformers_qwen3_in_names_values_and_gradients(path, family):
    """The trainer's model (no transformers import) against transformers' class on a right-padded batch:
    the same parameter names in the same order, the same hidden states and the same gradients, with
    and without activation checkpointing. The gradients are compared by norm: the MoE router's backward
    through the top-k renormalisation cancels, so a sum in another order moves elements by ~1e-4 of the
    gradient on some CPUs (a wrong sign or a dropped term moves it by its whole size)."""
    from skills.recipes.qwen3_trainable import Qwen3ForTraining

    if family == "moe":
        directory = str(model_dir(proxy_model(load_target("qwen3-235b-a22b-h800x160").model)))
        reference = load_model(directory).float()
    else:
        directory, reference = path, load_model(path).float()  # its own copy: the gradients stay here
    ours = Qwen3ForTraining.from_pretrained(directory, torch.float32)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert list(ours.state_dict()) == list(reference.state_dict())
    tokens = torch.randint(0, reference.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(tokens)
    attention[1, 9:], attention[2, 4:] = 0, 0
    valid = attention.bool()
    want = reference.model(input_ids=tokens, attention_mask=attention).last_hidden_state
    want[valid].square().sum().backward()
    for checkpointing in (False, True):
        ours.zero_grad()
        ours.checkpointing = checkpointing
        got = ours.hidden(tokens, attention)
        got[valid].square().sum().backward()
        torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-6)
        grads = dict(reference.named_parameters())
        for name, parameter in ours.named_parameters():  # summed in another order: relative to the whole gradient
            want_grad = grads[name].grad
            if want_grad is None:  # a tied head's own name, or a parameter no token reached
                assert parameter.grad is None, name
                continue
            error = ((parameter.grad - want_grad).norm() / want_grad.norm()).item()
            assert error < 1e-3, f"{name}: the gradient differs by {error:.1e} of its norm"


def _second_rank(path: str, rendezvous: str, done, streamed: bool = False) -> None:
    """Rank 1 of a two-rank trainer: the same steps on the same batches as rank 0 (run by the check),
    in parts as rank 0 takes them when ``streamed``."""
    from targets.harness.judge.accuracy import fixed_train_batches, straddling_the_clip

    spec = load_target("tiny-qwen3-cpu")
    trainer = FSDPTrainer(
        path,
        spec.workload.training.config(),
        rank=1,
        world_size=2,
        rendezvous=rendezvous,
        micro_batch_tokens=64,
    )
    stepper = _Streamed(trainer) if streamed else trainer
    model, config = load_model(model_dir(spec.model)), spec.workload.training.config()
    batches = straddling_the_clip(fixed_train_batches(model), model, config)  # as the check scales them
    for step, batch in enumerate(batches, start=1):
        stepper.train_step(batch)
        if step == 1:
            trainer.state_dict()  # a collective: rank 0's check gathers the first step's weights
    trainer.state_dict()  # and the last step's
    trainer.close()
    done.put("ok")


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_two_fsdp_ranks_over_gloo_pass_the_trainer_check(path, tiny_model, tiny_spec, streamed):
    """Also in parts: each part's gradients are reduced over the ranks as it ends, and add up."""
    rendezvous = Rendezvous()
    context = multiprocessing.get_context("spawn")
    done = context.Queue()
    other = context.Process(target=_second_rank, args=(path, rendezvous.address, done, streamed))
    other.start()

    def make(state, c):
        trainer = FSDPTrainer(
            path, c, rank=0, world_size=2, state=state, micro_batch_tokens=64, rendezvous=rendezvous.address
        )
        return _Streamed(trainer) if streamed else trainer

    try:
        result = check_trainer(
            make,
            tiny_model,
            tiny_spec.workload.training.config(),
            tiny_spec.accuracy,
        )
        assert done.get(timeout=120) == "ok"
    finally:
        other.join(timeout=60)
    assert result.passed, result.reasons


def test_ranks_meet_only_at_a_rendezvous_address(path, tiny_spec):
    """The store picks its own port (none is picked free and raced for); ranks without one, or with an
    address that is not host:port, are refused with the reason instead of waiting for each other."""
    first, second = Rendezvous(), Rendezvous()
    assert first.address != second.address and first.address.startswith("127.0.0.1:")
    with pytest.raises(ValueError, match="needs a rendezvous"):
        FSDPTrainer(path, tiny_spec.workload.training.config(), rank=0, world_size=2)
    with pytest.raises(ValueError, match="host:port"):
        connect("127.0.0.1", "trainer")


def test_bf16_master_weights_round_small_updates_away_and_float32_masters_do_not(path, tiny_spec):
    """At lr 1e-6 most of an update is below bf16's resolution at the weights' scale: a trainer that
    keeps bf16 master weights (the previous trainer did) fails check 2; the FSDP2 trainer passes."""
    bf16 = load_model(model_dir(tiny_spec.model), "bfloat16")  # not .to(): that would round the rotary inv_freq too
    config = tiny_spec.workload.training.config().__class__(lr=1e-6)
    accuracy = AccuracySpec()

    def bf16_master(state, c):
        model = load_model(model_dir(tiny_spec.model), "bfloat16")
        model.load_state_dict(state)
        return ReferenceTrainer(model, c)

    old = check_trainer(bf16_master, bf16, config, accuracy)
    assert not old.passed and old.details["relative_update_error"] > 0.5, old.details
    new = check_trainer(lambda state, c: FSDPTrainer(path, c, dtype="bfloat16", state=state), bf16, config, accuracy)
    assert new.passed, new.reasons


# -- weight sync -----------------------------------------------------------------------------------------


def test_flat_buckets_round_trip_with_their_layout(tiny_model):
    state = tiny_model.state_dict()
    buckets = to_buckets(state, 1 << 16)
    assert len(buckets) > 1 and sum(map(len, buckets)) == len(state) and list(merge(buckets)) == list(state)
    for bucket in buckets:  # each within the size, but for a tensor larger than a bucket alone
        assert len(bucket) == 1 or sum(t.numel() * t.element_size() for t in bucket.values()) <= 1 << 16
    for bucket in buckets:
        flat, layout = pack(bucket, "cpu", torch.bfloat16)
        back = unpack(flat, layout)
        assert list(back) == list(bucket)
        assert all(torch.equal(back[k], v.to(torch.bfloat16)) for k, v in bucket.items())
        assert layout == BroadcastGroup.layouts(bucket, torch.bfloat16, 1 << 16)[0]


def _receiver(rendezvous: str, layouts, queue) -> None:
    group = BroadcastGroup(rendezvous, 1, 2, "cpu")
    # as numpy (pickled by value): a tensor would go by a file descriptor this process takes with it
    queue.put({k: v.numpy().copy() for bucket in group.receive(layouts) for k, v in bucket.items()})


def test_the_broadcast_group_sends_every_bucket_to_a_receiver(tiny_model):
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    rendezvous = Rendezvous()
    layouts = BroadcastGroup.layouts(state, torch.float32, 1 << 16)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    receiver = context.Process(target=_receiver, args=(rendezvous.address, layouts, queue))
    receiver.start()
    BroadcastGroup(rendezvous.address, 0, 2, "cpu").send(state, torch.float32, 1 << 16)
    received = queue.get(timeout=60)
    receiver.join(timeout=30)
    assert set(received) == set(state) and all(torch.equal(torch.from_numpy(received[k]), state[k]) for k in state)


# -- the one-device local cluster --------------------------------------------------------------------------


def test_the_local_cluster_time_shares_one_cpu_device(tiny_spec, capsys):
    """Engine and trainer in one process on one device: train refuses while the engine is awake;
    after suspend, train, sync and resume the engine serves the new version; each switch says where
    its time went."""
    import asyncio
    import dataclasses

    from local_round import one_round

    from targets.harness.target import Target

    base = Target.load("tiny-qwen3-cpu").runtime()
    runtime = dataclasses.replace(base, devices=base.devices[:1])
    asyncio.run(one_round(runtime, tiny_spec.workload.training.config()))
    said = capsys.readouterr().err
    assert "to the trainer on cpu:0: engine asleep" in said and "trainer reloaded" in said, said
    assert "to the engine on cpu:0: optimizer out" in said and "KV cache (and decode graphs)" in said, said


def test_the_local_cluster_refuses_to_train_beside_an_awake_engine(tiny_spec):
    import asyncio
    import dataclasses

    from skills.recipes.local_cluster import LocalCluster
    from targets.api import TrainBatch, Trajectory
    from targets.harness.target import Target

    base = Target.load("tiny-qwen3-cpu").runtime()
    runtime = dataclasses.replace(base, devices=base.devices[:1])

    async def main():
        cluster = await LocalCluster.start(
            runtime, tiny_spec.workload.training.config(), engine_options={"kv_tokens": 4096}
        )
        try:
            with pytest.raises(ValueError, match="suspend it before training"):
                await cluster.train(
                    TrainBatch([Trajectory("e0", "g0", [1, 2], [0, 1], [0.0, -1.0], 1.0, [0])], [1.0]), runtime.devices
                )
            with pytest.raises(ValueError, match="suspend, train, then resume"):
                await cluster.shrink(runtime.devices)
        finally:
            await cluster.close()

    asyncio.run(main())


def test_a_trainer_that_cannot_fit_its_devices_fails_at_build_with_the_arithmetic(tmp_path, tiny_spec, path):
    """402,304 parameters x 16 bytes over 2 ranks is 3.2 MB per device: a 2 MB device cannot hold it."""
    import dataclasses
    import importlib
    import sys

    from skills.recipes.fsdp_trainer import check_fits
    from skills.recipes.qwen3_model import parameter_count
    from skills.starter import write_starter
    from targets.harness.target import Target

    assert (
        parameter_count(path) == sum(p.numel() for p in load_model(model_dir(tiny_spec.model)).parameters()) == 402_304
    )
    check_fits(path, 1, 1 << 30)  # fits a GiB
    write_starter(tmp_path / "c", tiny_spec, "colocate")
    sys.path.insert(0, str(tmp_path / "c"))
    try:
        build = importlib.import_module("stack").build
        runtime = dataclasses.replace(Target.load("tiny-qwen3-cpu").runtime(), device_memory_bytes=2_000_000)
        with pytest.raises(
            ValueError,
            match=r"0.000402B parameters x 16 bytes .* / 2 FSDP rank\(s\) = 0.003 GiB per device, "
            r"over 80% of its 0.00186 GiB; train on at least 5 devices",
        ):
            build(runtime)
    finally:
        sys.path.remove(str(tmp_path / "c"))
        sys.modules.pop("stack", None)


class _HeldCluster:
    """A cluster whose requests complete only when the test says so; it serves where it is asked."""

    def __init__(self, devices: list[str], kinds: dict[str, tuple[float, float]] | None = None) -> None:
        from targets.api import Device

        kinds = kinds or {}  # device -> (its kind's TFLOP/s, its HBM GB/s)
        self.devices = [Device(d, "cpu", i, *kinds.get(d, (0.0, 0.0))) for i, d in enumerate(devices)]
        self.pending: list[tuple[object, asyncio.Future]] = []

    async def generate(self, request):
        done = asyncio.get_running_loop().create_future()
        self.pending.append((request, done))
        return await done

    def answer(self, index: int = 0, tokens: int = 1) -> None:
        from targets.api import Completion

        request, done = self.pending.pop(index)
        done.set_result(Completion([5] * tokens, [-1.0] * tokens, "length", 0, request.device))


def _request(episode: str, turn: int, prompt_tokens: int):
    from targets.api import GenerateRequest

    return GenerateRequest(episode, turn, [1] * prompt_tokens, SamplingParams(max_new_tokens=10))


def test_the_router_admits_by_kv_longest_first_and_yields_its_sticky_engine_past_the_slack():
    from skills.recipes.router import RoutedCluster

    async def scenario():
        cluster = _HeldCluster(["cpu:0", "cpu:1"])
        router = RoutedCluster(cluster, ["cpu:0", "cpu:1"], 1, slack_tokens=0, admit_tokens=100)
        first = [asyncio.create_task(router.generate(_request(f"e{i}", 0, 80))) for i in range(2)]
        await asyncio.sleep(0)
        assert [r.device for r, _ in cluster.pending] == ["cpu:0", "cpu:1"]  # 90 tokens each: one per engine
        waiting = [asyncio.create_task(router.generate(_request(f"w{n}", 0, n))) for n in (20, 60, 40)]
        await asyncio.sleep(0)
        assert len(cluster.pending) == 2  # both engines hold 90 of their 100: all three wait
        cluster.answer(0)  # cpu:0 frees: the longest waiting request goes first, then what still fits
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [(len(r.prompt), r.device) for r, _ in cluster.pending[1:]] == [(60, "cpu:0"), (20, "cpu:0")]
        assert router.load == {"cpu:0": 100, "cpu:1": 90}
        cluster.answer(0)  # cpu:1 frees; the 40-token request has waited all along
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert (len(cluster.pending[-1][0].prompt), cluster.pending[-1][0].device) == (40, "cpu:1")
        while cluster.pending:
            cluster.answer(0)
            await asyncio.sleep(0)
        await asyncio.gather(*first, *waiting)
        # e0 served on cpu:0; with cpu:0 busier than cpu:1 by more than the slack, its next turn moves
        busy = asyncio.create_task(router.generate(_request("x", 0, 50)))
        await asyncio.sleep(0)
        assert cluster.pending[-1][0].device == "cpu:0"
        moved = asyncio.create_task(router.generate(_request("e0", 1, 30)))
        await asyncio.sleep(0)
        assert cluster.pending[-1][0].device == "cpu:1"
        while cluster.pending:
            cluster.answer(0)
            await asyncio.sleep(0)
        await asyncio.gather(busy, moved)

    asyncio.run(scenario())


def test_hardware_affinity_sends_prefill_heavy_episodes_to_compute_rich_engines_and_yields_past_the_slack():
    """The router by hand on two H20s and an H800, every answer given by the test."""
    from skills.recipes.router import RoutedCluster

    h20, h800 = (148.0, 4000.0), (989.0, 3350.0)
    devices = ["h20:0", "h20:1", "h800:0"]

    async def scenario():
        cluster = _HeldCluster(devices, {"h20:0": h20, "h20:1": h20, "h800:0": h800})
        router = RoutedCluster(cluster, devices, 1, slack_tokens=1000, admit_tokens=0, affinity_ratio=4.0)
        assert router.compute_rich == {"h800:0"}

        async def turn(episode, number, prompt, generated):
            task = asyncio.create_task(router.generate(_request(episode, number, prompt)))
            await asyncio.sleep(0)
            device = cluster.pending[-1][0].device
            cluster.answer(len(cluster.pending) - 1, generated)
            await task
            return device

        # first turns: nothing measured, least loaded first (names break ties)
        assert await turn("tool", 0, 400, 20) == "h20:0"  # 400 prompt tokens for 20 generated: prefill-heavy
        assert await turn("math", 0, 40, 200) == "h20:0"  # 40 for 200: decode-heavy
        # a prefill-heavy episode's later turns go to the compute-rich engine; a decode-heavy one has no
        # preference (decode costs about the same anywhere) and stays where its prefix is
        assert await turn("tool", 1, 820, 20) == "h800:0"  # 400 more prompt tokens: 800 for 40 generated
        assert await turn("math", 1, 250, 200) == "h20:0"
        # a compute-rich engine busier than the slack yields to the least loaded engine of any kind
        held = [asyncio.create_task(router.generate(_request(e, 0, n))) for e, n in [("a", 3000), ("b", 3000)]]
        await asyncio.sleep(0)
        busy = asyncio.create_task(router.generate(_request("c", 0, 5000)))
        await asyncio.sleep(0)
        assert [r.device for r, _ in cluster.pending] == ["h20:0", "h20:1", "h800:0"]
        moved = asyncio.create_task(router.generate(_request("tool", 2, 1240)))
        await asyncio.sleep(0)
        assert cluster.pending[-1][0].device == "h20:0"  # the H800 holds 2000 more KV than h20:0: past the slack
        while cluster.pending:
            cluster.answer(0)
            await asyncio.sleep(0)
        await asyncio.gather(*held, busy, moved)

    asyncio.run(scenario())
    # one kind of device: nothing to choose, and a ratio that would do nothing is refused by name
    with pytest.raises(ValueError, match="params affinity_ratio 4.0: the rollout devices are of one kind"):
        RoutedCluster(_HeldCluster(devices), devices, 1, 0, 0, affinity_ratio=4.0)


def test_the_paged_engine_draws_every_unseeded_row_of_a_step_in_one_call(tiny_spec, monkeypatch):
    """A Python loop of one draw per row was a kernel launch and a host sync each on a GPU: the rows that
    share the engine's generator are drawn together, once a step; a seeded request keeps its own draws."""
    import torch

    from skills.recipes.paged_engine import PagedEngine
    from targets.api import SamplingParams
    from targets.harness.model import model_dir

    engine = PagedEngine(str(model_dir(tiny_spec.model)), "float32", device="cpu", kv_tokens=4096, max_batch=8)
    calls, draw = [], torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda probs, *a, **k: calls.append(len(probs)) or draw(probs, *a, **k))
    out = engine.generate([[1, 2, 3]] * 8, SamplingParams(max_new_tokens=3, temperature=1.0))
    assert [len(c.tokens) for c in out] == [3] * 8
    assert calls and max(calls) == 8 and len(calls) <= 3  # a call a step, every row in it
    seeded = SamplingParams(max_new_tokens=3, temperature=1.0, seed=5)
    again = [engine.generate([[1, 2, 3]], seeded)[0].tokens for _ in range(2)]
    assert again[0] == again[1]  # a request's own seed still reproduces its draws


def test_micro_batches_keep_their_padded_size_within_the_budget():
    """Packed in arrival order, a long row padded every short one beside it: [10, 200, 12] in one
    micro-batch is 600 padded tokens against a budget of 400."""
    from skills.recipes.fsdp_trainer import micro_batches
    from targets.api import Trajectory

    lengths = [10, 200, 12, 190, 11, 500]
    items = [(Trajectory(f"e{i}", "g", [1] * n, [1] * n, [0.0] * n, 0.0, [0]), 0.0) for i, n in enumerate(lengths)]
    batches = micro_batches(items, 400)
    assert sorted(len(t.tokens) for b in batches for t, _ in b) == sorted(lengths)  # every row, once
    for batch in batches:
        padded = len(batch) * max(len(t.tokens) for t, _ in batch)
        assert padded <= 400 or len(batch) == 1, [len(t.tokens) for t, _ in batch]
    assert [[len(t.tokens) for t, _ in b] for b in batches] == [[500], [200, 190], [12, 11, 10]]


def test_every_parameter_a_skill_declares_or_a_recipe_reads_is_a_name_the_build_knows():
    """build.py refuses names it does not know (a misspelt technique would otherwise be silently off),
    so its list must hold every name the skills declare and every name the recipes read."""
    import re

    from skills.library import load_skills
    from skills.recipes.build import KNOWN_PARAMS

    declared = set().union(*(set(skill.params) for skill in load_skills().values()))
    read = set()
    for module in Path("skills/recipes").glob("*.py"):
        read |= set(re.findall(r'params(?:\.get\(|\[)"([a-z_]+)"', module.read_text()))
    assert read and declared <= set(KNOWN_PARAMS) and read <= set(KNOWN_PARAMS), (
        declared - set(KNOWN_PARAMS),
        read - set(KNOWN_PARAMS),
    )
    # every name no skill declares a range for has its values checked at build (and by generate --starter-param)
    from skills.recipes.build import OPTION_COUNTS, OPTION_VALUES
    from skills.recipes.kernel_choice import ATTENTION_KINDS

    checked = {*OPTION_VALUES, *OPTION_COUNTS, "kv_memory_fraction"}
    unchecked = set(KNOWN_PARAMS) - declared - checked - {"controller", "rollout_devices"}
    assert not unchecked, unchecked
    assert OPTION_VALUES["attention"] == ATTENTION_KINDS
    # build refuses a technique under a controller its skill does not run under: by its switch, off value and all
    from skills.recipes.build import CONTROLLER_TECHNIQUES

    restricted = {
        name: (skill.params[name].default, tuple(skill.controllers))
        for skill in load_skills().values()
        if skill.kind == "technique" and skill.controllers
        for name in skill.enable
    }
    assert CONTROLLER_TECHNIQUES == restricted


@pytest.mark.parametrize(
    "extra, said",
    [
        ({"kv_routng": 1}, "params.json names ['kv_routng'], which no recipe"),
        ({"bucket_bytes": 0}, 'params.get("bucket_bytes", 1 << 26) must be an int in'),  # was read as the default
        # a text "False" is truthy: the engine took it as a request for the fused kernels
        ({"fused_kernels": "False"}, 'params.json: fused_kernels must be one of null, true, false, not "False"'),
        ({"attention": "sdap"}, 'attention must be one of "auto", "flashinfer", "triton", "sdpa", not "sdap"'),
        # a technique the controller never reads was silently off
        ({"env_prestart": 1}, "params env_prestart 1: only colocate read it; under static_split it would do nothing"),
    ],
    ids=["misspelt", "zero bucket", "text for a flag", "misspelt attention", "technique of another controller"],
)
def test_a_parameter_the_build_cannot_honour_fails_it_by_name(tmp_path, tiny_spec, extra, said):
    import json
    import subprocess
    import sys

    from skills.starter import write_starter
    from targets.harness.ipc.wire import put_runtime
    from targets.harness.target import Target

    directory = write_starter(tmp_path / "stack", tiny_spec, "static_split")
    params = json.loads((directory / "stack" / "params.json").read_text())
    (directory / "stack" / "params.json").write_text(json.dumps({**params, **extra}))
    runtime = json.dumps(put_runtime(Target.load("tiny-qwen3-cpu").runtime()))
    code = (
        "import json, sys\n"
        "from targets.harness.ipc.wire import get_runtime\n"
        f"sys.path.insert(0, {str(directory)!r})\n"
        "import stack\n"
        f"stack.build(get_runtime(json.loads({runtime!r})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and said in done.stderr, done.stderr


def test_an_engine_whose_step_failed_tells_every_later_caller_instead_of_hanging(path):
    """The stepping loop ends at a failed step: the callers waiting learn why, and so do later ones
    (before, a later generate waited on a loop that was gone, and a weight load on a drain that never came)."""
    from skills.recipes.engine_server import EngineServer

    async def main() -> list[str]:
        server = EngineServer(path, "float32", "e0")
        calls = 0
        real_step = server.engine.step

        def step():
            nonlocal calls
            calls += 1
            if calls == 2:
                raise RuntimeError("planted: the kernel failed")
            return real_step()

        server.engine.step = step
        seen = []
        for call in (
            lambda: server.generate([1, 2, 3], _greedy(8)),
            lambda: server.generate([1, 2, 3], _greedy(8)),
            lambda: server.load_state({}, 1),
        ):
            with pytest.raises(RuntimeError) as raised:
                await asyncio.wait_for(call(), timeout=30)
            seen.append(f"{raised.value} / {raised.value.__cause__}")
        return seen

    first, later, load = asyncio.run(main())
    assert "planted: the kernel failed" in first
    assert "e0: the engine's step failed earlier" in later and "planted" in later
    assert "e0: the engine's step failed earlier" in load


def test_a_turn_cut_by_a_discarding_sleep_keeps_the_version_its_tokens_were_computed_under(path):
    """The local cluster's suspend discards the engine's weights (version -1): a turn it cuts mid-decode
    is answered with the tokens it had, stamped with the version they came from, not -1 (a partial
    rollout resumes it, and the audit replays it under that version)."""
    from skills.recipes.engine_server import EngineServer

    async def main():
        server = EngineServer(path, "float32", "e0")
        await server.load_state(server.engine.weights, 3)
        real_step, held, release = server.engine.step, threading.Event(), threading.Event()

        def step():  # once held, a step ends only when released: the sleep's abort then meets the engine's
            finished = real_step()  # own sleep, not a step (the path the fix is for; a step answers it right)
            if held.is_set():
                release.wait()
            return finished

        server.engine.step = step
        turn = asyncio.create_task(server.generate([1, 2, 3], _greedy(400)))
        while not server.engine.running or not server.engine.running[0].generated:
            await asyncio.sleep(0.01)
        held.set()
        await asyncio.sleep(0.1)  # a step is held now, its control drained before the abort
        sleeping = asyncio.create_task(server.sleep(discard_weights=True))
        await asyncio.sleep(0.1)  # the abort queued; the sleep waits for the step's lock
        held.clear()
        release.set()
        return await sleeping, await turn

    import asyncio
    import threading

    version, cut = asyncio.run(main())
    assert version == -1 and cut.finish_reason == "abort" and cut.tokens and cut.weight_version == 3, cut


def _logprobs_under(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> list[float]:
    """Each token's log-probability after the prompt and the tokens before it (the reference's own), at
    ``temperature``."""
    from targets.harness.reference.grpo import token_logprobs

    sequence = torch.tensor([prompt + tokens])
    with torch.no_grad():
        return token_logprobs(model, sequence, torch.ones_like(sequence), temperature)[0, len(prompt) :].tolist()


def test_a_request_preempted_while_a_load_drains_finishes_before_the_load(path, tiny_model):
    """A full cache preempts the youngest request, which recomputes its context when readmitted. One
    preempted while a weight load drains the engine has decoded under the old weights: readmitted only
    after the load, it finished under the new ones, one turn under two versions stamped with the newer
    (a host tier's run, its cache small, was rejected by the replay for it). The drain now readmits it:
    it finishes under the version it started with, and every turn's logprobs are its version's."""
    from skills.recipes.engine_server import EngineServer

    newer = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for parameter in newer.parameters():
            parameter.mul_(1.05)
    models = {0: tiny_model, 1: newer}
    prompts = fixed_prompts(6)

    async def main() -> tuple[list, int, list]:
        server = EngineServer(path, "float32", "e0", block_size=4, kv_tokens=96)  # 24 blocks, 6 requests of 8
        engine, real_step = server.engine, server.engine.step
        preempted, release, held = threading.Event(), threading.Event(), []

        def step():  # the first step after which a request that decoded waits again holds until released
            finished = real_step()
            if not preempted.is_set() and any(r.generated for r in engine.waiting):
                held.extend(r.prompt for r in engine.waiting if r.generated)
                preempted.set()
                release.wait()
            return finished

        engine.step = step
        turns = [asyncio.create_task(server.generate(p, _greedy(20))) for p in prompts]
        while not preempted.is_set():
            await asyncio.sleep(0.01)
        load = asyncio.create_task(server.load_state(newer.state_dict(), 1))
        await asyncio.sleep(0.05)  # the load has stopped admissions and waits for the held step
        release.set()
        return await asyncio.gather(*turns), await load, held

    completions, version, held = asyncio.run(main())
    assert version == 1 and held
    for prompt, completion in zip(prompts, completions):
        assert completion.finish_reason == "length" and len(completion.tokens) == 20, completion
        if prompt in held:
            assert completion.weight_version == 0, completion
        expected = _logprobs_under(models[completion.weight_version], prompt, completion.tokens)
        assert completion.logprobs == pytest.approx(expected, abs=1e-4), (completion.weight_version, completion)


def test_a_cancelled_generate_is_aborted_on_the_engine_and_gives_its_kv_back(path):
    """The harness cancels a turn whose episode was dropped (a spare, a stale group): the call's
    cancellation reaches the engine server, which aborts the request at the next step, so it stops
    decoding and its blocks are free; the engine serves on."""
    from skills.recipes.engine_server import EngineServer

    async def main():
        server = EngineServer(path, "float32", "e0", block_size=4, kv_tokens=96)
        engine = server.engine
        turn = asyncio.create_task(server.generate(fixed_prompts(1)[0], _greedy(60), "g0/e1"))
        while not any(r.generated for r in engine.running):
            await asyncio.sleep(0.005)
        (request,) = engine.running
        turn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await turn
        while engine.has_work():
            await asyncio.sleep(0.005)
        after = await server.generate(fixed_prompts(2)[1], _greedy(4), "g0/e2")
        free = engine.blocks.free_blocks + sum(len(p.blocks) for p in engine.blocks.prefixes.values())
        await server.close()
        return request, after, free, engine.blocks.num_blocks

    request, after, free, blocks = asyncio.run(main())
    assert request.finish == "abort" and 0 < len(request.generated) < 60
    assert after.finish_reason == "length" and len(after.tokens) == 4
    assert free == blocks  # nothing held but the served turn's cached prefix


def test_requests_are_admitted_in_the_clusters_order_of_arrival(path):
    """Ray may start an engine call whose prompt went through its object store after a later one: the
    engine admits by the number the cluster gave each request, not by when its call came, as the judge's
    order of service expects (targets/harness/judge/service_order.py)."""
    engine = PagedEngine(path, block_size=4, kv_tokens=256, max_batch=1)
    late = engine.submit([3, 4, 5], _greedy(2), arrival=7)
    early = engine.submit([6, 7, 8], _greedy(2), arrival=5)
    finished = []
    while not late.finish:
        finished += engine.step()
    assert finished == [early, late]
    direct = [engine.submit([9, 10], _greedy(1)) for _ in range(2)]  # no number: in the order submitted
    assert [r.arrival for r in direct] == [r.id for r in direct] and direct[0].arrival < direct[1].arrival


def test_a_draining_engine_readmits_a_preempted_request_behind_one_that_never_started(path):
    """Separating prefill, a request whose context was all cached but its last token decodes beside the
    running ones while another still waits for its prefill step: preempted together, the one that never
    started can stand first in ``waiting``. A drain that readmitted only the front waited for ever; the
    request that decoded comes back wherever it stands, and the other waits for the load."""
    engine = PagedEngine(path, block_size=4, kv_tokens=256, separate_prefill=True)
    started = engine.submit([3, 4, 5, 6, 7], _greedy(8))
    while not started.generated:
        engine.step()
    fresh = engine.submit([8, 9, 10], _greedy(8))
    engine._drain_control()
    engine.running.remove(started)  # preempted as _grow does: nothing computed, its blocks given back
    engine.blocks.release(started.blocks)
    started.blocks, started.computed = [], 0
    engine.waiting.append(started)  # behind the request that never started
    started.waits()
    assert list(engine.waiting) == [fresh, started] and engine.started
    engine.admitting = False
    for _ in range(50):  # eight tokens to decode: far fewer steps (a drain stuck at the front never ends)
        if not engine.started:
            break
        engine.step()
    assert started.finish == "length" and len(started.generated) == 8, (started, list(engine.waiting))
    assert fresh.finish is None and not fresh.generated and list(engine.waiting) == [fresh]


def test_a_weight_load_that_meets_a_sleeping_engine_keeps_its_version_for_the_wake_to_update(path):
    """A serving device given back while a sync to it waited (serving_harvest): the engine falls asleep
    first, and a Ray cluster's load of it then skips, saying the version the engine still holds, so
    the wake that lends it again loads the latest; a load nobody allowed to skip still refuses."""
    from skills.recipes.engine_server import EngineServer

    async def main() -> tuple[int, int, int, int, str]:
        server = EngineServer(path, "float32", "e0")
        state = {name: tensor.clone() for name, tensor in server.engine.weights.items()}
        await server.sleep()
        skipped = await server.load_state(state, 1, unless_asleep=True)
        with pytest.raises(RuntimeError) as refused:
            await server.load_state(state, 1)
        woken = await server.wake(["weights"])  # an expand: the weights wake, the load, then the KV cache
        loaded = await server.load_state(state, 1, unless_asleep=True)
        await server.wake(["kv_cache"])
        await server.sleep()
        await server.wake()
        again = await server.load_state(state, 2, unless_asleep=True)
        return skipped, woken, loaded, again, str(refused.value)

    skipped, woken, loaded, again, refused = asyncio.run(main())
    assert (skipped, woken, loaded, again) == (0, 0, 1, 2)
    assert "load_weights while the weights sleep" in refused


def test_a_broadcast_received_between_an_expand_s_weight_wake_and_kv_wake_is_loaded(path):
    """On GPU an engine off trainer rank 0's device gets each version by broadcast; an expand wakes its
    weights, loads, then wakes its KV cache. The receiver dropped what it got whenever any part of the
    engine slept, so an expanded engine kept its old weights; now only sleeping weights drop it. (The
    NCCL group is stood in for: what is tested is what the receiving device does with the buckets.)"""
    from types import SimpleNamespace

    from skills.recipes.ray_cluster import DeviceActor

    async def main() -> tuple[int, int]:
        actor = DeviceActor({"model_path": path, "dtype": "float32", "name": "e1"}, None)
        state = {name: tensor.clone() for name, tensor in actor.server.engine.weights.items()}
        actor._group = SimpleNamespace(rank=1, receive=lambda layouts: [state])
        await actor.server.sleep()
        await actor.broadcast([], 1, "float32", 1 << 26, False)  # weights asleep: dropped
        dropped = actor.server.engine.weight_version
        await actor.server.wake(["weights"])
        await actor.broadcast([], 2, "float32", 1 << 26, False)  # weights awake, KV cache not yet
        return dropped, actor.server.engine.weight_version

    assert asyncio.run(main()) == (0, 2)


def test_a_technique_that_would_do_nothing_on_this_target_is_refused_by_name():
    """checkpoint_level on environments that keep no state was silently 0: the stack believed it was on."""
    from skills.recipes.time_multiplex import TimeMultiplex
    from targets.harness.target import Target

    runtime = Target.load("tiny-qwen3-cpu").runtime()
    assert not runtime.workload.env_state
    with pytest.raises(ValueError, match="params checkpoint_level 1: this target's environments keep no state"):
        TimeMultiplex(runtime, {"controller": "time_multiplex", "train_devices": 1, "checkpoint_level": 1})
    TimeMultiplex(runtime, {"controller": "time_multiplex", "train_devices": 1, "checkpoint_level": 0})


def test_a_vllm_stack_s_engine_options_are_vllm_s_or_refused_never_dropped():
    from skills.recipes.build import vllm_options

    options = vllm_options({"block_size": 16, "kv_memory_fraction": 0.5, "max_batch": 64, "cuda_graphs": False}, 4096)
    assert options == {  # the paged engine's block size stays its own: vLLM's CPU backend refuses 16
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.5,
        "max_num_seqs": 64,
        "enforce_eager": True,
    }
    with pytest.raises(ValueError, match=r"params \['kv_tokens'\]: the paged engine's options"):
        vllm_options({"kv_tokens": 8192}, 4096)
    with pytest.raises(ValueError, match=r"params \['fused_kernels'\]: the paged engine's options"):
        vllm_options({"fused_kernels": False}, 4096)
    assert vllm_options({"fused_kernels": None}, 4096) == {"max_model_len": 4096}  # the default: nothing asked
    with pytest.raises(ValueError, match="speculative_tokens"):
        vllm_options({"speculative_tokens": 4}, 4096)
    with pytest.raises(ValueError, match="prefill_chunk: the paged engine's"):
        vllm_options({"prefill_chunk": 2048}, 4096)
    with pytest.raises(ValueError, match="vLLM on CPU sizes its cache by VLLM_CPU_KVCACHE_SPACE"):
        vllm_options({"kv_memory_fraction": 0.5}, 4096, cuda=False)  # it would do nothing there


def test_a_kv_cache_too_small_for_two_blocks_is_refused_not_enlarged(path):
    with pytest.raises(ValueError, match="a KV cache of 16 tokens holds fewer than two blocks of 16"):
        PagedEngine(path, "float32", kv_tokens=16, block_size=16)


def test_an_episode_done_as_the_run_ends_is_not_handed_back_twice():
    """A task's done callback (which forgets it) runs a loop turn after the task ends: a controller
    finishing in that turn had cancel_all hand back, as end_of_run, episodes already in the buffer,
    and the harness counted them twice (the exactly-once rule)."""
    from skills.recipes.env_manager import EnvManager
    from skills.recipes.sample_buffer import GroupBuffer
    from targets.api import Completion, SamplingParams, StepResult

    dropped = []

    class Episode:
        def __init__(self, n: int) -> None:
            self.episode_id, self.group_id = f"g0/e{n}", "g0"

        async def reset(self):
            return [1, 2]

        async def step(self, tokens):
            return StepResult([3], 1.0, True)

    class Envs:
        def new_group(self, extra=0, relaunch=None):
            return [Episode(0), Episode(1)]

        def drop(self, episode_id, reason, idleness=None):
            dropped.append((episode_id, reason))

    class Cluster:
        async def generate(self, request):
            return Completion([5, 6], [-0.1, -0.2], "stop", 0)

    async def run() -> GroupBuffer:
        buffer = GroupBuffer(2, 1, Envs())
        manager = EnvManager(Cluster(), Envs(), buffer, SamplingParams(4), 64)
        manager.launch(1)
        await asyncio.sleep(0)  # both episodes run to their end; their done callbacks wait for the next turn
        assert all(task.done() for task in manager._tasks)
        await manager.cancel_all()
        return buffer

    buffer = asyncio.run(run())
    assert buffer.ready_groups == 1 and dropped == []


def test_a_harvest_lends_nothing_for_a_window_after_a_give_back():
    """A real run's burst: the harvester gave its device back, then one reading whose Poisson slope was low
    lent it again into the burst (the run ended with the device lent at 12 requests/s, twice what one
    device serves within the margin). Readings the rule alone would lend on: none lends within a window."""
    from skills.recipes.serving_harvest import ServingHarvest
    from targets.api import Device, ServingLoad

    class Cluster:
        def __init__(self) -> None:
            self.t, self.calls = 0.0, []  # the calls: (when, which)

        def now(self) -> float:
            return self.t

        async def expand(self, devices) -> None:
            self.calls.append((self.t, "expand"))

        async def shrink(self, devices) -> None:
            self.calls.append((self.t, "shrink"))

    def load(rate: float) -> ServingLoad:  # one device serves 10/s; two devices, one of them lendable
        return ServingLoad(rate, 2 - len(harvest.lent), len(harvest.lent), 0.0, 0.0, 1.0, 1.0, 10.0, 10.0)

    cluster = Cluster()
    harvest = ServingHarvest(cluster, [Device(f"s{i}", "cpu", i) for i in range(2)], 1, 0.3, False)

    async def readings() -> None:
        for t, rate in [(0.0, 1.0), (1.0, 12.0), (1.5, 12.0), (2.0, 5.0), (10.9, 5.0), (11.0, 5.0)]:
            cluster.t = t
            harvest._last = None  # each reading at its face value: the slope is not what this test is about
            await harvest._adjust(load(rate))

    asyncio.run(readings())
    assert cluster.calls == [(0.0, "expand"), (1.0, "shrink"), (11.0, "expand")]


@pytest.mark.parametrize("fails", ["first reading", "a sync"])
def test_a_harvest_that_fails_is_raised_in_the_controllers_wait_not_a_hang(fails):
    """The harvester ran as a task nobody watched: a first reading of the traffic that raised left the
    episodes waiting for a first lend and the controller waiting on the buffer, forever (the error
    surfaced only at stop(), which that run never reached); a failed sync to lent engines was forgotten
    by synced() and they served an old version. Both reach the controller's wait now."""
    from skills.recipes.env_manager import EnvManager
    from skills.recipes.sample_buffer import GroupBuffer
    from skills.recipes.serving_harvest import ServingHarvest
    from targets.api import Device, SamplingParams, ServingLoad

    class Cluster:
        def now(self) -> float:
            return 0.0

        async def sleep(self, seconds: float) -> None:
            await asyncio.sleep(seconds)

        async def serving_load(self) -> ServingLoad:
            if fails == "first reading":
                raise ConnectionError("planted: the traffic could not be read")
            return ServingLoad(0.0, 2, 0, 0.0, 0.0, 1.0, 1.0, 10.0, 10.0)  # no traffic: both devices lent

        async def expand(self, devices) -> None:
            pass

        async def sync_weights(self, version, devices, interrupt=False) -> None:
            raise ConnectionError("planted: the lent engine did not load the version")

    async def run() -> None:
        devices = [Device(f"s{i}", "cpu", i) for i in range(2)]
        harvest = ServingHarvest(Cluster(), devices, 1, 0.3, False)
        buffer = GroupBuffer(2, 1, None)
        manager = EnvManager(Cluster(), None, buffer, SamplingParams(4), 64, start_after=harvest.ready)
        harvest.on_failure = manager.fail
        harvest.start()
        if fails == "a sync":
            await asyncio.wait_for(harvest.ready.wait(), 5)
            harvest.policy_advanced(1)
            await asyncio.sleep(0.01)
            with pytest.raises(ConnectionError, match="did not load"):
                await asyncio.wait_for(harvest.synced(), 5)
        with pytest.raises(RuntimeError, match="the rollout failed: ConnectionError: planted"):
            await asyncio.wait_for(buffer.wait_ready(1, 0, lambda: None, manager.raise_if_failed), 5)
        harvest._stopping = True
        harvest._task.cancel()

    asyncio.run(run())


def test_engine_trainer_and_controller_settings_that_would_fail_late_are_refused_by_name():
    """max_batch 0 admitted nothing: every generate waited while the engine's step loop spun; block_size
    0 divided by zero; logprob_chunk 0 failed at the first train step, after a whole rollout; an
    async_ratio of 1.5 passed its range check and broke launch() far from the parameter."""
    from skills.recipes.time_multiplex import TimeMultiplex
    from targets.harness.target import Target

    for option, value in (("max_batch", 0), ("block_size", 0), ("max_batch", True)):
        with pytest.raises(ValueError, match=f"engine: {option} must be an integer >= 1, not {value!r}"):
            PagedEngine("/nonexistent", name="engine", **{option: value})
    with pytest.raises(ValueError, match="trainer: logprob_chunk must be an integer >= 1, not 0"):
        FSDPTrainer("/nonexistent", None, logprob_chunk=0)
    runtime = Target.load("tiny-qwen3-cpu").runtime()
    for ratio in (1.5, True):
        with pytest.raises(ValueError, match=f"params async_ratio must be an integer within .* got {ratio!r}"):
            TimeMultiplex(runtime, {"controller": "time_multiplex", "train_devices": 1, "async_ratio": ratio})


def test_a_ray_cluster_releases_everything_when_one_actor_fails_to_close(tmp_path, monkeypatch):
    """close() awaited each actor in turn: one dead actor skipped every ray.kill and ray.shutdown, and
    the session folder the cluster's Ray made under /tmp was never removed (one a run). Every actor is
    killed, Ray shut down and the folder removed now; the failure is raised after."""
    from types import SimpleNamespace

    from skills.recipes import ray_cluster
    from targets.harness.target import Target

    killed, shut = [], []
    monkeypatch.setattr(ray_cluster.ray, "kill", killed.append)
    monkeypatch.setattr(ray_cluster.ray, "shutdown", lambda: shut.append(True))

    def actor(fails: bool):
        async def close():
            if fails:
                raise ConnectionError("planted: the actor died")

        async def counts():  # read for the cluster's log before the actors close
            return {"late": 0}

        return SimpleNamespace(close=SimpleNamespace(remote=close), counts=SimpleNamespace(remote=counts))

    runtime = Target.load("tiny-qwen3-cpu").runtime()
    d0, d1 = runtime.devices[:2]
    actors = {d0.id: actor(True), d1.id: actor(False)}
    folder = tmp_path / "vtray-session"
    (folder / "logs").mkdir(parents=True)
    cluster = ray_cluster.RayCluster(runtime, [d0], [d1], actors, 1 << 20, None, ray_folder=str(folder))
    with pytest.raises(ConnectionError, match="planted"):
        asyncio.run(cluster.close())
    assert killed == list(actors.values()) and shut == [True] and not folder.exists()


def test_a_clusters_close_closes_its_engines():
    """No cluster closed its engines: a vLLM engine's core process and its folder holding a float32
    copy of the model (tens of GB for an 8B model) outlived every run. The engine server's close ends
    its stepping loop and closes the engine; the local cluster's close (and each Ray actor's) calls it."""
    from skills.recipes.engine_server import EngineServer

    closed = []

    class Engine:  # what the server needs of an engine here
        offloaded, started, admitting = False, False, True

        def has_work(self) -> bool:
            return False

        def close(self) -> None:
            closed.append(True)

    async def run() -> asyncio.Task:
        server = EngineServer.__new__(EngineServer)  # the server's state without loading a model
        server.engine, server._stepper = Engine(), asyncio.get_running_loop().create_task(asyncio.sleep(60))
        stepper = server._stepper
        await server.close()
        return stepper

    assert asyncio.run(run()).cancelled() and closed == [True]

    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from skills.recipes.local_cluster import LocalCluster
    from skills.recipes.ray_cluster import DeviceActor

    async def server_close() -> None:
        closed.append("server")

    parts = {
        "server": SimpleNamespace(close=server_close),
        "trainer": SimpleNamespace(close=lambda: closed.append("trainer")),
    }
    local = LocalCluster.__new__(LocalCluster)
    local.server, local.trainer = parts["server"], parts["trainer"]
    actor = DeviceActor.__new__(DeviceActor)
    actor.server, actor.trainer, actor._trainer_thread = parts["server"], parts["trainer"], ThreadPoolExecutor(1)
    for cluster in (local, actor):
        closed.clear()
        asyncio.run(cluster.close())
        assert closed == ["server", "trainer"]


def test_a_load_of_the_version_an_engine_holds_leaves_it_serving():
    """A GPU broadcast reaches every engine of its group: an expand right after a sync re-sent the
    version to the engines that had just loaded it, each draining (waiting for its long-tail turns)
    and dropping its prefix cache for nothing. A load of the version an awake engine holds returns."""
    from skills.recipes.engine_server import EngineServer

    loads = []

    class Engine:
        weight_version, admitting, started = 3, True, False

        def load_weights(self, state, version) -> None:
            loads.append(version)
            self.weight_version = version

    async def run() -> tuple[int, bool]:
        server = EngineServer.__new__(EngineServer)  # the server's state without loading a model
        server.kind, server.engine, server.weights_asleep = "paged", Engine(), False
        server._lock, server._draining, server._wakeup = asyncio.Lock(), 0, asyncio.Event()
        server._failed, server._drained = None, asyncio.Event()
        same = await server.load_state({}, 3)
        admitting = server.engine.admitting
        newer = await server.load_state({}, 4)
        return same, admitting, newer

    assert asyncio.run(run()) == (3, True, 4) and loads == [4]


def test_ranks_on_a_joined_ray_cluster_reach_the_store_at_this_nodes_address(monkeypatch):
    """The store advertised 127.0.0.1 on any cluster: trainer ranks and broadcast receivers on another
    machine of a joined cluster would reach their own loopback and wait out the 30-minute timeout."""
    import ray

    from skills.recipes.ray_cluster import rendezvous_host
    from skills.recipes.rendezvous import Rendezvous, connect

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert rendezvous_host() == "127.0.0.1"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    host = rendezvous_host()
    assert host == ray.util.get_node_ip_address()
    store = Rendezvous(host)  # it listens on every interface: a client at that address reaches it
    connect(store.address, "probe").set("k", "v")


def test_an_episode_that_failed_as_the_run_ended_is_raised_not_lost():
    """cancel_all skips the tasks already done (their episodes were handed on); one of them that had
    failed, its done callback not run yet, was neither handed back nor raised."""
    from skills.recipes.env_manager import EnvManager
    from skills.recipes.sample_buffer import GroupBuffer
    from targets.api import SamplingParams

    class Episode:
        episode_id, group_id = "g0/e0", "g0"

        async def reset(self):
            raise ConnectionError("planted: the environment went away")

    class Envs:
        def new_group(self, extra=0, relaunch=None):
            return [Episode()]

        def drop(self, episode_id, reason, idleness=None):
            pass

    async def run() -> None:
        manager = EnvManager(None, Envs(), GroupBuffer(1, 1, Envs()), SamplingParams(4), 64)
        manager.launch(1)
        await asyncio.sleep(0)  # the episode failed; its done callback waits for the next turn
        await manager.cancel_all()

    with pytest.raises(RuntimeError, match="the rollout failed: ConnectionError: planted"):
        asyncio.run(run())
