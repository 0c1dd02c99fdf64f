"""The paged KV cache: a pool of fixed-size blocks per layer, and the block manager that hands them to
sequences (a block table per sequence, a free list), keeps a finished turn's blocks as its episode's
prefix so the next turn reuses them, and evicts those prefixes, least recently used, when a running
sequence needs room. Capacity, not a batch size, limits how many sequences run at once.

The host tier (``HostKV``, the ``kv_host_tier`` skill): an evicted prefix's keys and values are copied
to host memory instead of being lost, so an episode back from a long tool call reloads its context
over the host link instead of prefilling it again (a copy of its bytes against a forward pass over
all of its tokens). Keys and values hold only under the weights that computed them: a weight load
drops the host tier with the device's prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .request import Request


@dataclass
class CachedPrefix:
    tokens: list[int]  # the tokens whose keys and values fill ``blocks`` (whole blocks only)
    blocks: list[int]


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, spill: Callable[[str, CachedPrefix], None] | None = None
    ) -> None:
        """``spill``: told of each prefix evicted for room, before its blocks are reused (the host tier)."""
        # VAL: VAL_INT_RANGE (value=num_blocks, min=1, max=1 << 30)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.prefixes: OrderedDict[str, CachedPrefix] = OrderedDict()  # episode -> its last turn's blocks
        self.spill = spill

    @property
    def free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` blocks, evicting cached prefixes (oldest first) if need be; None if even that is not enough."""
        while len(self.free) < count and self.prefixes:
            episode, prefix = self.prefixes.popitem(last=False)
            if self.spill is not None:
                self.spill(episode, prefix)
            self.release(prefix.blocks)
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
        usable = self.usable_blocks(cached.tokens, prompt)
        self.release(cached.blocks[usable:])
        return cached.blocks[:usable], usable * self.block_size

    def usable_blocks(self, cached: list[int], prompt: list[int]) -> int:
        """How many whole blocks of ``cached`` the prompt starts with (its last token is always
        computed again: it gives the first logits)."""
        usable = 0
        while (usable + 1) * self.block_size <= min(len(cached), len(prompt) - 1):
            start, end = usable * self.block_size, (usable + 1) * self.block_size
            if prompt[start:end] != cached[start:end]:
                break
            usable += 1
        return usable

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

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values as ``[slots, kv_heads, head_dim]``: a slot (block * block_size +
        offset) is a row, where a step writes each new token's key and value."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])


class HostKV:
    """Evicted prefixes' keys and values in host memory, the least recently saved dropped first beyond
    ``capacity_tokens``."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        # VAL: VAL_INT_RANGE (value=capacity_tokens, min=block_size, max=1 << 40)
        self.capacity_tokens, self.block_size = capacity_tokens, block_size
        self.saved: OrderedDict[str, tuple[list[int], list[torch.Tensor], list[torch.Tensor]]] = OrderedDict()
        self.tokens = 0  # held now
        self.saved_tokens = self.restored_tokens = 0  # so far: what went out, and what came back

    def save(self, pool: KVPool, episode: str, prefix: CachedPrefix) -> None:
        if len(prefix.tokens) > self.capacity_tokens:
            return
        self.drop(episode)
        index = torch.tensor(prefix.blocks, device=pool.k[0].device)
        k = [layer.index_select(0, index).to("cpu") for layer in pool.k]
        v = [layer.index_select(0, index).to("cpu") for layer in pool.v]
        self.saved[episode] = (list(prefix.tokens), k, v)
        self.tokens += len(prefix.tokens)
        self.saved_tokens += len(prefix.tokens)
        while self.tokens > self.capacity_tokens:
            self.drop(next(iter(self.saved)))

    def save_computed(self, pool: KVPool, request: Request) -> None:
        """A preempted request's whole computed blocks, saved as it leaves the cache: readmitted, it reloads
        them instead of recomputing its context (as vLLM's KV offloading keeps a preempted request's)."""
        whole = min(request.computed // self.block_size, len(request.blocks))
        if request.episode is not None and whole:
            kept = CachedPrefix(request.tokens[: whole * self.block_size], request.blocks[:whole])
            self.save(pool, request.episode, kept)

    def restore(
        self, pool: KVPool, blocks: BlockManager, episode: str, prompt: list[int], needed: int
    ) -> tuple[list[int], int] | None:
        """The ``needed`` blocks of a request whose episode's prefix is saved here, its whole blocks that
        the prompt starts with copied back into the first of them: (blocks, tokens restored); None
        while the cache has no room (the prefix stays saved for the next try)."""
        tokens, k, v = self.saved[episode]
        taken = blocks.allocate(needed)
        if taken is None:
            return None
        self.drop(episode)
        usable = blocks.usable_blocks(tokens, prompt)
        index = torch.tensor(taken[:usable], device=pool.k[0].device)
        for layer in range(len(pool.k)):
            pool.k[layer].index_copy_(0, index, k[layer][:usable].to(pool.k[layer].device))
            pool.v[layer].index_copy_(0, index, v[layer][:usable].to(pool.v[layer].device))
        self.restored_tokens += usable * self.block_size
        return taken, usable * self.block_size

    def drop(self, episode: str) -> None:
        if episode in self.saved:
            self.tokens -= len(self.saved.pop(episode)[0])

    def clear(self) -> None:
        self.saved.clear()
        self.tokens = 0
