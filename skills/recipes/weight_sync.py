"""Versioned, bucketed weight sync from the trainer to the engines, the transport chosen by placement:

* **in place**: engine and trainer in one process (the local cluster; a Ray cluster's actor on trainer
  rank 0's device): the engine copies each tensor into its own, device to device;
* **broadcast group**: engines on other devices: trainer rank 0 and those engines form a process
  group of their own (NCCL on GPU, gloo on CPU; a TCP store, not the trainers' world) and each
  bucket is broadcast as one flat buffer;
* **object store** (CPU clusters): each bucket is put once in Ray's object store and every engine
  pulls it (the store broadcasts).

A bucket is at most ``bucket_bytes``; its layout (names, shapes, dtypes, offsets) travels beside
it, so a receiver needs nothing but the layout and the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from targets.api import StateDict

DEFAULT_BUCKET_BYTES = 64 << 20


def to_buckets(state: StateDict, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[dict]:
    buckets: list[dict] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1][name] = tensor
        size += nbytes
    return buckets


def merge(buckets: list[dict]) -> dict:
    merged: dict = {}
    for bucket in buckets:
        merged.update(bucket)
    return merged


# -- flat buckets (one buffer per bucket: one IPC handle, one broadcast) ------------------------------


@dataclass(frozen=True)
class Layout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    offsets: tuple[int, ...]  # byte offset of each tensor; the last entry is the total size

    @property
    def nbytes(self) -> int:
        return self.offsets[-1]


def pack(
    bucket: dict[str, torch.Tensor], device: str | torch.device, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, Layout]:
    """One contiguous byte buffer on ``device`` holding the bucket (cast to ``dtype`` if given),
    each tensor 16-byte aligned, and its layout."""
    names, shapes, dtypes, offsets = [], [], [], [0]
    tensors = []
    for name, tensor in bucket.items():
        tensor = tensor.detach().to(dtype) if dtype is not None else tensor.detach()
        names.append(name)
        shapes.append(tuple(tensor.shape))
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        size = tensor.numel() * tensor.element_size()
        offsets.append(offsets[-1] + -(-size // 16) * 16)
        tensors.append(tensor)
    flat = torch.empty(offsets[-1], dtype=torch.uint8, device=device)
    for tensor, start in zip(tensors, offsets):
        flat[start : start + tensor.numel() * tensor.element_size()].copy_(
            tensor.contiguous().view(-1).view(torch.uint8)
        )
    return flat, Layout(tuple(names), tuple(shapes), tuple(dtypes), tuple(offsets))


def unpack(flat: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Views of ``flat`` as the bucket's tensors (no copy)."""
    out = {}
    for name, shape, dtype, start in zip(layout.names, layout.shapes, layout.dtypes, layout.offsets):
        kind = getattr(torch, dtype)
        count = 1
        for dim in shape:
            count *= dim
        out[name] = flat[start : start + count * torch.empty(0, dtype=kind).element_size()].view(kind).view(shape)
    return out


# -- object store (CPU) -------------------------------------------------------------------------------------


def publish(state: StateDict, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list:
    import ray  # only the Ray cluster publishes

    return [ray.put(bucket) for bucket in to_buckets(state, bucket_bytes)]


# -- broadcast group (engines on other devices) -------------------------------------------------------------


class BroadcastGroup:
    """Rank 0 (the trainer's first rank) and the engines that receive from it, in a process group of
    their own: NCCL between GPUs, gloo between CPU processes."""

    def __init__(self, rendezvous: str, rank: int, world_size: int, device: str) -> None:
        import torch.distributed as dist

        from .rendezvous import connect

        self.rank, self.device = rank, device
        store = connect(rendezvous, "broadcast")
        if device.startswith("cuda"):
            self.group = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size)
        self._options = dist.BroadcastOptions()
        self._options.rootRank = 0

    def _broadcast(self, flat: torch.Tensor) -> None:
        self.group.broadcast([flat], self._options).wait()

    def send(self, state: StateDict, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Layout]:
        """Rank 0: every bucket, in order; returns their layouts (the receivers need them first, so
        the caller takes them from ``layouts`` before calling this)."""
        layouts = []
        for bucket in to_buckets(state, bucket_bytes):
            flat, layout = pack(bucket, self.device, dtype)
            self._broadcast(flat)
            layouts.append(layout)
        return layouts

    @staticmethod
    def layouts(state: StateDict, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Layout]:
        return [
            pack({k: torch.empty(v.shape, dtype=dtype, device="meta") for k, v in bucket.items()}, "meta")[1]
            for bucket in to_buckets(state, bucket_bytes)
        ]

    def receive(self, layouts: list[Layout]) -> list[dict[str, torch.Tensor]]:
        buckets = []
        for layout in layouts:
            flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            buckets.append(unpack(flat, layout))
        return buckets
