"""The decoder layer's elementwise work in three Triton kernels instead of ~50 torch ops: a residual
add fused with the RMSNorm after it; the per-head q/k norms and RoPE read straight from the fused
q/k/v projection's output, with the keys and values written into the KV cache in the same kernel; and
SiLU(gate) * up (from the fused gate/up projection's).

Why: a decode step of a small model is a chain of tiny kernels, and on the H200 each costs the GPU a
few microseconds whatever its size: the 0.6B engine's ~55 kernels a layer (28 layers) in CUDA graphs
took 6.8 ms an iteration against a 0.54 ms roofline. With these and the fused projections
(``engine_weights.py``), a layer is 9 kernels: 4 GEMMs, the attention, and four of these (the norm twice).

Each kernel rounds where the torch ops it replaces round (every op's output is in the model's dtype;
RMSNorm computes in float32, as transformers' Qwen3 does), so the fused model gives the unfused one's
numbers up to float32 summation order. Triton's interpreter (``TRITON_INTERPRET=1``) runs them on CPU
tensors, which is how the tests compare them with the torch ops on a machine with no GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Fused multiply-add in every kernel, as every GPU figure was measured with, named at each launch: Triton
# 3.10 turns its default off, which would change the kernels' rounding with nothing here changed.
FP_FUSION = True


@triton.jit
def _add_rms_norm(
    h,  # [rows, n]: the residual stream
    delta,  # [rows, n]: what is added to it first (HAS_DELTA)
    weight,  # [n]
    total,  # [rows, n]: h + delta, written (HAS_DELTA)
    out,  # [rows, n]: the norm of h (+ delta), scaled by weight
    n,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(h + row * n + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(delta + row * n + cols, mask=inside, other=0.0).to(tl.float32)
        x = x.to(total.dtype.element_ty)  # rounded as the torch add's output is
        tl.store(total + row * n + cols, x, mask=inside)
        x = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * scale).to(out.dtype.element_ty).to(tl.float32)
    w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + row * n + cols, (w * normed).to(out.dtype.element_ty), mask=inside)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, rms_norm(h + delta) * weight)``; with no ``delta``, ``(h, rms_norm(h) * weight)``."""
    n = h.shape[-1]
    if not h.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        raise ValueError("add_rms_norm needs contiguous rows")
    total = torch.empty_like(h) if delta is not None else h
    out = torch.empty_like(h)
    block = triton.next_power_of_2(n)
    _add_rms_norm[(h.numel() // n,)](
        h,
        delta if delta is not None else h,
        weight,
        total,
        out,
        n,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),  # a row of 8K in 4 warps spills registers (Triton's layer-norm rule)
        enable_fp_fusion=FP_FUSION,
    )
    return total, out


@triton.jit
def _rope_into_cache(
    qkv,  # [tokens, (q_heads + 2 * kv_heads) * dim]: the fused projection's output, tokens ``stride`` apart
    qk_norm,  # [2 * dim]: the q norm's weights, then the k norm's
    cos,  # [tokens, dim]
    sin,
    q_out,  # [tokens, q_heads, dim], contiguous
    k_rows,  # [slots, kv_heads, dim], contiguous (the layer's key cache)
    v_rows,
    slots,  # [tokens] int64: each token's row
    stride,
    eps,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # dim // 2
):
    program = tl.program_id(0).to(tl.int64)  # one (token, head) of q's, k's and v's heads in a row
    token = program // (Q_HEADS + 2 * KV_HEADS)
    head = program - token * (Q_HEADS + 2 * KV_HEADS)
    cols = tl.arange(0, HALF)
    at = qkv + token * stride + head * 2 * HALF
    loaded_first = tl.load(at + cols)
    loaded_second = tl.load(at + HALF + cols)
    kind = q_out.dtype.element_ty
    # (no name assigned before an ``if`` is assigned again in it: Triton yields such names out of the
    # branches and refuses them where the branches' types differ)
    if head >= Q_HEADS + KV_HEADS:  # a value head: into the cache as it is
        row = (
            v_rows + tl.load(slots + token).to(tl.int64) * KV_HEADS * 2 * HALF + (head - Q_HEADS - KV_HEADS) * 2 * HALF
        )
        tl.store(row + cols, loaded_first)
        tl.store(row + HALF + cols, loaded_second)
    else:
        first = loaded_first.to(tl.float32)
        second = loaded_second.to(tl.float32)
        scale = tl.rsqrt((tl.sum(first * first, axis=0) + tl.sum(second * second, axis=0)) / (2 * HALF) + eps)
        weight = qk_norm + (head >= Q_HEADS).to(tl.int64) * 2 * HALF
        w1 = tl.load(weight + cols).to(tl.float32)
        w2 = tl.load(weight + HALF + cols).to(tl.float32)
        first = (w1 * (first * scale).to(kind).to(tl.float32)).to(kind).to(tl.float32)
        second = (w2 * (second * scale).to(kind).to(tl.float32)).to(kind).to(tl.float32)
        c1 = tl.load(cos + token * 2 * HALF + cols).to(tl.float32)
        c2 = tl.load(cos + token * 2 * HALF + HALF + cols).to(tl.float32)
        s1 = tl.load(sin + token * 2 * HALF + cols).to(tl.float32)
        s2 = tl.load(sin + token * 2 * HALF + HALF + cols).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-second, first); each product rounded, then the sum
        low = ((first * c1).to(kind).to(tl.float32) + (-second * s1).to(kind).to(tl.float32)).to(kind)
        high = ((second * c2).to(kind).to(tl.float32) + (first * s2).to(kind).to(tl.float32)).to(kind)
        if head < Q_HEADS:
            row = q_out + (token * Q_HEADS + head) * 2 * HALF
        else:
            row = k_rows + tl.load(slots + token).to(tl.int64) * KV_HEADS * 2 * HALF + (head - Q_HEADS) * 2 * HALF
        tl.store(row + cols, low)
        tl.store(row + HALF + cols, high)


def rope_into_cache(
    qkv: torch.Tensor,
    qk_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    heads: tuple[int, int],
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """``TorchOps.rope_into_cache`` in one kernel: the queries normed and rotated into a new tensor, the
    keys normed, rotated and the values copied into the cache's rows at the step's slots."""
    (q_heads, kv_heads), (k_rows, v_rows, slots) = heads, cache
    tokens, dim = qkv.shape[0], k_rows.shape[-1]
    if dim % 2 or dim & (dim - 1) or qkv.stride(1) != 1 or qkv.shape[1] != (q_heads + 2 * kv_heads) * dim:
        raise ValueError(f"rope_into_cache needs rows of q, k and v heads of a power-of-two dim, not {dim}")
    if not (k_rows.is_contiguous() and v_rows.is_contiguous()) or slots.dtype != torch.long:
        raise ValueError("rope_into_cache needs contiguous cache rows and int64 slots")
    q = torch.empty((tokens, q_heads, dim), dtype=qkv.dtype, device=qkv.device)
    _rope_into_cache[(tokens * (q_heads + 2 * kv_heads),)](
        qkv,
        qk_norm,
        cos.contiguous(),
        sin.contiguous(),
        q,
        k_rows,
        v_rows,
        slots,
        qkv.stride(0),
        eps,
        Q_HEADS=q_heads,
        KV_HEADS=kv_heads,
        HALF=dim // 2,
        enable_fp_fusion=FP_FUSION,
    )
    return q


@triton.jit
def _silu_mul(gate_up, out, n, width, BLOCK: tl.constexpr):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = at < n
    row = at // width
    gate = gate_up + row * 2 * width + (at - row * width)  # the row's first half; its second half is up
    g = tl.load(gate, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(gate + width, mask=inside, other=0.0).to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(out.dtype.element_ty).to(tl.float32)  # F.silu's output, rounded
    tl.store(out + at, (activated * u).to(out.dtype.element_ty), mask=inside)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of ``gate_up`` ``[tokens, 2 * width]`` (the fused projection's output: gate's
    columns first), ``[tokens, width]``."""
    if gate_up.shape[-1] % 2 or not gate_up.is_contiguous():
        raise ValueError("silu_mul needs a contiguous gate_up of an even width")
    width = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    n = out.numel()
    _silu_mul[(triton.cdiv(n, SILU_BLOCK),)](gate_up, out, n, width, BLOCK=SILU_BLOCK, enable_fp_fusion=FP_FUSION)
    return out
