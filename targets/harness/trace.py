"""The harness trace: an append-only list of ``TraceEvent`` stamped by the harness clock.

The audit and the benchmark read only this, never a candidate's own report. A simulated run of a
production workload moves billions of tokens, so its trace keeps token *counts* instead of token
lists (``record_tokens=False``); everything that reads token payloads goes through ``token_count``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from targets.api import EventKind, TraceEvent
from targets.harness.clock import Clock


def token_count(payload: list | int) -> int:
    """How many tokens a recorded payload holds, whether the trace kept the list or its length."""
    return payload if isinstance(payload, int) else len(payload)


class Trace:
    def __init__(self, clock: Clock, record_tokens: bool = True) -> None:
        self.clock = clock
        self.record_tokens = record_tokens
        self._events: list[TraceEvent] = []

    def tokens(self, payload: Sequence) -> list | int:
        """What to record for a token (or logprob) sequence: a copy, or only its length."""
        return list(payload) if self.record_tokens else len(payload)

    def record(self, kind: EventKind, **data: Any) -> TraceEvent:
        event = TraceEvent(kind=kind, t=self.clock.now(), data=data)
        self._events.append(event)
        return event

    @property
    def events(self) -> tuple[TraceEvent, ...]:
        return tuple(self._events)

    def of_kind(self, kind: EventKind) -> Iterator[TraceEvent]:
        return (e for e in self._events if e.kind == kind)

    def save(self, path: Path) -> None:
        with path.open("w") as f:
            for e in self._events:
                f.write(json.dumps({"kind": e.kind, "t": e.t, "data": e.data}) + "\n")

    @staticmethod
    def load_events(path: Path) -> list[TraceEvent]:
        return [TraceEvent(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
