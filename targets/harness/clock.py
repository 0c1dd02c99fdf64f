"""The harness's clock. Real runs use wall time; the simulator (later) supplies virtual time.

Environments sleep on this clock and the trace stamps events with it, so a candidate cannot speed up
its measured time by patching ``time`` in its own process.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class WallClock:
    """Seconds since construction, from ``time.monotonic``."""

    def __init__(self) -> None:
        self._start = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._start

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
