"""Running the harness's event loop so that a callback that raises ends the run with its error.

asyncio's default handler only logs an exception raised in a plain callback (a timer, a future's done
callback): the harness would go on without what the callback did (a reply never sent, an event never
recorded), and a real run would then wait out its time limit while the candidate is blamed for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


class CallbackFailed(RuntimeError):
    """A callback on the harness's loop raised: the run ends with it."""


def run_strict(
    main: Awaitable, loop: asyncio.AbstractEventLoop, what: str = "a harness callback", error=CallbackFailed
) -> Any:
    """``asyncio.run(main)`` on ``loop`` (its tasks cancelled, its executor shut down and the loop closed
    at the end, as ``asyncio.run`` does). The first callback to raise cancels ``main`` and is raised as
    ``error`` (a ``CallbackFailed``), whatever the cancelled run's cleanup raised after it."""
    failures: list[BaseException] = []
    running: list[asyncio.Task] = []

    async def watched() -> Any:
        running.append(asyncio.current_task())
        return await main

    def on_exception(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exception = context.get("exception")
        if exception is None or not context.get("message", "").startswith("Exception in"):
            loop.default_exception_handler(context)  # not a callback's failure (a task's, reported at collection)
            return
        failures.append(exception)
        if running and not running[0].done():
            running[0].cancel()

    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        runner.get_loop().set_exception_handler(on_exception)
        try:
            result = runner.run(watched())
        except BaseException:  # the cancel, or whatever the run's cleanup raised after it: the callback's first
            if not failures:
                raise
    if failures:
        raise error(f"{what} raised {failures[0]!r}") from failures[0]
    return result
