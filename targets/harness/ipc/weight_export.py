"""The weight export: how each trained version reaches the harness's snapshot, which the audit
replays, with one copy and no tensor on the socket.

For every ``train`` the harness hands the cluster process a fresh memory region of its own making
(a memfd, sealed against shrinking and growing, passed over a socket of its own) laid out by the
harness: one float32 slot per distinct tensor of the model, tied names sharing one slot. It is handed
over ahead, once the previous version is saved, so the cluster maps it while the step trains; after
the step the cluster writes each tensor into its slot (``targets.api.WeightExport``, through
``region_writer.py``: from a GPU through a reused pinned buffer), unmaps it and answers. The harness then seals the
region against every write (``F_SEAL_WRITE``, which the kernel grants only while no process maps it
writable): from that moment the region is an immutable copy that only the harness holds, so the
weights are the ones that existed when the train call was answered, and no candidate can change them
after. The kernel can refuse the seal a moment past an honest unmap (its own short references to the
pages under memory pressure, a child forked before the unmap that has not exec'd yet): the harness
tries again for up to ``SEAL_PATIENCE_S``, on the train call's clock, so waiting buys a candidate
nothing. The train call is answered then; the snapshot file is written from the sealed region in the
background, and the next train call waits for it.

A snapshot is a safetensors file (float32, one entry per slot, tied names in its metadata), the
region's bytes verbatim after the header; ``load_snapshot`` gives every name back.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import mmap
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from targets.api import StateDict
from targets.harness.ipc.protocol import ProtocolError

FLOAT32 = 4  # bytes an element
TIED = "vibetrain.tied"  # the metadata key naming each tied name's slot
SEAL_PATIENCE_S = 2.0  # how long a refused seal is tried again before the export is refused


class RegionStillMapped(ProtocolError):
    """The kernel refused to seal a region: some process still maps it writable (or pins its pages)."""


@dataclass(frozen=True)
class Slot:
    """One distinct tensor: every name it goes by, its shape, where its float32 bytes start."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * FLOAT32


@dataclass(frozen=True)
class Layout:
    """Where each of the model's tensors lives in an export region (float32, back to back)."""

    slots: tuple[Slot, ...]

    @classmethod
    def of(cls, state: StateDict) -> Layout:
        """From the harness's own state dict: names sharing storage (a tied embedding and head) get
        one slot, so each distinct tensor is written and stored once."""
        by_storage: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
        shapes: dict[tuple[int, int, tuple[int, ...]], tuple[int, ...]] = {}
        for name, tensor in state.items():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            by_storage.setdefault(key, []).append(name)
            shapes[key] = tuple(tensor.shape)
        slots, offset = [], 0
        for key, names in by_storage.items():
            slot = Slot(tuple(names), shapes[key], offset)
            slots.append(slot)
            offset += slot.nbytes
        return cls(tuple(slots))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def slot_of(self) -> dict[str, Slot]:
        return {name: slot for slot in self.slots for name in slot.names}

    def to_wire(self) -> list[dict]:
        return [{"names": list(s.names), "shape": list(s.shape), "offset": s.offset} for s in self.slots]

    @classmethod
    def from_wire(cls, data: object) -> Layout:
        """The layout as the harness sent it (the candidate's side reads it; checked all the same)."""
        if not isinstance(data, list):
            raise ProtocolError(f"a weight layout is a list of slots, got {type(data).__name__}")
        slots, offset = [], 0
        for entry in data:
            slot = Slot(tuple(entry["names"]), tuple(int(s) for s in entry["shape"]), int(entry["offset"]))
            if slot.offset != offset or not slot.names:
                raise ProtocolError(f"weight layout slot {slot.names} is not where the previous one ends")
            slots.append(slot)
            offset += slot.nbytes
        return cls(tuple(slots))


def slot_views(memory: mmap.mmap, layout: Layout) -> dict[str, torch.Tensor]:
    """Every name's float32 tensor over the region (tied names share one)."""
    flat = torch.frombuffer(memory, dtype=torch.float32, count=layout.nbytes // FLOAT32) if layout.nbytes else None
    views: dict[str, torch.Tensor] = {}
    for slot in layout.slots:
        start = slot.offset // FLOAT32
        tensor = flat[start : start + slot.numel].view(slot.shape)
        for name in slot.names:
            views[name] = tensor
    return views


class Region:
    """The harness's side of one version's export region."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.fd = os.memfd_create("vibetrain-weights", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        size = max(layout.nbytes, 1)
        os.ftruncate(self.fd, size)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        os.posix_fallocate(self.fd, 0, size)  # its pages exist before the cluster writes: no faults to allocate them
        self.sealed = False

    def seal(self) -> None:
        """No process may write the region again. The kernel refuses while any process still maps
        it writable: then the cluster answered its export before it was done with the region."""
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
        except OSError as error:
            if error.errno != errno.EBUSY:
                raise
            raise RegionStillMapped(
                "the cluster answered export_weights while it still mapped the weight region writable "
                f"({error.strerror}): an export must be finished, and the region unmapped, before it answers"
            ) from None
        self.sealed = True

    async def seal_patiently(self, patience_s: float = SEAL_PATIENCE_S) -> None:
        """``seal``, tried again while the kernel refuses it, for up to ``patience_s`` seconds."""
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + patience_s, 0.005
        while True:
            try:
                self.seal()
                return
            except RegionStillMapped:
                if loop.time() + pause > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.25)

    def save(self, path: Path) -> None:
        """The snapshot file: a safetensors header, then the sealed region's bytes verbatim."""
        if not self.sealed:
            raise RuntimeError("a weight region is saved only once sealed")
        header: dict = {
            slot.names[0]: {
                "dtype": "F32",
                "shape": list(slot.shape),
                "data_offsets": [slot.offset, slot.offset + slot.nbytes],
            }
            for slot in self.layout.slots
        }
        tied = {name: slot.names[0] for slot in self.layout.slots for name in slot.names[1:]}
        header["__metadata__"] = {TIED: json.dumps(tied)}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as out:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            if self.layout.nbytes:
                with mmap.mmap(self.fd, self.layout.nbytes, prot=mmap.PROT_READ) as memory:
                    out.write(memory)
        tmp.replace(path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def save_snapshot(path: Path, state: StateDict) -> None:
    """A snapshot of weights the harness holds itself (version 0), in the exported versions' format."""
    layout = Layout.of(state)
    region = Region(layout)
    try:
        with mmap.mmap(region.fd, max(layout.nbytes, 1)) as memory:
            views = slot_views(memory, layout)
            for slot in layout.slots:
                views[slot.names[0]].copy_(state[slot.names[0]].detach().reshape(slot.shape))
            del views
        region.seal()
        region.save(path)
    finally:
        region.close()


def load_snapshot(path: Path) -> dict[str, torch.Tensor]:
    """Every name of a snapshot, tied names as the same tensor."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    state = load_file(path)
    with safe_open(path, "pt") as f:
        tied = json.loads((f.metadata() or {}).get(TIED, "{}"))
    for name, source in tied.items():
        state[name] = state[source]
    return state


def send_region(sock: socket.socket, region: Region, number: int) -> None:
    """Hands the cluster process the region for export ``number`` over the weights socket."""
    socket.send_fds(sock, [struct.pack("<Q", number)], [region.fd])


class WeightExporter:
    """The harness's side of every export of a run: a region per version (the next one made and handed
    over while the last one is saved), sealed when the cluster answers, saved as ``v<step>.safetensors``
    in the background; ``saved`` is what the next train call waits for."""

    def __init__(
        self, layout: Layout, sock: socket.socket, directory: Path, ask: Callable[[int, Layout], Awaitable[object]]
    ) -> None:
        """``ask(number, layout)`` has the cluster write export ``number`` into the region sent ahead
        on ``sock`` and returns the names it says it wrote."""
        self.layout, self.sock, self.directory, self.ask = layout, sock, directory, ask
        self._saving: asyncio.Future | None = None
        self.versions: list[int] = []
        self._next: Region | None = None
        self._unsent: OSError | None = None  # why the region sent ahead could not be sent
        self._send_ahead(Region(layout), 1)

    def _send_ahead(self, region: Region, number: int) -> None:
        """Export ``number``'s region, handed over before it is asked for: the cluster maps it and faults
        its pages in while the step trains (``region_writer.IncomingRegions``), not on the train call. A
        send that fails (the cluster process gone: after the last step, it may have closed) fails only an
        export that asks for it."""
        self._next_number = number
        try:
            send_region(self.sock, region, number)
        except OSError as error:
            region.close()
            self._unsent = error
            return
        self._next = region

    async def saved(self) -> None:
        """Until the last version's file is written (raises what writing it raised)."""
        if self._saving is not None:
            await self._saving

    async def export(self, step: int) -> None:
        """Version ``step``: has the cluster write the region sent ahead for it, then seals it. Answered
        once the harness holds its copy."""
        await self.saved()
        if self._unsent is not None:
            raise ProtocolError(f"the weight region of export {step} could not be handed over: {self._unsent}")
        if self._next is None or self._next_number != step:
            raise ProtocolError(f"export {step} asked for, but the region sent ahead is export {self._next_number}'s")
        region, self._next = self._next, None
        try:
            claimed = await self.ask(step, self.layout)
            names_written(claimed if isinstance(claimed, list) else [], self.layout)
            await region.seal_patiently()
        except BaseException:
            region.close()
            raise
        self._saving = asyncio.ensure_future(asyncio.to_thread(self._save, region, step))

    def _save(self, region: Region, step: int) -> None:
        try:
            region.save(self.directory / f"v{step}.safetensors")
        finally:
            region.close()
        self.versions.append(step)
        self._send_ahead(Region(self.layout), step + 1)  # its pages allocated now, off the next export's path

    def close(self) -> None:
        if self._next is not None:
            self._next.close()
            self._next = None
        self.sock.close()


def names_written(claimed: Iterable[object], layout: Layout) -> None:
    """The cluster's account of what it wrote must cover every slot (a tensor it forgot would keep the
    region's zeros, which the training replay would also catch, later and less clearly)."""
    names = layout.slot_of()
    covered = {names[n].names for n in claimed if isinstance(n, str) and n in names}
    missing = [slot.names[0] for slot in layout.slots if slot.names not in covered]
    if missing:
        raise ProtocolError(f"export_weights left {len(missing)} weights unwritten: {missing[:5]}")
