"""What crosses between the harness and the process its user environments run in (``host.py``,
``hosted.py``): one JSON object a line, each one of the typed messages below, read back by ``parse``,
which checks its shape (the host runs the candidate's text: what it says is never trusted to be well
formed). A value of the user's that is no text, number or bool travels as its type's name and its repr,
so that the harness names it as it named the object itself when the environment ran in its own process
(``text_episode.py``: "observation None, not a str")."""

from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy

from targets.printable import printable

REPR_LIMIT = 1000  # characters of an unsendable value's repr: a message names it, never carries it whole

Operation = Literal["make", "reset", "step", "close", "check", "cancel"]


@dataclass(frozen=True)
class Started:
    """The host's first word, before it reads a request: its interpreter and the harness's modules are up, so
    the limit on loading an entry times the user's code alone (a loaded machine took seconds to start one)."""


@dataclass(frozen=True)
class Load:
    """The first request: the entry to load, its adapter and its params (pickled, base64: any YAML value)."""

    entry: str
    adapter: str
    params: str


@dataclass(frozen=True)
class Loaded:
    """The answer to ``Load``: whether the entry could be made, and the adapter's word when not."""

    loaded: bool
    error: str | None = None


@dataclass(frozen=True)
class Request:
    """One request after ``Load``. ``make`` (an episode's environment ``env``) and ``cancel`` (the call numbered
    ``call``) are unanswered; ``reset`` (``task``), ``step`` (``action``), ``close`` and ``check`` are answered
    under their ``id``."""

    op: Operation
    id: int | None = None
    env: int | None = None
    task: int | None = None
    action: str | None = None
    call: int | None = None


@dataclass(frozen=True)
class Step:
    """What a ``step`` call answers: the four fields of ``TextStep``, or, when the user's step returned
    something else, that value alone (``not_a_step``) for the harness to name."""

    fields: list[Any] | None = None
    not_a_step: Any = None


@dataclass(frozen=True)
class Answer:
    """The answer to the request numbered ``id``: its value (``ok``; a ``Step`` for a step), or that it was
    cancelled, or an error: ``user`` (the adapter's word) or ``raised`` (what the user's code raised: its
    type's name and message)."""

    id: int
    ok: Any = None
    step: Step | None = None
    cancelled: bool = False
    user: str | None = None
    raised: tuple[str, str] | None = None


Message = TypeVar("Message", Started, Load, Loaded, Request, Answer)


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
        return type(printable(str(value.get("type"))), (), {"__repr__": lambda self: text})()  # a NUL: no type
    return value


def encode(message: Started | Load | Loaded | Request | Answer) -> bytes:
    """One line: the message's fields, every one (an unset one as null)."""
    return (json.dumps(dataclasses.asdict(message)) + "\n").encode()


def parse(line: bytes, kind: type[Message]) -> Message:
    """The ``kind`` of message ``line`` is, its shape checked; ``ValueError`` names what is out of protocol."""
    data = json.loads(line)
    names = [f.name for f in dataclasses.fields(kind)]
    if not isinstance(data, dict) or sorted(data) != sorted(names):
        raise ValueError(f"the {kind.__name__} message has the fields {', '.join(names)}: {line[:200]!r}")
    for name, value in data.items():
        if not _fits(value, _TYPES[kind][name]):
            raise ValueError(f"the {kind.__name__} message's {name} is {value!r:.200}")
    if kind is Request and data["op"] not in Operation.__args__:
        raise ValueError(f"a request's op is {data['op']!r:.200}")
    if kind is Answer:
        return _answer(data)
    return kind(**data)


# what each field may be: a JSON type, "int" an int that is no bool, None where it may be null
_TYPES: dict[type, dict[str, tuple[Any, ...]]] = {
    Started: {},
    Load: {"entry": (str,), "adapter": (str,), "params": (str,)},
    Loaded: {"loaded": (bool,), "error": (str, None)},
    Request: {
        "op": (str,),
        "id": ("int", None),
        "env": ("int", None),
        "task": ("int", None),
        "action": (str, None),
        "call": ("int", None),
    },
    Answer: {
        "id": ("int",),
        "ok": (object,),
        "step": (dict, None),
        "cancelled": (bool,),
        "user": (str, None),
        "raised": (list, None),
    },
}


def _fits(value: Any, kinds: tuple[Any, ...]) -> bool:
    if value is None:
        return None in kinds or object in kinds
    if "int" in kinds and isinstance(value, int) and not isinstance(value, bool):
        return True
    return any(isinstance(kind, type) and isinstance(value, kind) for kind in kinds)


def _answer(data: dict) -> Answer:
    raised, step = data["raised"], data["step"]
    if raised is not None and not (len(raised) == 2 and all(isinstance(part, str) for part in raised)):
        raise ValueError(f"an answer's raised is {raised!r:.200}")
    if step is not None:
        fields = step.get("fields")
        four = fields is None or (isinstance(fields, list) and len(fields) == 4)
        if sorted(step) != ["fields", "not_a_step"] or not four:
            raise ValueError(f"an answer's step is {step!r:.200}")
        step = Step(**step)
    settled = (
        data["ok"] is not None,
        step is not None,
        data["cancelled"],
        data["user"] is not None,
        raised is not None,
    )
    if sum(settled) > 1:
        raise ValueError(f"an answer is a value, a cancel or an error, one of them: {data!r:.200}")
    return Answer(**{**data, "step": step, "raised": tuple(raised) if raised is not None else None})
