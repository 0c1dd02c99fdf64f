"""The harness trace: an append-only list of ``TraceEvent`` stamped by the harness clock.

The audit and the benchmark read only this, never a candidate's own report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from targets.api import EventKind, TraceEvent
from targets.harness.clock import Clock


class Trace:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._events: list[TraceEvent] = []

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
