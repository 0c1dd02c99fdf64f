"""The run's wall time, saved every few seconds while it runs.

The run state saves the time used between rounds only: a run killed mid-round lost that round's time,
so a scheduler that kills and resumes a run could overrun ``--max-minutes`` by a round each cycle. A
thread writes the time so far to its own file every ``EVERY_S``; a resumed run counts the larger of that
and what its state says (with any round recovered from git added: both are lower bounds of the truth).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

from orchestrator.state import RunStateError, write_atomically

EVERY_S = 10.0  # at most this much of a killed session's time is lost


class RunClock:
    """Writes ``seconds_used()`` to ``path`` every ``EVERY_S`` until ``stop``; a write that fails is kept
    in ``failure`` (the loop says it between rounds: a thread has no one to tell)."""

    def __init__(self, path: Path, seconds_used: Callable[[], float]) -> None:
        self.path, self.seconds_used = path, seconds_used
        self.failure: RunStateError | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="vibetrain-run-clock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(EVERY_S):
            try:
                save_time_used(self.path, self.seconds_used())
            except RunStateError as error:
                self.failure = error
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def save_time_used(path: Path, seconds: float) -> None:
    write_atomically(path, json.dumps({"seconds_used": seconds}), "the run's time used")


def load_time_used(path: Path) -> float:
    """The last time saved (0 where none was: a run from before this file, or never past its first beat)."""
    if not path.exists():
        return 0.0
    try:
        saved = json.loads(path.read_text())
    except ValueError as error:
        raise RunStateError(f"{path} is corrupt ({error}); delete it to count only the time saved by rounds") from None
    seconds = saved.get("seconds_used") if isinstance(saved, dict) else None
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
        raise RunStateError(f"{path} holds {str(saved)[:200]}, not the run's time used in seconds; delete it")
    return float(seconds)
