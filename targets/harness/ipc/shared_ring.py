"""Shared-memory rings: how the harness and a simulated run's controller process hand each other
their bursts.

Under virtual time the two processes take turns, twice a trajectory-turn. Over a Unix socket a
handoff cost about 7 µs each way on a 2-core VM (a send, a poll that sees it, a receive: a
160-device run spent a sixth of its time in them); through memory both processes map it costs
well under one. The frames and the burst markers are the same bytes the socket carried; only
their road changes. The socket stays: it carries the region itself at the start, and tells each
side when the other has gone.

The region is a sealed memfd the harness makes and passes over the socket, so the candidate can
neither shrink it under the harness (a bus error) nor swap it for another::

    counters (one 4 KiB page)   harness -> controller: written, read (u64 each, bytes since the start)
                                controller -> harness: written, read
    ring 0  (CAPACITY bytes)    harness -> controller
    ring 1  (CAPACITY bytes)    controller -> harness

A writer copies its bytes in, then publishes its new written count; a reader sees the count,
copies the bytes out, then publishes its read count. x86 keeps stores in order and loads in order,
so a published count never runs ahead of its bytes; other machines keep the socket
(``channel.PolledTransport``). Each side keeps its own counts and checks the other's: what the
other side publishes is data, never trusted (a count that goes back, or past what the ring holds,
breaks the protocol), and the bytes it reads are parsed as any frame from a candidate is.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import platform
import socket
import time
from typing import TYPE_CHECKING

from targets.harness.ipc.protocol import ProtocolError

if TYPE_CHECKING:
    from targets.harness.ipc.channel import AsyncChannel

CAPACITY = 4 << 20  # bytes a ring holds: far more than a simulated burst
COUNTERS = 4096
HARNESS, CONTROLLER = 0, 1  # the side a process is on; it writes ring <side>, reads ring <1 - side>
FULL_RING_S = 30.0  # a ring full this long: its reader has stopped reading


def supported() -> bool:
    """Whether this machine keeps the store and load order the rings rely on (x86)."""
    return platform.machine() in ("x86_64", "AMD64", "i386", "i686")


def offer(sock: socket.socket) -> tuple[mmap.mmap, int] | None:
    """The harness's side, first on a simulated controller link: the rings' region (a sealed memfd,
    sent over ``sock``), or on a machine without them a word that the socket carries everything."""
    if not supported():
        sock.sendall(b"socket")
        return None
    fd = os.memfd_create("vibetrain-rings", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, COUNTERS + 2 * CAPACITY)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        memory = mmap.mmap(fd, COUNTERS + 2 * CAPACITY)
        socket.send_fds(sock, [b"rings"], [fd])
    finally:
        os.close(fd)
    return memory, HARNESS


def accept(sock: socket.socket) -> tuple[mmap.mmap, int] | None:
    """The controller's side: the rings' region the harness offered, mapped (None: the socket)."""
    message, fds, _, _ = socket.recv_fds(sock, 16, 1)
    try:
        if message == b"socket" and not fds:
            return None
        if message != b"rings" or len(fds) != 1 or os.fstat(fds[0]).st_size != COUNTERS + 2 * CAPACITY:
            raise ProtocolError(f"expected the rings' region, got {message!r} with {len(fds)} descriptors")
        return mmap.mmap(fds[0], COUNTERS + 2 * CAPACITY), CONTROLLER
    finally:
        for fd in fds:
            os.close(fd)


class RingTransport:
    """The transport of an ``AsyncChannel`` whose virtual-time loop drives it (``poll``), over the
    rings of ``memory``; ``sock`` only tells when the other side has gone."""

    def __init__(self, sock: socket.socket, memory: mmap.mmap, side: int, protocol: AsyncChannel) -> None:
        sock.setblocking(False)
        self.sock, self.memory, self.protocol = sock, memory, protocol
        self._written = self._read = 0  # this side's own counts: the other's copies are never trusted
        # The counters as one 8-byte item each: a memoryview stores and loads an item with one aligned
        # 8-byte copy, never seen half done (``struct.pack_into`` zeroes its bytes first, and a racing
        # reader saw counts of 0 in a stress test).
        self._counts = memoryview(memory)[:COUNTERS].cast("Q")
        self._out_written, self._out_read = 4 * side, 4 * side + 1  # counter indices of the ring written
        self._in_written, self._in_read = 4 * (1 - side), 4 * (1 - side) + 1  # of the ring read
        self._out_base, self._in_base = COUNTERS + side * CAPACITY, COUNTERS + (1 - side) * CAPACITY
        self._closing = False
        self._polls = 0
        self._free = 0  # room the reader had left the last time this side looked (it only grows since)

    def fileno(self) -> int:
        return self.sock.fileno()

    def is_closing(self) -> bool:
        return self._closing

    # -- writing ----------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        at = self._written % CAPACITY
        if len(data) <= min(self._free, CAPACITY - at):  # room known already, and no wrap: one copy
            self.memory[self._out_base + at : self._out_base + at + len(data)] = data
            self._written += len(data)
            self._free -= len(data)
            self._counts[self._out_written] = self._written  # after the bytes: publish
            return
        view, started = memoryview(data), None
        while view and not self._closing:
            read = self._count(self._out_read, self._written - CAPACITY, self._written)
            if read is None:
                return
            free = self._free = CAPACITY - (self._written - read)
            if not free:  # the reader is behind by a whole ring: wait for it (it is the other process)
                started = started or time.monotonic()
                if time.monotonic() - started > FULL_RING_S:
                    self._lose(ProtocolError(f"the other side read nothing for {FULL_RING_S:.0f} s of a full ring"))
                    return
                self._check_alive()
                os.sched_yield()
                continue
            at = self._written % CAPACITY
            n = min(len(view), free, CAPACITY - at)
            self.memory[self._out_base + at : self._out_base + at + n] = view[:n]
            self._written += n
            self._free -= n
            self._counts[self._out_written] = self._written  # after the bytes: publish
            view = view[n:]

    # -- reading ----------------------------------------------------------------------------------
    def poll(self) -> bool:
        """Hand the protocol what the other side has written; whether anything came (or the channel
        closed: nothing more will come, so nothing to wait for)."""
        if self._closing:
            return True
        if self._drain():
            return True
        self._polls += 1
        if self._polls % 64 == 0:
            self._check_alive()
            return self._closing
        return False

    def _drain(self) -> bool:
        written = self._count(self._in_written, self._read, self._read + CAPACITY)
        if written is None or written == self._read:
            return written is None
        while self._read < written and not self._closing:
            at = self._read % CAPACITY
            buffer = self.protocol.get_buffer(-1)
            n = min(written - self._read, CAPACITY - at, len(buffer))
            buffer[:n] = self.memory[self._in_base + at : self._in_base + at + n]
            buffer.release()
            self._read += n
            self._counts[self._in_read] = self._read  # the room is the writer's again
            self.protocol.buffer_updated(n)
        return True

    def _count(self, index: int, low: int, high: int) -> int | None:
        """The other side's counter ``index`` if it lies within [low, high]; else the channel is
        lost (the other side broke the protocol) and None."""
        value = self._counts[index]
        if low <= value <= high:
            return value
        self._lose(ProtocolError(f"the other side's ring counter {value} is outside [{low}, {high}]"))
        return None

    def _check_alive(self) -> None:
        """The socket carries nothing after the start: readable means the other side has gone (what
        it wrote before it went is read first)."""
        try:
            data = self.sock.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._drain()
            self._lose(error)
            return
        self._drain()
        self._lose(None if not data else ProtocolError(f"unexpected bytes on the rings' socket: {data[:16]!r}"))

    # -- the end --------------------------------------------------------------------------------------
    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self.sock.close()

    def _lose(self, error: BaseException | None) -> None:
        if not self._closing:
            self._closing = True
            self.sock.close()
            self.protocol.connection_lost(error)
