"""Virtual time for asyncio: an event loop whose clock jumps to the next timer instead of waiting.

A controller written for the real cluster awaits ``asyncio.sleep``, ``asyncio.wait_for``, events
and futures; on this loop every one of those runs unchanged, and a step that takes ten simulated
minutes takes as long as the Python work in it. The loop does no I/O: its selector never blocks,
it only moves the clock forward by the timeout asyncio asks it to wait. If every coroutine waits
and no timer is pending, nothing can ever happen again, and the loop says so instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any, Awaitable


class SimulationStalled(RuntimeError):
    """Every coroutine is waiting and nothing is scheduled: the simulated run cannot progress."""


class _ClockSelector(selectors.BaseSelector):
    """A selector with no I/O: ``select(timeout)`` advances the loop's virtual clock by ``timeout``."""

    def __init__(self, loop: "VirtualTimeLoop") -> None:
        self._loop = loop
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj, events, data=None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list:
        if timeout is None:
            raise SimulationStalled(
                "every coroutine is waiting and no timer is pending: the controller awaits something the "
                "simulation never delivers (a thread, real I/O, or an event nobody sets)"
            )
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def get_map(self):
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """``time()`` is virtual seconds since the loop was made; it moves only when the loop would wait."""

    def __init__(self) -> None:
        self._virtual_now = 0.0
        super().__init__(selector=_ClockSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += seconds


class VirtualClock:
    """The harness ``Clock`` on a virtual-time loop (environments sleep on it, the trace stamps with it)."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self.loop = loop

    def now(self) -> float:
        return self.loop.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def run_virtual(main: Awaitable, loop: VirtualTimeLoop | None = None) -> Any:
    """``asyncio.run`` on a virtual-time loop."""
    loop = loop or VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
