"""Virtual time for asyncio, split across two processes: the harness owns the clock, the candidate's
controller follows it.

``VirtualTimeLoop`` (harness) is an event loop whose clock jumps to the next timer instead of
waiting. Its selector still does real I/O (the channel to the controller process): while the
controller is busy the harness waits for it for real; only when the controller has said it is idle
(and has taken in every frame the harness sent) does virtual time move, to the earlier of the
harness's next timer and the controller's. Each side sends what one instant produced as one burst
when its loop runs dry, and takes in the other's bursts whole (``AsyncChannel.bursts``): a simulated
run is the same run however fast either process happens to be. ``FollowerTimeLoop`` (candidate) is
the other half: its ``time()`` is whatever the harness last said, and when it has nothing to run it
reports its next timer and waits. A controller written for the real cluster (``asyncio.sleep``,
``wait_for``, events, futures) runs unchanged; a step that takes ten simulated minutes takes as long
as the Python work in it.

If every coroutine on both sides waits and no timer is pending, nothing can ever happen again, and
the harness says so instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import selectors
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol


class SimulationStalled(RuntimeError):
    """Every coroutine is waiting and nothing is scheduled: the simulated run cannot progress."""


class IdlePeer(Protocol):
    """The harness's view of the controller process under virtual time."""

    def idle_until(self) -> tuple[bool, float | None]:
        """(idle, deadline): idle once it has taken in every frame sent to it and has nothing to run;
        deadline is its next timer (None: it waits only for the harness)."""
        ...

    def wake(self, now: float) -> None:
        """Virtual time reached the peer's deadline: tell it (it becomes busy until its next idle)."""
        ...

    def flush(self) -> None:
        """The harness ran out of callbacks: send the peer, in one burst, what this instant produced."""
        ...


SPIN_S = 0.002  # how long a side polls for its peer before it sleeps in the kernel


class _RealSelector(selectors.BaseSelector):
    """Delegates registration to a real selector; subclasses decide how long ``select`` may block."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()
        self.waited_s = 0.0  # wall seconds spent waiting for the peer (its share of a run, handoffs included)

    def register(self, fileobj, events, data=None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def _ready_first(self, timeout: float | None) -> list | None:
        """What ``select`` returns before it considers waiting: nothing while callbacks are ready
        (they run first; I/O waits for the loop to run dry), else the I/O ready now, if any."""
        if timeout == 0:
            return []
        return self._real.select(0) or None

    def _wait_for_peer(self) -> list:
        """Block until I/O is ready, polling first: under virtual time the two processes take
        turns, and the peer's answer usually comes within tens of microseconds, less than the
        kernel takes to put a process to sleep and wake it again (a blocking wait costs about 35 µs
        a round trip on a 2-core VM, polling about 9). Each poll yields the CPU, so a process that
        shares the core loses nothing; after ``SPIN_S`` without an answer the wait blocks."""
        started = time.perf_counter()
        give_up = started + SPIN_S
        while True:
            ready = self._real.select(0)
            if ready or time.perf_counter() > give_up:
                ready = ready or self._real.select(None)
                self.waited_s += time.perf_counter() - started
                return ready
            os.sched_yield()

    def get_map(self):
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class _ClockSelector(_RealSelector):
    """Real I/O first; when nothing is ready, the harness is idle and so is its peer, advance time."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list:
        peer = self._loop.peer
        if timeout != 0 and peer is not None:
            peer.flush()
        ready = self._ready_first(timeout)
        if ready is not None:
            return ready
        idle, deadline = peer.idle_until() if peer is not None else (True, None)
        if not idle:  # the controller is computing: wait for it for real
            return self._wait_for_peer()
        now = self._loop.time()
        until = min(now + timeout if timeout is not None else math.inf, deadline if deadline is not None else math.inf)
        if until == math.inf:
            raise SimulationStalled(
                "every coroutine is waiting and no timer is pending: the controller awaits something the "
                "simulation never delivers (a thread, real I/O, or an event nobody sets)"
            )
        self._loop.advance(max(0.0, until - now))
        if peer is not None and deadline is not None and deadline <= until:
            peer.wake(self._loop.time())
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``time()`` is virtual seconds since the loop was made; it moves only when the loop (and its
    peer, if any) would wait."""

    def __init__(self) -> None:
        self._virtual_now = 0.0
        self.peer: IdlePeer | None = None
        super().__init__(selector=_ClockSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += seconds

    @property
    def waited_s(self) -> float:
        """Wall seconds the harness spent waiting for the controller process."""
        return self._selector.waited_s


class _FollowerSelector(_RealSelector):
    def __init__(self, loop: FollowerTimeLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list:
        ready = self._ready_first(timeout)
        if ready is not None:
            return ready
        if self._loop.on_idle is not None:
            self._loop.on_idle(None if timeout is None else self._loop.time() + timeout)
            ready = self._real.select(0)  # the notice itself may have been written just now
            if ready:
                return ready
        return self._wait_for_peer()


class FollowerTimeLoop(asyncio.SelectorEventLoop):
    """The candidate's half: ``time()`` is the harness's virtual time as last told (``set_time``);
    ``on_idle(deadline)`` is called whenever the loop has nothing to run."""

    def __init__(self) -> None:
        self._now = 0.0
        self.on_idle: Callable[[float | None], None] | None = None
        super().__init__(selector=_FollowerSelector(self))

    def time(self) -> float:
        return self._now

    def set_time(self, now: float) -> None:
        self._now = max(self._now, float(now))


class VirtualClock:
    """The harness ``Clock`` on a virtual-time loop (environments sleep on it, the trace stamps with it)."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self.loop = loop

    def now(self) -> float:
        return self.loop.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Collect garbage less often while a simulated run goes: it makes millions of short-lived
    objects (calls, timers, frames) beside a trace that only grows, and at the default threshold
    (a collection every 700 allocations, a full one every 7,000 or so) the collector spent a
    sixth of a 160-device run re-walking the trace. Cycles are still collected, in larger batches."""
    previous = gc.get_threshold()
    gc.set_threshold(50_000, 20, 20)
    try:
        yield
    finally:
        gc.set_threshold(*previous)


def run_virtual(main: Awaitable, loop: VirtualTimeLoop | None = None) -> Any:
    """``asyncio.run`` on a virtual-time loop."""
    loop = loop or VirtualTimeLoop()
    try:
        with fewer_collections():
            return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
