"""The only way candidate code and the harness talk: frames over a connected Unix socket.

A frame is a JSON header plus binary blobs (token and logprob arrays, weights as safetensors)::

    [u32 header length][header JSON, with "blobs": [size, ...]][blob 0][blob 1] ...

Nothing is pickled: the harness decodes only JSON, numeric arrays of a fixed dtype and safetensors,
so whatever a candidate sends is data, never code. ``SyncChannel`` serves request/response links
(the accuracy checks' components); ``AsyncChannel`` serves links where both sides send at once (a
controller's many concurrent calls) on any asyncio loop, the virtual-time ones included: it parses
frames as bytes arrive and hands each to a callback at once, and it can hold its writes back
(``cork``) until its loop has nothing left to do, so a burst of calls crosses in one write.
"""

from __future__ import annotations

import asyncio
import math
import mmap
import select
import socket
import struct
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from targets.harness.ipc.protocol import ProtocolError
from targets.harness.ipc.shared_ring import RingTransport

HEADER = struct.Struct("!I")
MAX_HEADER_BYTES = 64 << 20
MAX_FRAME_BYTES = 64 << 30
DTYPES = {"i4": np.int32, "f8": np.float64, "u1": np.uint8}


class Frame:
    """A header under construction, with the blobs its arrays refer to."""

    def __init__(self, **header: Any) -> None:
        self.header = header
        self.blobs: list[bytes] = []

    def blob(self, data: bytes) -> dict:
        self.blobs.append(bytes(data))
        return {"$blob": len(self.blobs) - 1}

    def array(self, values, dtype: str) -> dict:
        """A list of numbers as a typed array (4 or 8 bytes a number instead of JSON text)."""
        ref = self.blob(np.asarray(values, dtype=DTYPES[dtype]).tobytes())
        return {**ref, "dtype": dtype}

    def encode(self) -> bytes:
        self.header["blobs"] = [len(b) for b in self.blobs]
        header = orjson.dumps(self.header, option=orjson.OPT_SERIALIZE_NUMPY)
        return b"".join([HEADER.pack(len(header)), header, *self.blobs])


class Received:
    """A decoded frame: its header and blobs, with checked accessors for what the header refers to."""

    def __init__(self, header: dict, blobs: list[bytes]) -> None:
        self.header, self.blobs = header, blobs

    def __getitem__(self, key: str) -> Any:
        return self.header[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.get(key, default)

    def blob(self, ref: Any) -> bytes:
        if not (isinstance(ref, dict) and isinstance(ref.get("$blob"), int) and 0 <= ref["$blob"] < len(self.blobs)):
            raise ProtocolError(f"expected a blob reference, got {str(ref)[:80]}")
        return self.blobs[ref["$blob"]]

    def array(self, ref: Any, dtype: str) -> np.ndarray:
        data = self.blob(ref)
        if ref.get("dtype") != dtype:
            raise ProtocolError(f"expected an array of {dtype}, got {ref.get('dtype')!r}")
        if len(data) % np.dtype(DTYPES[dtype]).itemsize:
            raise ProtocolError(f"an array of {dtype} cannot be {len(data)} bytes long")
        return np.frombuffer(data, dtype=DTYPES[dtype])

    def ints(self, ref: Any) -> list[int]:
        return self.array(ref, "i4").tolist()

    def logprobs(self, ref: Any, what: str) -> np.ndarray:
        """Log-probabilities: float64, every one finite. A NaN compares false with any tolerance, so
        one let through would switch off the checks that compare logprobs (the audit's, the replay's)."""
        values = self.array(ref, "f8")
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise ProtocolError(
                f"{what}.logprobs: {bad.size} non-finite value(s), the first {values[bad[0]]} at position {bad[0]}"
            )
        return values


def _header(data: bytes | bytearray | memoryview) -> tuple[dict, int]:
    """The header and the total size of the blobs it announces."""
    try:
        header = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise ProtocolError(f"a frame header is not JSON: {error}") from None
    sizes = header.get("blobs") if type(header) is dict else None
    if type(sizes) is not list:
        raise ProtocolError("a frame header must be a JSON object with a list of blob sizes")
    total = 0
    for n in sizes:
        if type(n) is not int or n < 0:  # (a bool is not an int here)
            raise ProtocolError("a frame header must be a JSON object with a list of blob sizes")
        total += n
    if total > MAX_FRAME_BYTES:
        raise ProtocolError(f"a frame of {total} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return header, total


def _split(header: dict, body: bytes | bytearray | memoryview) -> list[bytes]:
    if not header["blobs"]:
        return []
    blobs, at = [], 0
    for size in header["blobs"]:
        blobs.append(bytes(body[at : at + size]))
        at += size
    return blobs


def _header_length(data: bytes | bytearray) -> int:
    (length,) = HEADER.unpack_from(data, 0)
    if length > MAX_HEADER_BYTES:
        raise ProtocolError(f"a frame header of {length} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    return length


# The channel's own markers (``AsyncChannel.bursts``), never counted as frames: header lengths no
# header can have, so a burst ends without a header to parse. The idle one carries the sender's idle
# notice (how many frames it has taken in; its next timer, NaN for none).
_BURST_END = 0xFFFFFFFF
_BURST_END_BYTES = HEADER.pack(_BURST_END)
_IDLE_END = 0xFFFFFFFE
IDLE = struct.Struct("!Qd")


class SyncChannel:
    """Blocking frames over a socket: one side asks, the other answers, never both at once."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock

    def send(self, frame: Frame) -> None:
        self.sock.sendall(frame.encode())

    def _exactly(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self.sock.recv(min(left, 1 << 22))
            if not chunk:
                raise ProtocolError("the peer closed the channel")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def recv(self) -> Received:
        header, total = _header(self._exactly(_header_length(self._exactly(HEADER.size))))
        return Received(header, _split(header, self._exactly(total)))

    def close(self) -> None:
        self.sock.close()


class PolledTransport:
    """A transport its event loop drives itself (``poll``), for the virtual-time loops: asyncio's own
    costs a handle, a selector round and several calls per read, more than a simulated burst's
    frames cost to handle, twice a trajectory-turn on each side. Writes go out at once; what the
    socket will not take waits here and goes out at the next write or poll, in order."""

    def __init__(self, sock: socket.socket, protocol: AsyncChannel) -> None:
        self.sock, self.protocol = sock, protocol
        self._unsent = b""
        self._closing = False
        self._readable = select.epoll()  # asked before each read: a read of nothing raises, dearer
        self._readable.register(sock.fileno(), select.EPOLLIN)

    def fileno(self) -> int:
        return self.sock.fileno()

    def is_closing(self) -> bool:
        return self._closing

    def write(self, data: bytes) -> None:
        data = self._unsent + data if self._unsent else data
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as error:
            self._lose(error)
            return
        self._unsent = data[sent:]

    def poll(self) -> bool:
        """Send what waits, read what has arrived and hand it to the protocol; whether anything came
        (or the channel closed: nothing more will come, so nothing to wait for)."""
        if self._closing:
            return True  # nothing more will come: nothing to wait for
        if self._unsent:
            self.write(b"")
        if not self._readable.poll(0):
            return False
        got = False
        while not self._closing:
            buffer = self.protocol.get_buffer(-1)
            try:
                count = self.sock.recv_into(buffer)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as error:
                self._lose(error)
                return True
            finally:
                buffer.release()  # the protocol's buffer may grow at the next read
            if count == 0:
                self._lose(None)
                return True
            self.protocol.buffer_updated(count)
            got = True
        return got

    def close(self) -> None:
        """Close, sending what waits first (blocking, briefly: the peer may have gone)."""
        if self._closing:
            return
        self._closing = True
        if self._unsent:
            try:
                self.sock.settimeout(5.0)
                self.sock.sendall(self._unsent)
            except OSError as error:  # the peer is gone: what it did not take is lost with it
                print(f"channel: {len(self._unsent)} bytes unsent at close: {error}", file=sys.stderr)
        self._readable.close()
        self.sock.close()

    def _lose(self, error: BaseException | None) -> None:
        self._closing = True
        self._readable.close()
        self.sock.close()
        self.protocol.connection_lost(error)


class AsyncChannel(asyncio.BufferedProtocol):
    """Frames on an asyncio loop. Each complete frame goes to ``on_frame`` (once set; frames that
    arrive before wait in a queue for ``recv``). ``send`` never blocks: the transport buffers, or,
    while ``corked``, the channel does until ``flush``. Bytes are read into one reusable buffer
    (a fresh 256 KiB object per read would cost more than the rest of a small frame's handling).

    With ``bursts`` (both ends, under virtual time) each ``flush`` ends with a marker and frames are
    handed on a whole burst at a time, however the socket splits the bytes: a peer then sees the
    other's frames of one instant together, never half of them with its own callbacks run between,
    so how fast each process happens to run cannot change what a simulated run does."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.on_frame: Callable[[Received], None] | None = None
        self.on_lost: Callable[[BaseException], None] | None = None
        self.on_idle: Callable[[int, float | None], None] | None = None  # a burst's idle notice (see flush)
        self._early_idle: tuple[int, float | None] | None = None
        self.sent = 0  # frames sent (the virtual-time handshake counts them)
        self.received = 0  # frames handed on
        self.corked = False
        self.bursts = False
        self._held: list[Received] = []  # with ``bursts``: this burst's frames, until its marker
        self._out: list[bytes] = []
        self._buffer = bytearray(1 << 16)
        self._filled = 0  # bytes of _buffer holding data not yet parsed
        self._pending: tuple[int, dict, int] | None = None  # a parsed header waiting for its blobs
        self._queue: deque[Received] = deque()
        self._waiter: asyncio.Future | None = None
        self._lost: BaseException | None = None
        self._sock: socket.socket | None = None

    @classmethod
    async def over(cls, sock: socket.socket) -> AsyncChannel:
        sock.setblocking(False)
        _, channel = await asyncio.get_running_loop().create_unix_connection(cls, sock=sock)
        channel._sock = sock
        return channel

    @classmethod
    def polled(cls, sock: socket.socket, rings: tuple[mmap.mmap, int] | None = None) -> AsyncChannel:
        """A channel that its virtual-time loop drives itself (``transport.poll()``): over shared-memory
        rings (``rings``: the region and this process's side, see ``shared_ring``), else over ``sock``."""
        channel = cls()
        if rings is None:
            sock.setblocking(False)
            channel._sock = sock
            channel.connection_made(PolledTransport(sock, channel))
        else:
            channel.connection_made(RingTransport(sock, rings[0], rings[1], channel))
        return channel

    # -- asyncio.BufferedProtocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        free = len(self._buffer) - self._filled
        if free < 4096:  # grow (a big frame is arriving): at least double
            self._buffer.extend(bytes(max(len(self._buffer), 1 << 16)))
        return memoryview(self._buffer)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        filled = self._filled = self._filled + nbytes
        buffer, start, bursts = self._buffer, 0, self.bursts
        view = memoryview(buffer)
        try:
            while True:
                available = filled - start
                if self._pending is None:
                    if available < 4:
                        break
                    (length,) = HEADER.unpack_from(buffer, start)
                    if bursts and length == _BURST_END:
                        start += 4
                        self._end_burst()
                        continue
                    if bursts and length == _IDLE_END:
                        if available < 4 + IDLE.size:
                            break
                        received, deadline = IDLE.unpack_from(buffer, start + 4)
                        start += 4 + IDLE.size
                        self._end_burst()
                        self._idle(received, deadline)
                        continue
                    if length > MAX_HEADER_BYTES:
                        _header_length(view[start : start + 4])  # raises, naming the limit
                    if available < 4 + length:
                        break
                    header, total = _header(view[start + 4 : start + 4 + length])
                    self._pending = (4 + length, header, total)
                offset, header, total = self._pending
                if available < offset + total:
                    break
                blobs = _split(header, view[start + offset : start + offset + total])
                start += offset + total
                self._pending = None
                if bursts:
                    self._held.append(Received(header, blobs))
                else:
                    self._hand_on(Received(header, blobs))
        except ProtocolError as error:
            self._lose(error)
            self.transport.close()
        finally:
            view.release()
            if start == self._filled:
                self._filled = 0
            elif start:  # keep only the unparsed tail, at the front
                buffer[: self._filled - start] = buffer[start : self._filled]
                self._filled -= start
            if self._filled == 0 and len(buffer) > 1 << 20:
                self._buffer = bytearray(1 << 16)  # a big frame has gone: give its room back

    def connection_lost(self, exc: BaseException | None) -> None:
        if exc is not None:
            self._drain_unread()
        self._lose(ProtocolError("the peer closed the channel" + (f" ({exc})" if exc else "")))

    def _drain_unread(self) -> None:
        """A failed write (the peer has exited) closes the transport before it read what the peer
        sent last (its "done", say): read that from the socket, still open here, before losing it."""
        if self._sock is None or self._sock.fileno() < 0:
            return
        while self._lost is None:
            buffer = self.get_buffer(-1)
            try:
                count = self._sock.recv_into(buffer)
            except OSError:  # nothing more to read (would block, or reset)
                return
            if count == 0:
                return
            self.buffer_updated(count)

    # -- frames ------------------------------------------------------------------------------------------
    def _end_burst(self) -> None:
        held, self._held = self._held, []
        for each in held:
            self._hand_on(each)

    def _idle(self, received: int, deadline: float) -> None:
        if math.isinf(deadline):
            raise ProtocolError(f"an idle notice with deadline {deadline}")
        notice = (received, None if math.isnan(deadline) else deadline)
        if self.on_frame is None:  # not listening yet: the latest notice waits for ``listen``
            self._early_idle = notice
        elif self.on_idle is None:
            raise ProtocolError("an idle notice on a channel that takes none")
        else:
            self.on_idle(*notice)

    def _hand_on(self, rx: Received) -> None:
        self.received += 1
        if self.on_frame is not None and not self._queue:
            self.on_frame(rx)
            return
        self._queue.append(rx)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _lose(self, error: BaseException) -> None:
        held, self._held = self._held, []
        for each in held:  # a burst cut short by the peer's exit: what it did send still counts
            self._hand_on(each)
        if self._lost is None:
            self._lost = error
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)
            if self.on_lost is not None:
                self.on_lost(error)

    def listen(
        self,
        on_frame: Callable[[Received], None],
        on_lost: Callable[[BaseException], None],
        on_idle: Callable[[int, float | None], None] | None = None,
    ) -> None:
        """Hand every frame (those queued first) to ``on_frame``; ``on_lost`` when the peer goes;
        ``on_idle`` each idle notice that ends a burst (the latest one that came before, first)."""
        self.on_frame, self.on_lost, self.on_idle = on_frame, on_lost, on_idle
        while self._queue:
            on_frame(self._queue.popleft())
        if self._early_idle is not None and on_idle is not None:
            on_idle(*self._early_idle)
        self._early_idle = None
        if self._lost is not None:
            on_lost(self._lost)

    async def recv(self) -> Received:
        while not self._queue:
            if self._lost is not None:
                raise self._lost
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._queue.popleft()

    @property
    def closing(self) -> bool:
        """Whether a frame sent now would go nowhere: the peer is lost, or the transport is closing
        (a failed write closes it before ``connection_lost`` reads what the peer sent last)."""
        return self._lost is not None or self.transport is None or self.transport.is_closing()

    def send(self, frame: Frame) -> None:
        if self.closing:
            raise ProtocolError("the channel is closed")
        data = frame.encode()
        self.sent += 1
        if self.corked:
            self._out.append(data)
        else:
            self.transport.write(data)

    def flush(self, idle: tuple[int, float | None] | None = None) -> None:
        """Send what was held back; with ``bursts``, as one burst, its end marked. ``idle``: end it with
        this side's idle notice instead (frames it has taken in, its next timer), sent even if the
        burst holds no frame."""
        if (self._out or idle is not None) and self.transport is not None and not self.transport.is_closing():
            if idle is not None:
                received, deadline = idle
                marker = HEADER.pack(_IDLE_END) + IDLE.pack(received, math.nan if deadline is None else deadline)
                self._out.append(marker)
            elif self.bursts:
                self._out.append(_BURST_END_BYTES)
            self.transport.write(b"".join(self._out))
        self._out.clear()

    async def close(self) -> None:
        self.flush()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
