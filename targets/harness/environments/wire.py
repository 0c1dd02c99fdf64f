"""What crosses between the harness and the process its user environments run in (``host.py``,
``hosted.py``): one JSON object a line. A value of the user's that is no text, number or bool travels
as its type's name and its repr, so that the harness names it as it named the object itself when the
environment ran in its own process (``text_episode.py``: "observation None, not a str")."""

from __future__ import annotations

import json
import numbers
from typing import Any

import numpy

REPR_LIMIT = 1000  # characters of an unsendable value's repr: a message names it, never carries it whole


def to_wire(value: Any) -> Any:
    """``value`` as JSON can carry it: text, bools and numbers as themselves (numpy's as Python's, which the
    harness reads alike), anything else as ``{"type": ..., "repr": ...}``."""
    if isinstance(value, bool | numpy.bool_):
        return bool(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)  # NaN and infinities too: json writes and reads them, the harness refuses them
    return {"type": type(value).__name__, "repr": repr(value)[:REPR_LIMIT]}


def from_wire(value: Any) -> Any:
    """What ``to_wire`` sent: a stand-in of the same type name and repr for a value that could not travel."""
    if isinstance(value, dict):
        text = str(value.get("repr"))
        return type(str(value.get("type")), (), {"__repr__": lambda self: text})()
    return value


def encode(message: dict) -> bytes:
    return (json.dumps(message) + "\n").encode()


def decode(line: bytes) -> dict:
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError(f"a message of the environment host is a JSON object, not {line[:200]!r}")
    return message
