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
import heapq
import itertools
import math
import os
import select
import selectors
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

from targets.harness.strict_loop import CallbackFailed, run_strict


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


SPIN_S = 0.002  # how long a side polls for its peer before it dozes
DOZE_S = 0.001  # how long a dozing side sleeps between looks


class Polled(Protocol):
    """The peer's channel, which the loop reads itself (``channel.PolledTransport``)."""

    def poll(self) -> bool:
        """Read what has arrived and hand it on; whether anything came."""
        ...

    def fileno(self) -> int: ...


_PEER = object()  # the selector key data of the peer's socket while a wait blocks on it


def _poll_mask(events: int) -> int:
    return (select.POLLIN if events & selectors.EVENT_READ else 0) | (
        select.POLLOUT if events & selectors.EVENT_WRITE else 0
    )


class _RealSelector(selectors.BaseSelector):
    """Delegates registration to a real selector; subclasses decide how long ``select`` may block.
    The peer's channel (``loop.io``, when set) is not registered: the selector reads it itself."""

    def __init__(self, loop: VirtualTimeLoop | FollowerTimeLoop) -> None:
        self._real = selectors.DefaultSelector()
        # The same registrations, to ask "anything ready?" in one call: the selectors module's own
        # select costs a microsecond of Python each time, and the loops ask several times an instant.
        self._any = select.poll()
        self._loop = loop
        self.waited_s = 0.0  # wall seconds spent waiting for the peer (its share of a run, handoffs included)

    def register(self, fileobj, events, data=None) -> selectors.SelectorKey:
        key = self._real.register(fileobj, events, data)
        self._any.register(key.fd, _poll_mask(events))
        return key

    def unregister(self, fileobj) -> selectors.SelectorKey:
        key = self._real.unregister(fileobj)
        self._any.unregister(key.fd)
        return key

    def modify(self, fileobj, events, data=None) -> selectors.SelectorKey:
        key = self._real.modify(fileobj, events, data)
        self._any.modify(key.fd, _poll_mask(events))
        return key

    def _io_now(self) -> list:
        """The I/O ready now (without waiting)."""
        return self._real.select(0) if self._any.poll(0) else []

    def _ready_first(self, timeout: float | None) -> list | None:
        """What ``select`` returns before it considers waiting: nothing while callbacks are ready
        (they run first; I/O waits for the loop to run dry), else what the peer sent (handed on
        already: nothing to return) or the I/O ready now, if any."""
        if timeout == 0:
            return []
        io = self._loop.io
        if io is not None and io.poll():
            return []
        return self._io_now() or None

    def _wait_for_peer(self) -> list:
        """Wait until the peer sends (or other I/O is ready), polling first: under virtual time the
        two processes take turns, and the peer's answer usually comes within tens of microseconds,
        less than the kernel takes to put a process to sleep and wake it again (a blocking wait
        cost about 35 µs a round trip on a 2-core VM). Every 16th poll also looks at other I/O and
        yields the CPU, so a process that shares the core loses little. After ``SPIN_S`` without an
        answer the wait dozes: it sleeps a millisecond at a time (the peer's shared-memory ring
        wakes no one). ``waited_s`` counts until the answer is seen, not once it is handled."""
        started = time.perf_counter()
        give_up, io, polls = started + SPIN_S, self._loop.io, 0
        while True:
            looked = time.perf_counter()
            if io is not None and io.poll():
                self.waited_s += looked - started
                return []
            polls += 1
            if io is None or polls % 16 == 0:
                dozing = looked > give_up
                ready = self._doze(io) if dozing else self._io_now()
                if ready:
                    self.waited_s += time.perf_counter() - started
                    return ready
                if not dozing:
                    os.sched_yield()

    def _doze(self, io: Polled | None) -> list:
        """Sleep until other I/O is ready, the peer's socket is (it went away), or a millisecond passed."""
        if io is None:
            return self._real.select(None)
        self._real.register(io.fileno(), selectors.EVENT_READ, _PEER)
        try:
            ready = self._real.select(DOZE_S)
        finally:
            self._real.unregister(io.fileno())
        return [(key, events) for key, events in ready if key.data is not _PEER]

    def get_map(self):
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class _ClockSelector(_RealSelector):
    """Real I/O first; when nothing is ready, the harness is idle and so is its peer, advance time."""

    def select(self, timeout: float | None = None) -> list:
        if timeout == 0:  # callbacks are ready: they run first
            return []
        loop, peer = self._loop, self._loop.peer
        if loop.timer_due():  # a timer of this instant runs before anything of it leaves
            loop.timers_due = True
            return []
        if peer is not None:
            peer.flush()
        ready = self._ready_first(timeout)
        if ready is not None:
            return ready
        idle, deadline = peer.idle_until() if peer is not None else (True, None)
        if not idle:  # the controller is computing: wait for it for real
            return self._wait_for_peer()
        now, timer = loop.time(), loop.next_timer()
        until = min(
            now + timeout if timeout is not None else math.inf,
            deadline if deadline is not None else math.inf,
            timer if timer is not None else math.inf,
        )
        if until == math.inf:
            raise SimulationStalled(
                "every coroutine is waiting and no timer is pending: the controller awaits something the "
                "simulation never delivers (a thread, real I/O, or an event nobody sets)"
            )
        loop.advance(max(0.0, until - now))
        if peer is not None and deadline is not None and deadline <= until:
            peer.wake(loop.time())
        loop.timers_due = timer is not None and timer <= until
        return []


class VirtualTimer:
    """What ``call_at`` returns on a virtual-time loop (asyncio's ``TimerHandle`` protocol: ``cancel``,
    ``cancelled``, ``when``): an entry of the loop's own timer heap."""

    __slots__ = ("_when", "_callback", "_args", "_cancelled")

    def __init__(self, when: float, callback: Callable, args: tuple) -> None:
        self._when, self._callback, self._args, self._cancelled = when, callback, args, False

    def cancel(self) -> None:
        self._cancelled, self._callback, self._args = True, None, ()

    def cancelled(self) -> bool:
        return self._cancelled

    def when(self) -> float:
        return self._when


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``time()`` is virtual seconds since the loop was made; it moves only when the loop (and its
    peer, if any) would wait.

    Timers (``call_at``, and so ``call_later``, ``asyncio.sleep`` and timeouts) live in a heap of its
    own, of (when, order, timer) tuples: asyncio's ``TimerHandle`` costs a handle, a context copy and
    Python-level comparisons in its heap, and a simulated run sets several timers a trajectory-turn
    (every engine iteration chunk, every prefill, every environment step) and cancels most engine
    ones. Timers due at one instant run in the order they were set, in one callback; they run in the
    loop's context (nothing in the harness uses context variables)."""

    def __init__(self) -> None:
        self._virtual_now = 0.0
        self.peer: IdlePeer | None = None
        self.io: Polled | None = None  # the peer's channel, read by the selector itself
        self._timers: list[tuple[float, int, VirtualTimer]] = []
        self._order = itertools.count()
        self.timers_due = False  # set by the selector: ``_run_once`` runs them
        super().__init__(selector=_ClockSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += seconds

    def _run_once(self) -> None:
        """One turn: every ready callback runs, those they schedule too, in order; when none is left,
        the selector does I/O or moves time. asyncio's own turn polls the selector between batches of
        callbacks, and ours returns nothing while callbacks are ready, so draining them all runs them
        in the same order in fewer turns (a simulated run took ten turns a trajectory-turn, most of
        them to run one callback)."""
        ready = self._ready
        if not ready:
            events = self._selector.select(None)
            if self.timers_due:  # the selector found timers due now (time may have moved to them)
                self.timers_due = False
                self.run_due_timers()
            self._process_events(events)
        while ready:
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()

    def call_at(self, when: float, callback: Callable, *args: Any, context: Any = None) -> VirtualTimer:
        self._check_closed()
        timer = VirtualTimer(when, callback, args)
        heapq.heappush(self._timers, (when, next(self._order), timer))
        return timer

    def call_later(self, delay: float, callback: Callable, *args: Any, context: Any = None) -> VirtualTimer:
        return self.call_at(self._virtual_now + delay, callback, *args)

    def next_timer(self) -> float | None:
        """When the earliest pending timer is due (None: none is pending)."""
        timers = self._timers
        while timers and timers[0][2]._cancelled:
            heapq.heappop(timers)
        return timers[0][0] if timers else None

    def timer_due(self) -> bool:
        timer = self.next_timer()
        return timer is not None and timer <= self._virtual_now

    def run_due_timers(self) -> None:
        """Run every timer due now, in the order they were set (those set meanwhile for now too)."""
        timers, now = self._timers, self._virtual_now
        while timers and timers[0][0] <= now:
            timer = heapq.heappop(timers)[2]
            if timer._cancelled:
                continue
            callback, args = timer._callback, timer._args
            timer._cancelled, timer._callback, timer._args = True, None, ()  # ran: a late cancel changes nothing
            try:
                callback(*args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as error:  # as asyncio does for a callback: to the loop's handler, and on
                self.call_exception_handler({"message": "Exception in a timer callback", "exception": error})

    def close(self) -> None:
        self._timers.clear()
        super().close()

    @property
    def waited_s(self) -> float:
        """Wall seconds the harness spent waiting for the controller process."""
        return self._selector.waited_s


class _FollowerSelector(_RealSelector):
    def select(self, timeout: float | None = None) -> list:
        ready = self._ready_first(timeout)
        if ready is not None:
            return ready
        if self._loop.on_idle is not None:
            self._loop.on_idle(None if timeout is None else self._loop.time() + timeout)
            ready = self._ready_first(timeout)  # the answer may be here already
            if ready is not None:
                return ready
        return self._wait_for_peer()


class FollowerTimeLoop(asyncio.SelectorEventLoop):
    """The candidate's half: ``time()`` is the harness's virtual time as last told (``set_time``);
    ``on_idle(deadline)`` is called whenever the loop has nothing to run."""

    def __init__(self) -> None:
        self._now = 0.0
        self.on_idle: Callable[[float | None], None] | None = None
        self.io: Polled | None = None  # the harness's channel, read by the selector itself
        super().__init__(selector=_FollowerSelector(self))

    def time(self) -> float:
        return self._now

    def set_time(self, now: float) -> None:
        self._now = max(self._now, float(now))

    def _run_once(self) -> None:
        """asyncio's turn, then its turns again while callbacks are ready, each without the selector
        poll that would return nothing (``_FollowerSelector`` returns nothing while callbacks are
        ready): callbacks and timers run in asyncio's order, in fewer turns."""
        super()._run_once()
        while self._ready and not self._stopping:
            self._run_ready()

    def _run_ready(self) -> None:
        """One of asyncio's turns (``BaseEventLoop._run_once``) less the selector poll: drop cancelled
        timers, make the timers due ready, run what is ready now (what that schedules runs next turn)."""
        scheduled = self._scheduled
        while scheduled and scheduled[0]._cancelled:
            self._timer_cancelled_count -= 1
            heapq.heappop(scheduled)._scheduled = False
        end_time = self.time() + self._clock_resolution
        while scheduled and scheduled[0]._when < end_time:
            handle = heapq.heappop(scheduled)
            handle._scheduled = False
            self._ready.append(handle)
        for _ in range(len(self._ready)):
            handle = self._ready.popleft()
            if not handle._cancelled:
                handle._run()


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


class SimulationError(CallbackFailed):
    """A callback of the simulation (an engine's timer, a cluster's answer) raised: the run ends with it."""


def run_virtual(main: Awaitable, loop: VirtualTimeLoop | None = None) -> Any:
    """``asyncio.run`` on a virtual-time loop; a callback that raises ends the run with its error
    (``strict_loop.py``: the loop's default would only log it, and the simulation go on without it)."""
    with fewer_collections():
        return run_strict(main, loop or VirtualTimeLoop(), "a simulation callback", SimulationError)
