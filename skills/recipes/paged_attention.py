"""Attention over the paged KV cache for one engine step, two backends behind one call:

* ``SDPAAttention`` (CPU, any dtype): gathers each sequence's context from its blocks into a padded
  ``[batch, context, heads, dim]`` view and runs torch's scaled_dot_product_attention with a mask
  (causal within the step's new tokens, nothing past a sequence's length);
* ``FlashInferAttention`` (GPU, bf16/fp16): FlashInfer's paged kernels read the blocks in place: the
  batch prefill kernel for steps with prompts (ragged queries), the batch decode kernel for steps of
  one token per sequence (the only kind captured in CUDA graphs).

A step is planned once (``plan``: block tables, lengths, the slot each new token's key and value go
to); then, per layer, the model writes the step's keys and values into ``cache(layer)`` (fused with
their norm and RoPE on a GPU) and ``attend(layer, q)`` attends each query over its sequence's context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_cache import KVPool


@dataclass
class StepLayout:
    """Where a step's new tokens come from and go to. Sequence ``b`` has ``context[b]`` tokens in
    all after this step, the last ``new[b]`` of them computed now."""

    block_tables: list[list[int]]
    context: list[int]
    new: list[int]
    block_size: int

    def slots(self) -> list[int]:
        out = []
        for table, total, fresh in zip(self.block_tables, self.context, self.new):
            for position in range(total - fresh, total):
                out.append(table[position // self.block_size] * self.block_size + position % self.block_size)
        return out

    def positions(self) -> list[int]:
        return [p for total, fresh in zip(self.context, self.new) for p in range(total - fresh, total)]

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.new)


class SDPAAttention:
    def __init__(self, pool: KVPool, heads: int, kv_heads: int, head_dim: int) -> None:
        self.pool, self.heads, self.kv_heads, self.head_dim = pool, heads, kv_heads, head_dim

    def plan(self, layout: StepLayout, device: str) -> None:
        """Index tensors for the whole batch at once: the cache slot of every context position, the
        flat row of every (padded) query, and the mask (causal within the new tokens)."""
        size = layout.block_size
        widest_table = max(len(t) for t in layout.block_tables)
        tables = torch.tensor([t + [0] * (widest_table - len(t)) for t in layout.block_tables], dtype=torch.long)
        total, fresh = torch.tensor(layout.context), torch.tensor(layout.new)
        positions = torch.arange(int(total.max()))
        context = tables.gather(1, (positions // size)[None, :].expand(len(total), -1)) * size + positions % size
        inside = positions[None, :] < total[:, None]
        self.context = torch.where(inside, context, 0).to(device)
        columns = torch.arange(int(fresh.max()))
        real = columns[None, :] < fresh[:, None]  # [B, W]
        first = total - fresh  # position of each sequence's first new token
        self.query = torch.where(real, (fresh.cumsum(0) - fresh)[:, None] + columns[None, :], 0).to(device)
        self.rows = real.to(device)
        query_positions = first[:, None] + columns[None, :]  # [B, W]
        allowed = (positions[None, None, :] <= query_positions[:, :, None]) & inside[:, None, :] & real[:, :, None]
        self.mask = allowed[:, None].to(device)  # [B, 1, W, L]
        self.slots = context.gather(1, query_positions.clamp(max=context.shape[1] - 1))[real].to(device)

    def cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's key and value rows, and the row of each of the step's new tokens."""
        return (*self.pool.rows(layer), self.slots)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        keys, values = (rows[self.context] for rows in self.pool.rows(layer))  # [B, L, Hkv, D]
        queries = q[self.query.clamp(min=0)]  # [B, W, H, D]; padded rows are discarded below
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=self.mask,
            enable_gqa=self.heads != self.kv_heads,
        )
        return out.transpose(1, 2)[self.rows]  # [T, H, D], in the order of q


class FlashInferAttention:
    """FlashInfer's paged prefill and decode kernels. For CUDA graphs, one decode wrapper per batch
    size keeps its metadata in fixed buffers (``plan_graph``), so a captured decode step replays."""

    WORKSPACE_BYTES = 128 << 20

    def __init__(
        self,
        pool: KVPool,
        heads: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        max_blocks: int,
        graph_batch: int = 0,
    ) -> None:
        import flashinfer  # imported where it runs: a GPU engine

        self.flashinfer = flashinfer
        self.pool, self.heads, self.kv_heads, self.head_dim, self.dtype = pool, heads, kv_heads, head_dim, dtype
        self.device, self.max_blocks = device, max_blocks
        self.tensor_cores = heads // kv_heads >= 4
        self.workspace = torch.zeros(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores
        )
        self.graph_wrappers: dict[int, object] = {}
        self.inputs_per_row = 0  # a graphed step's upload carries nothing of its own
        self.graph_workspace = (
            torch.zeros(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device) if graph_batch else None
        )
        self.wrapper = self.prefill

    @staticmethod
    def _csr(layout: StepLayout, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pages = [(total + layout.block_size - 1) // layout.block_size for total in layout.context]
        indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32, device=device)
        indices = torch.tensor(
            [b for table, n in zip(layout.block_tables, pages) for b in table[:n]], dtype=torch.int32, device=device
        )
        last = torch.tensor(
            [total - (n - 1) * layout.block_size for total, n in zip(layout.context, pages)],
            dtype=torch.int32,
            device=device,
        )
        return indptr, indices, last

    def _common(self, layout: StepLayout) -> dict:
        return dict(
            num_qo_heads=self.heads, num_kv_heads=self.kv_heads, page_size=layout.block_size, q_data_type=self.dtype
        )

    def plan(self, layout: StepLayout, device: str) -> None:
        self.slots = torch.tensor(layout.slots(), dtype=torch.long, device=device)
        indptr, indices, last = self._csr(layout, device)
        if layout.decode_only:
            self.wrapper = self.decode
            self.decode.plan(indptr, indices, last, head_dim=self.head_dim, **self._common(layout))
        else:
            self.wrapper = self.prefill
            qo = torch.tensor([0, *torch.tensor(layout.new).cumsum(0).tolist()], dtype=torch.int32, device=device)
            self.prefill.plan(qo, indptr, indices, last, head_dim_qk=self.head_dim, causal=True, **self._common(layout))

    def graph_inputs(self, layout: StepLayout) -> list[int]:
        """Nothing in the step's upload: FlashInfer's ``plan`` sends its own metadata."""
        return []

    def plan_graph(self, layout: StepLayout, slots: torch.Tensor, inputs: torch.Tensor) -> None:
        """Plan a decode step of exactly ``len(layout.new)`` sequences into that size's fixed
        buffers; the step's keys and values go to the slots in ``slots`` (a fixed buffer too)."""
        size = len(layout.new)
        if size not in self.graph_wrappers:
            buffers = (
                torch.zeros(size + 1, dtype=torch.int32, device=self.device),
                torch.zeros(self.max_blocks, dtype=torch.int32, device=self.device),
                torch.zeros(size, dtype=torch.int32, device=self.device),
            )
            self.graph_wrappers[size] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.graph_workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.tensor_cores,
                paged_kv_indptr_buffer=buffers[0],
                paged_kv_indices_buffer=buffers[1],
                paged_kv_last_page_len_buffer=buffers[2],
            )
        indptr, indices, last = self._csr(layout, self.device)
        self.wrapper = self.graph_wrappers[size]
        self.wrapper.plan(indptr, indices, last, head_dim=self.head_dim, **self._common(layout))
        self.slots = slots

    def cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (*self.pool.rows(layer), self.slots)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self.wrapper.run(q.contiguous(), (self.pool.k[layer], self.pool.v[layer]))
