"""An engine's requests taken in the order its cluster sent them, whatever order they reach it in.

Ray starts an async actor's calls in any order (its documentation says so; on a 2-core machine with
both cores busy, 9-16% of 1,600 numbered calls from one caller started after a later one, up to 51 ms
late: benchmarks/ray_call_order.py), and an engine admits by arrival: a request delivered late joins
the batch after requests sent after it, and decodes fewer tokens than they prove it sat through (the
audit's order of service, docs/judge.md). So the cluster numbers each engine's requests 0, 1, 2, ...
as it sends them, and the engine takes a request only once every lower number has come: as a request,
or as a ``forget`` (a request the cluster cancelled, which may never come). A number not come within
``HOLE_WAIT_S`` is an error, said, not a silent hang.
"""

from __future__ import annotations

import asyncio

HOLE_WAIT_S = 60.0  # a late delivery is milliseconds; a number never sent nor forgotten is a defect


class ArrivalOrder:
    """The numbers taken so far, in order, for one engine (``name``, for messages)."""

    def __init__(self, name: str, hole_wait_s: float = HOLE_WAIT_S) -> None:
        self.name, self.hole_wait_s = name, hole_wait_s
        self.next = 0  # every lower number has been taken or forgotten
        self._settled: set[int] = set()  # numbers above ``next`` already taken or forgotten
        self._waiting: dict[int, asyncio.Future] = {}  # a number that came early -> its wake-up
        self.late = 0  # requests that came before an earlier number and waited for it (the cluster's log)

    async def turn(self, number: int) -> bool:
        """Wait until every lower number has come; False if ``number`` was forgotten before it came (its
        caller went away: it is not to be served). Whoever gets True takes its request before its next await."""
        if number < self.next or number in self._settled:
            return False
        try:
            if number > self.next:
                self.late += 1
                wake = self._waiting[number] = asyncio.get_running_loop().create_future()
                # not wait_for: on 3.11 it returns the result when a cancel and the wake-up meet, and a
                # cancelled caller would then be served
                await asyncio.wait({wake}, timeout=self.hole_wait_s)
                if not wake.done():
                    missing = self.next
                    self.forget(missing)  # said once: the requests after it go on
                    raise RuntimeError(
                        f"{self.name}: request {number} waited {self.hole_wait_s:.0f}s for request {missing}, "
                        "which the cluster numbered but neither sent nor forgot"
                    )
                if not wake.result():
                    return False  # forgotten while it waited
        except BaseException:  # cancelled or timed out: its number is settled, so later ones go on
            self._waiting.pop(number, None)
            self.forget(number)
            raise
        self.forget(number)  # taken: the same bookkeeping as a forgotten one
        return True

    def forget(self, number: int) -> None:
        """``number`` will not be taken (its caller cancelled it; one waiting is told so), or has just been:
        later ones go on."""
        if number < self.next:
            return
        self._settled.add(number)
        early = self._waiting.pop(number, None)
        if early is not None and not early.done():
            early.set_result(False)
        while self.next in self._settled:
            self._settled.discard(self.next)
            self.next += 1
        waiter = self._waiting.pop(self.next, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(True)
