"""What every check of the judge returns: a name, pass or fail, the reasons (each naming exactly
what was wrong) and details (the margins and counts a reviewer wants to see when it passed)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CheckResult:
    name: str
    passed: bool
    reasons: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CheckResult:
        return cls(data["name"], data["passed"], list(data.get("reasons", [])), dict(data.get("details", {})))
