"""The weight export (targets/harness/ipc/weight_export.py): one sealed region per version, written by the
cluster, sealed by the harness; a snapshot that gives every name back in float32."""

from __future__ import annotations

import asyncio
import mmap
import os
import socket

import pytest
import torch

from targets.harness.ipc.protocol import ProtocolError
from targets.harness.ipc.region_writer import IncomingRegions, RegionWriter, StagedCopy, mapped
from targets.harness.ipc.weight_export import Layout, Region, WeightExporter, load_snapshot, save_snapshot


def _tied_state(dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    embed = torch.randn(16, 8, generator=generator).to(dtype)
    return {
        "model.embed_tokens.weight": embed,
        "model.layers.0.mlp.up_proj.weight": torch.randn(24, 8, generator=generator).to(dtype),
        "model.norm.weight": torch.ones(8, dtype=dtype),
        "lm_head.weight": embed,  # tied: the same tensor under two names
    }


def test_a_tied_weight_is_one_slot_and_a_snapshot_gives_every_name_back_in_float32(tmp_path):
    state = _tied_state()
    layout = Layout.of(state)
    assert [slot.names for slot in layout.slots][0] == ("model.embed_tokens.weight", "lm_head.weight")
    assert layout.nbytes == (16 * 8 + 24 * 8 + 8) * 4
    save_snapshot(tmp_path / "v0.safetensors", state)
    loaded = load_snapshot(tmp_path / "v0.safetensors")
    assert set(loaded) == set(state)
    assert all(loaded[name].dtype == torch.float32 for name in loaded)
    assert all(torch.equal(loaded[name].to(torch.bfloat16), state[name]) for name in state)  # bf16 -> f32 is exact
    assert loaded["lm_head.weight"] is loaded["model.embed_tokens.weight"]


class _Cluster:
    """The candidate's side of the weights socket, in this process: what candidate_process runs."""

    def __init__(self, sock: socket.socket, state: dict[str, torch.Tensor]) -> None:
        self.sock, self.state = sock, state
        self.regions: IncomingRegions | None = None  # made at the first ask (a test may read the socket first)
        self.keep_mapped = False  # the cheat: answer while the region is still mapped writable
        self.kept: mmap.mmap | None = None  # the cheat: keep a mapping to write after answering
        self.writers: list[RegionWriter] = []

    async def ask(self, number: int, layout: Layout) -> object:
        self.regions = self.regions or IncomingRegions(self.sock)
        memory = await self.regions.take(number)
        writer = RegionWriter(memory, Layout.from_wire(layout.to_wire()))
        for name, tensor in self.state.items():
            if name != "lm_head.weight":
                writer.write(name, tensor + number)
        if self.keep_mapped:
            self.writers.append(writer)
        else:
            writer.close()
        return writer.written()


def _exporter(tmp_path, state):
    harness, candidate = socket.socketpair()
    cluster = _Cluster(candidate, state)
    return WeightExporter(Layout.of(state), harness, tmp_path, cluster.ask), cluster


def test_each_version_is_sealed_then_saved_and_the_cluster_cannot_change_it_after(tmp_path, monkeypatch):
    from targets.harness.ipc import region_writer

    kept: list[int] = []  # the cheat: a descriptor of each region kept, to write after answering

    def keeping(fd: int) -> mmap.mmap:
        kept.append(os.dup(fd))
        return mapped(fd)

    monkeypatch.setattr(region_writer, "mapped", keeping)
    state = _tied_state()
    exporter, cluster = _exporter(tmp_path, state)

    async def run() -> None:
        for step in (1, 2):
            await exporter.export(step)
        await exporter.saved()

    asyncio.run(run())
    exporter.close()
    assert exporter.versions == [1, 2]
    for step in (1, 2):
        loaded = load_snapshot(tmp_path / f"v{step}.safetensors")
        assert torch.equal(loaded["lm_head.weight"], (state["lm_head.weight"] + step).float())
    # the descriptor the cluster kept from export 1 can no longer write its region, nor map it writable
    with pytest.raises(PermissionError):
        mmap.mmap(kept[0], 4)
    with pytest.raises(PermissionError):
        os.pwrite(kept[0], b"\0\0\0\0", 0)
    for fd in kept:
        os.close(fd)


def test_a_cluster_that_answers_while_still_mapping_the_region_is_refused(tmp_path):
    exporter, cluster = _exporter(tmp_path, _tied_state())
    cluster.keep_mapped = True
    with pytest.raises(ProtocolError, match="still mapped the weight region writable"):
        asyncio.run(exporter.export(1))
    for writer in cluster.writers:
        writer.close()
    exporter.close()
    assert not (tmp_path / "v1.safetensors").exists()


def test_a_mapping_released_a_moment_after_the_answer_is_waited_for(tmp_path):
    """What an honest cluster can leave for a moment (a child forked before its unmap, the kernel's own
    short references to the pages): the seal is tried again, and the export goes through."""
    exporter, cluster = _exporter(tmp_path, _tied_state())
    cluster.keep_mapped = True

    async def run() -> None:
        release = asyncio.get_running_loop().call_later(0.1, lambda: [w.close() for w in cluster.writers])
        await exporter.export(1)
        await exporter.saved()
        release.cancel()

    asyncio.run(run())
    exporter.close()
    assert exporter.versions == [1]


def test_a_cluster_that_leaves_a_weight_unwritten_is_refused(tmp_path):
    state = _tied_state()
    exporter, cluster = _exporter(tmp_path, state)
    del cluster.state["model.norm.weight"]
    with pytest.raises(ProtocolError, match=r"left 1 weights unwritten: \['model.norm.weight'\]"):
        asyncio.run(exporter.export(1))
    exporter.close()


def test_a_write_of_an_unknown_name_or_a_wrong_shape_names_it():
    layout = Layout.of(_tied_state())
    region = Region(layout)
    writer = RegionWriter(mapped(os.dup(region.fd)), layout)
    with pytest.raises(KeyError, match="'model.layers.9.mlp.up_proj.weight' is not a weight of this model"):
        writer.write("model.layers.9.mlp.up_proj.weight", torch.zeros(24, 8))
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(9,\), the model's is \(8,\)"):
        writer.write("model.norm.weight", torch.zeros(9))
    writer.close()
    region.seal()
    region.close()


def test_the_next_region_is_handed_over_before_its_export_is_asked_for(tmp_path):
    """Export N+1's region reaches the cluster once version N is saved, so it is mapped (its pages faulted
    in: most of a second for a 0.6B model) while the step trains, not on the train call; export 1's before
    the run. Before, each region came with its export's call."""
    state = _tied_state()
    layout = Layout.of(state)
    harness, candidate = socket.socketpair()
    taken: list[int] = []  # each region's descriptor, as it arrived

    candidate.settimeout(5)  # a region not sent is a TimeoutError, not a wait

    def arrived() -> int:
        message, fds, _, _ = socket.recv_fds(candidate, 8, 1)
        taken.extend(fds)
        return int.from_bytes(message, "little")

    async def ask(number: int, wire: Layout) -> object:
        writer = RegionWriter(mapped(os.dup(taken[number - 1])), layout)
        for name, tensor in state.items():
            writer.write(name, tensor)
        writer.close()
        return writer.written()

    exporter = WeightExporter(layout, harness, tmp_path, ask)
    assert arrived() == 1  # at the exporter's making, before any step

    async def run() -> None:
        await exporter.export(1)
        await exporter.saved()

    asyncio.run(run())
    assert arrived() == 2  # with no export asked for since
    exporter.close()
    for fd in taken:
        os.close(fd)
    candidate.close()


def test_an_export_given_another_exports_region_is_refused(tmp_path):
    harness, candidate = socket.socketpair()
    layout = Layout.of(_tied_state())
    region = Region(layout)
    socket.send_fds(harness, [(2).to_bytes(8, "little")], [region.fd])

    async def take(number: int) -> mmap.mmap:
        return await IncomingRegions(candidate).take(number)

    with pytest.raises(ProtocolError, match="expected the weight region of export 1, got export 2's"):
        asyncio.run(take(1))
    harness.close()
    with pytest.raises(ProtocolError, match="did not arrive: the harness closed the weights socket"):
        asyncio.run(take(3))
    region.close()
    candidate.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_staged_copy_writes_every_chunk_and_the_last_at_the_flush(dtype):
    """The GPU path's chunking (``StagedCopy``: two buffers taking turns), on CPU tensors: tensors shorter
    than a chunk, straddling chunks and of several, in float32 whatever they came in; the last chunk reaches
    its place at the flush (the copy is pipelined: a chunk lands while the next one comes down)."""
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(shape, generator=generator).to(dtype) for shape in ((3,), (4, 3), (5,), (2, 11))]
    destinations = [torch.zeros(s.shape) for s in sources]
    staged = StagedCopy(chunk=5, pinned=False)
    for source, destination in zip(sources, destinations):
        staged.copy(source, destination)
    assert not destinations[-1].reshape(-1)[20:].any()  # its last chunk (2 of 22) is still in a buffer
    staged.flush()
    for source, destination in zip(sources, destinations):
        assert torch.equal(destination, source.float())


def test_a_cluster_gone_after_its_last_step_fails_no_run(tmp_path):
    """After each save the harness hands over the next region: a cluster process that had closed by then (the
    run's last step done) made that send fail, and with it the save the run's end waits on, so a finished run
    failed. The failed send is kept for an export that asks for its region."""
    state = _tied_state()
    layout = Layout.of(state)
    harness, candidate = socket.socketpair()

    async def ask(number: int, wire: Layout) -> object:
        _, fds, _, _ = socket.recv_fds(candidate, 8, 1)
        writer = RegionWriter(mapped(fds[0]), layout)
        for name, tensor in state.items():
            writer.write(name, tensor)
        writer.close()
        candidate.close()  # the cluster process ends after its last step
        return writer.written()

    exporter = WeightExporter(layout, harness, tmp_path, ask)

    async def run() -> None:
        await exporter.export(1)
        await exporter.saved()  # raised BrokenPipeError from the send ahead of export 2

    asyncio.run(run())
    assert exporter.versions == [1] and (tmp_path / "v1.safetensors").exists()
    with pytest.raises(ProtocolError, match="the weight region of export 2 could not be handed over"):
        asyncio.run(exporter.export(2))
    exporter.close()


def test_a_child_forked_while_the_region_is_mapped_does_not_hold_it():
    """The region is mapped for the whole step now, not only while written: a child forked meanwhile (a data
    loader's worker, a fork-started helper) inherited the writable mapping, and the harness could not seal
    the region while it lived (an honest run refused). The mapping is not inherited by a fork."""
    import signal
    import time

    layout = Layout.of(_tied_state())
    region = Region(layout)
    memory = mapped(os.dup(region.fd))
    child = os.fork()
    if child == 0:  # the fork holds on, as a worker would
        time.sleep(30)
        os._exit(0)
    try:
        memory.close()
        region.seal()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        region.close()
