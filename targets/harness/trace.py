"""The harness trace: an append-only list of ``TraceEvent`` stamped by the harness clock.

The audit and the benchmark read only this, never a candidate's own report. A simulated run of a
production workload moves billions of tokens, so its trace keeps token *counts* instead of token
lists (``record_tokens=False``); everything that reads token payloads goes through ``token_count``.
A real run's trace is also written as it is recorded (``stream_to``), so a run killed midway (a GPU
stage cut at its time limit) still leaves the events up to its last step on disk.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from targets.api import EventKind, TraceEvent
from targets.harness.clock import Clock


def token_count(payload: list | int) -> int:
    """How many tokens a recorded payload holds, whether the trace kept the list or its length."""
    return payload if isinstance(payload, int) else len(payload)


def consumed_at(train: TraceEvent, trajectory: dict) -> float:
    """When a trajectory of a ``train`` event stopped being in flight: its part's start (stream
    training), else its step's."""
    return trajectory.get("consumed", train.data["start"])


class Trace:
    def __init__(self, clock: Clock, record_tokens: bool = True) -> None:
        self.clock = clock
        self.record_tokens = record_tokens
        self._events: list[TraceEvent] = []
        self._stream: IO[str] | None = None

    def tokens(self, payload: Sequence) -> list | int:
        """What to record for a token (or logprob) sequence: a copy, or only its length."""
        return list(payload) if self.record_tokens else len(payload)

    def record(self, kind: EventKind, **data: Any) -> TraceEvent:
        event = TraceEvent(kind=kind, t=self.clock.now(), data=data)
        self._events.append(event)
        if self._stream is not None:
            self._stream.write(_line(event))
            if kind in FLUSHED_AFTER:
                self._stream.flush()
        return event

    def stream_to(self, path: Path) -> None:
        """Write every event to PATH as it is recorded, until ``save``."""
        self._stream = path.open("w")
        for event in self._events:
            self._stream.write(_line(event))
        self._stream.flush()

    @property
    def events(self) -> tuple[TraceEvent, ...]:
        return tuple(self._events)

    def of_kind(self, kind: EventKind) -> Iterator[TraceEvent]:
        return (e for e in self._events if e.kind == kind)

    def save(self, path: Path) -> None:
        """Every event to PATH (a streamed file is rewritten whole: the run's final word)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        with path.open("w") as f:
            for e in self._events:
                f.write(_line(e))

    @staticmethod
    def load_events(path: Path) -> list[TraceEvent]:
        """The events of a saved trace; a line that is none raises ``ValueError`` naming it (a last line cut
        short is a run killed while it streamed)."""
        lines = path.read_text().splitlines()
        events = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                fields = json.loads(line)
            except json.JSONDecodeError as error:
                cut = " (the last, cut short: the trace of a run that did not finish)" if number == len(lines) else ""
                raise ValueError(f"line {number}{cut} is not JSON: {error.msg}") from None
            shaped = isinstance(fields, dict) and fields.keys() == {"kind", "t", "data"}
            if not shaped or not isinstance(fields["data"], dict) or not isinstance(fields["t"], int | float):
                raise ValueError(f"line {number} is no trace event ({{kind, t, data}}): {line[:120]}")
            events.append(TraceEvent(**fields))
        return events


FLUSHED_AFTER = frozenset({"train", "sync", "weight_export", "suspend", "resume", "run_start", "run_end"})


def _line(event: TraceEvent) -> str:
    return json.dumps({"kind": event.kind, "t": event.t, "data": event.data}) + "\n"
