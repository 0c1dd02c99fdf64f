"""The paged KV cache: a pool of fixed-size blocks per layer, and the block manager that hands them to
sequences (a block table per sequence, a free list), keeps a finished turn's blocks as its episode's
prefix so the next turn reuses them, and evicts those prefixes, least recently used, when a running
sequence needs room. Capacity, not a batch size, limits how many sequences run at once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class CachedPrefix:
    tokens: list[int]  # the tokens whose keys and values fill ``blocks`` (whole blocks only)
    blocks: list[int]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        # VAL: VAL_INT_RANGE (value=num_blocks, min=1, max=1 << 30)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.prefixes: OrderedDict[str, CachedPrefix] = OrderedDict()  # episode -> its last turn's blocks

    @property
    def free_blocks(self) -> int:
        return len(self.free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free) - sum(len(p.blocks) for p in self.prefixes.values())

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` blocks, evicting cached prefixes (oldest first) if need be; None if even that is not enough."""
        while len(self.free) < count and self.prefixes:
            self.release(self.prefixes.popitem(last=False)[1].blocks)
        if len(self.free) < count:
            return None
        return [self.free.pop() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def take_prefix(self, episode: str | None, prompt: list[int]) -> tuple[list[int], int]:
        """The episode's cached blocks that the prompt starts with: (blocks, tokens they hold). A
        cached prefix that does not match is freed (the context changed under it)."""
        if episode is None or episode not in self.prefixes:
            return [], 0
        cached = self.prefixes.pop(episode)
        usable = 0
        while usable < len(cached.blocks):
            start, end = usable * self.block_size, (usable + 1) * self.block_size
            if (
                end > len(prompt) - 1 or prompt[start:end] != cached.tokens[start:end]
            ):  # the last prompt token is always recomputed
                break
            usable += 1
        self.release(cached.blocks[usable:])
        return cached.blocks[:usable], usable * self.block_size

    def keep_prefix(self, episode: str | None, tokens: list[int], blocks: list[int]) -> None:
        """A finished turn's whole blocks become its episode's prefix; a partial last block is freed."""
        whole = min(len(tokens) // self.block_size, len(blocks))
        self.release(blocks[whole:])
        if episode is None or whole == 0:
            self.release(blocks[:whole])
            return
        if episode in self.prefixes:
            self.release(self.prefixes.pop(episode).blocks)
        self.prefixes[episode] = CachedPrefix(list(tokens[: whole * self.block_size]), blocks[:whole])

    def drop_prefixes(self) -> None:
        while self.prefixes:
            self.release(self.prefixes.popitem(last=False)[1].blocks)


class KVPool:
    """Keys and values of every layer: ``[num_blocks, block_size, kv_heads, head_dim]`` each (the
    NHD page layout FlashInfer reads; the CPU path gathers from the same tensors)."""

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kv_heads, head_dim = k.shape[1], k.shape[2]
        self.k[layer].view(-1, kv_heads, head_dim)[slots] = k
        self.v[layer].view(-1, kv_heads, head_dim)[slots] = v
