"""What every check of the judge returns: a name, pass or fail, the reasons (each naming exactly
what was wrong) and details (the margins and counts a reviewer wants to see when it passed)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from targets.printable import printable


@dataclass
class CheckResult:
    name: str
    passed: bool
    reasons: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a reason quotes what a candidate said (a controller's exception, a file's name): shown safe everywhere
        self.reasons = [printable(reason) for reason in self.reasons]

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CheckResult:
        return cls(data["name"], data["passed"], list(data.get("reasons", [])), dict(data.get("details", {})))


def detail(value) -> str:
    """A check's detail value as a reviewer reads it: numbers to three significant figures (tiny ones
    in exponent form, so 3.1e-07 is not 0), long lists cut to their first six."""
    if isinstance(value, float):
        if abs(value) >= 1e-3 or value == 0:
            return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
        return f"{value:.2e}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {detail(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list) and len(value) > 6:
        return "[" + ", ".join(detail(v) for v in value[:6]) + f", ... {len(value) - 6} more]"
    return str(value)
