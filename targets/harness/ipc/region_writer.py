"""The cluster process's side of the weight export (``weight_export.py`` is the harness's): each region
the harness hands over is taken and mapped ahead, and the weights are written into it after the step.

Runs in the candidate's process, so nothing here is trusted: the harness checks the result by sealing
the region and replaying the step. What it is for is speed on the train call's path. Mapping a fresh
region faults in every page (2.4 GB for a 0.6B model: ~600,000 pages, most of a second), so the
region is mapped, its pages faulted in, on a thread of its own while the step trains
(``IncomingRegions``). A GPU tensor reaches it through two pinned buffers the process keeps
(``StagedCopy``): a chunk goes down by DMA while the previous one is copied into the region, and the
region is never page-locked (registering 2.4 GB with CUDA, and unregistering it before the seal, took
most of the 0.89 s the H200 run of 11-29 spent writing).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
import struct
import threading
from collections.abc import Mapping

import torch

from targets.harness.ipc.protocol import ProtocolError
from targets.harness.ipc.weight_export import Layout, slot_views

STAGING_ELEMENTS = 16 * 2**20  # float32 elements a pinned buffer holds (64 MB; two of them a process)


PAGE = mmap.PAGESIZE


def mapped(fd: int) -> mmap.mmap:
    """The whole region behind ``fd``, writable, every page faulted in now (the descriptor is closed).
    The pages are touched by a torch op, which lets go of the GIL (``MAP_POPULATE`` in the mmap call
    held it, and the cluster process's other threads, its event loop included, stalled for the whole of
    it); and the mapping is not inherited by a fork (a child forked while the step trains, a data loader's
    worker, would hold it writable, and the harness could not seal the region)."""
    try:
        memory = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    memory.madvise(mmap.MADV_DONTFORK)
    torch.frombuffer(memory, dtype=torch.uint8)[::PAGE].zero_()  # the harness's region holds zeros until written
    return memory


class IncomingRegions:
    """Each region the harness sends, taken and mapped on a thread of its own as soon as it arrives
    (the harness sends export N+1's once version N is saved, so it is ready before the step ends), and
    handed to the event loop that made this."""

    def __init__(self, sock: socket.socket) -> None:
        self._loop = asyncio.get_running_loop()
        self._arrived: asyncio.Queue[tuple[int, mmap.mmap] | BaseException] = asyncio.Queue()
        threading.Thread(target=self._receive, args=(sock,), name="weight-regions", daemon=True).start()

    def _receive(self, sock: socket.socket) -> None:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(sock, 8, 1)
                if not message and not fds:
                    raise ConnectionError("the harness closed the weights socket")
                if len(fds) != 1 or len(message) != 8:
                    for fd in fds:
                        os.close(fd)
                    raise ProtocolError(f"a weight region comes as 8 bytes and one fd, got {message!r}, {len(fds)} fds")
                arrived: tuple[int, mmap.mmap] | BaseException = (struct.unpack("<Q", message)[0], mapped(fds[0]))
            except Exception as error:  # noqa: BLE001 - said at the next export, not lost with the thread
                arrived = error
            try:
                self._loop.call_soon_threadsafe(self._arrived.put_nowait, arrived)
            except RuntimeError:  # the loop is closed: the process is ending
                return
            if isinstance(arrived, BaseException):
                return

    async def take(self, number: int) -> mmap.mmap:
        """Export ``number``'s region, mapped (waits for it if it is still on its way)."""
        arrived = await self._arrived.get()
        if isinstance(arrived, BaseException):
            raise ProtocolError(f"the weight region of export {number} did not arrive: {arrived}")
        got, memory = arrived
        if got != number:
            memory.close()
            raise ProtocolError(f"expected the weight region of export {number}, got export {got}'s")
        return memory


class StagedCopy:
    """Device tensors into host memory through two reused pinned buffers: each chunk is copied down
    asynchronously into one buffer while the previous chunk, in the other, is copied to its place.
    Every copy is done once ``flush`` returns. (A CPU source takes the same steps, synchronously: the
    chunking is what the CPU tests hold.)"""

    def __init__(self, chunk: int = STAGING_ELEMENTS, pinned: bool = True) -> None:
        self.buffers = [torch.empty(chunk, dtype=torch.float32, pin_memory=pinned) for _ in range(2)]
        self.chunk, self._used = chunk, 0
        self._pending: tuple[torch.cuda.Event | None, torch.Tensor, torch.Tensor] | None = None

    def copy(self, source: torch.Tensor, destination: torch.Tensor) -> None:
        """``source`` (any dtype, any shape of ``destination``'s size) into float32 ``destination``."""
        source, destination = source.detach().reshape(-1), destination.view(-1)
        for start in range(0, source.numel(), self.chunk):
            end = min(start + self.chunk, source.numel())
            staged = self.buffers[self._used % 2][: end - start]
            self._used += 1
            staged.copy_(source[start:end], non_blocking=True)
            done = None
            if source.is_cuda:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(source.device))
            self._finish()  # the previous chunk, from the other buffer, while this one comes down
            self._pending = (done, staged, destination[start:end])

    def _finish(self) -> None:
        if self._pending is not None:
            (done, staged, destination), self._pending = self._pending, None  # never written twice, nor late
            if done is not None:
                done.synchronize()
            destination.copy_(staged)

    def flush(self) -> None:
        self._finish()


_staging: StagedCopy | None = None  # the process's pinned buffers, made at its first GPU export


def _staged_copy() -> StagedCopy:
    global _staging
    if _staging is None:
        _staging = StagedCopy()
    return _staging


class RegionWriter:
    """``targets.api.WeightExport`` over a region the harness handed over, mapped (``mapped``)."""

    def __init__(self, memory: mmap.mmap, layout: Layout) -> None:
        if len(memory) < layout.nbytes:
            memory.close()
            raise ProtocolError(f"the weight region holds {len(memory)} bytes, its layout {layout.nbytes}")
        self.layout = layout
        self.shapes: Mapping[str, tuple[int, ...]] = {name: s.shape for s in layout.slots for name in s.names}
        self._slot = layout.slot_of()
        self._memory = memory
        self._views = slot_views(memory, layout)
        self._written: set[tuple[str, ...]] = set()
        self._staged: StagedCopy | None = None  # the process's, once a GPU tensor is written

    def write(self, name: str, tensor: torch.Tensor) -> None:
        slot = self._slot.get(name)
        if slot is None:
            raise KeyError(f"export_weights: {name!r} is not a weight of this model")
        if tuple(tensor.shape) != slot.shape:
            raise ValueError(f"export_weights: {name} has shape {tuple(tensor.shape)}, the model's is {slot.shape}")
        if tensor.is_cuda:
            self._staged = self._staged or _staged_copy()
            self._staged.copy(tensor, self._views[name])
        else:
            self._views[name].copy_(tensor.detach())
        self._written.add(slot.names)

    def written(self) -> list[str]:
        return [slot.names[0] for slot in self.layout.slots if slot.names in self._written]

    def close(self) -> None:
        """Finishes the copies and unmaps the region: the harness can seal it only then."""
        try:
            if self._staged is not None:
                self._staged.flush()
        finally:
            self._views.clear()
            self._memory.close()
