"""Paged decode attention in Triton, for a GPU without FlashInfer: decode steps read the KV blocks in
place from fixed buffers, so they are captured in CUDA graphs as FlashInfer's are; prefill steps (ragged
prompts, run eagerly) go through the SDPA path.

One program per (sequence, KV head) walks the sequence's context ``TOKENS`` positions at a time: the
block table gives each position's cache row, the query heads that share the KV head score those keys
together, and an online softmax (running maximum and sum) accumulates the values, so no score matrix
is ever written. Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernel on CPU tensors,
which is how the tests check it against SDPA on a machine with no GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_ops import FP_FUSION
from .kv_cache import KVPool
from .paged_attention import SDPAAttention, StepLayout


@triton.jit
def _paged_decode(
    q,  # [batch, heads, dim]
    k_cache,  # [blocks, block_size, kv_heads, dim]
    v_cache,
    tables,  # [batch, width] int32: each sequence's blocks
    lengths,  # [batch] int32: each sequence's context, this step's token included
    out,  # [batch, heads, dim]
    scale,
    q_stride_b,
    q_stride_h,
    cache_stride_block,
    cache_stride_pos,
    cache_stride_h,
    tables_stride_b,
    out_stride_b,
    out_stride_h,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P2: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,  # context positions per iteration
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    length = tl.load(lengths + b)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, DIM)
    heads = kv_head * GROUP + g
    real = (g < GROUP)[:, None]  # GROUP_P2 rows, this group's heads first
    q_rows = tl.load(q + b * q_stride_b + heads[:, None] * q_stride_h + d[None, :], mask=real, other=0.0)
    q_rows = q_rows.to(tl.float32) * scale
    running_max = tl.full([GROUP_P2], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([GROUP_P2, DIM], dtype=tl.float32)
    for start in range(0, length, TOKENS):
        positions = start + tl.arange(0, TOKENS)
        inside = positions < length
        block = tl.load(tables + b * tables_stride_b + positions // BLOCK_SIZE, mask=inside, other=0)
        # in int64: a small model's cache on a large card has more than 2^31 elements a layer (the tiny
        # target's on an H200 ran past it in int32 and read outside the cache)
        rows = block.to(tl.int64) * cache_stride_block
        rows += (positions % BLOCK_SIZE) * cache_stride_pos + kv_head * cache_stride_h
        keys = tl.load(k_cache + rows[:, None] + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q_rows[:, None, :] * keys[None, :, :], axis=2)  # [GROUP_P2, TOKENS]
        scores = tl.where(inside[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(running_max - new_max)
        values = tl.load(v_cache + rows[:, None] + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
        running_sum = running_sum * rescale + tl.sum(weights, axis=1)
        running_max = new_max
    result = acc / running_sum[:, None]
    tl.store(
        out + b * out_stride_b + heads[:, None] * out_stride_h + d[None, :],
        result.to(out.dtype.element_ty),
        mask=real,
    )


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Attention of one new query per sequence over its paged context: ``q`` ``[batch, heads, dim]``,
    the caches ``[blocks, block_size, kv_heads, dim]``; returns ``[batch, heads, dim]``."""
    q = q.contiguous()  # the kernel steps through a row's dims one element apart, as the caches' are
    batch, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("paged_decode needs the key and value caches laid out alike, each row's dims contiguous")
    if heads % kv_heads or dim & (dim - 1) or block_size & (block_size - 1):
        raise ValueError(
            f"paged_decode needs heads ({heads}) a multiple of kv_heads ({kv_heads}), and a power-of-two "
            f"head dim ({dim}) and block size ({block_size})"
        )
    group = heads // kv_heads
    out = torch.empty_like(q)
    _paged_decode[(batch, kv_heads)](
        q,
        k_cache,
        v_cache,
        tables,
        lengths,
        out,
        dim**-0.5,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_P2=triton.next_power_of_2(group),
        DIM=dim,
        BLOCK_SIZE=block_size,
        TOKENS=max(16, block_size),
        enable_fp_fusion=FP_FUSION,
    )
    return out


class TritonAttention:
    """The engine's attention with Triton decode steps: ``plan`` for an eager step (decode by the
    kernel, prefill by SDPA), ``plan_graph`` for a captured decode step of a fixed batch size, whose
    block tables and lengths live in that size's fixed buffers (as FlashInfer's graph wrappers keep
    theirs)."""

    def __init__(self, pool: KVPool, heads: int, kv_heads: int, head_dim: int, device: str, max_blocks: int) -> None:
        self.pool, self.device, self.max_blocks = pool, device, max_blocks  # the kernel reads heads off the tensors
        self.sdpa = SDPAAttention(pool, heads, kv_heads, head_dim)
        self.graph_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.inputs_per_row = 1 + max_blocks  # a graphed step's upload: a length and a block table a sequence
        self.decoding = False

    def _tables(self, layout: StepLayout) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(table) for table in layout.block_tables)
        rows = [table + [0] * (width - len(table)) for table in layout.block_tables]
        return torch.tensor(rows, dtype=torch.int32), torch.tensor(layout.context, dtype=torch.int32)

    def plan(self, layout: StepLayout, device: str) -> None:
        self.decoding = layout.decode_only
        if not self.decoding:
            self.sdpa.plan(layout, device)
            return
        self.slots = torch.tensor(layout.slots(), dtype=torch.long, device=device)
        tables, lengths = self._tables(layout)
        self.tables, self.lengths = tables.to(device), lengths.to(device)

    def graph_inputs(self, layout: StepLayout) -> list[int]:
        """What ``plan_graph`` reads from the step's upload: each sequence's length, then its block table
        (as wide as the widest of the step)."""
        width = max(len(table) for table in layout.block_tables)
        if width > self.max_blocks:
            raise ValueError(f"a sequence spans {width} blocks, more than the cache's {self.max_blocks}")
        return [*layout.context, *(b for table in layout.block_tables for b in table + [0] * (width - len(table)))]

    def plan_graph(self, layout: StepLayout, slots: torch.Tensor, inputs: torch.Tensor) -> None:
        """A decode step of exactly ``len(layout.new)`` sequences: its lengths and tables (``inputs``, on
        the device, as ``graph_inputs`` laid them out) copied into that size's buffers, only the columns
        in use (the kernel reads no position past a length)."""
        size = len(layout.new)
        if size not in self.graph_buffers:
            self.graph_buffers[size] = (
                torch.zeros(size, self.max_blocks, dtype=torch.int32, device=self.device),
                torch.ones(size, dtype=torch.int32, device=self.device),
            )
        self.tables, self.lengths = self.graph_buffers[size]
        width = (inputs.numel() - size) // size
        self.lengths.copy_(inputs[:size])
        self.tables[:, :width].copy_(inputs[size:].view(size, width))
        self.slots, self.decoding = slots, True

    def cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (*self.pool.rows(layer), self.slots) if self.decoding else self.sdpa.cache(layer)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if not self.decoding:
            return self.sdpa.attend(layer, q)
        return paged_decode(q, self.pool.k[layer], self.pool.v[layer], self.tables, self.lengths)
