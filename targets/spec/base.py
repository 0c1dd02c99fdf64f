"""What every part of a target spec shares: the strict base model and the error a bad spec raises."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from targets.errors import UserError


class SpecError(UserError, ValueError):
    """A target spec that cannot be used; the message names the field path and the value."""


class Strict(BaseModel):
    # no float field means "unbounded" by infinity: an inf latency or bandwidth divides into a NaN, or a
    # ZeroDivisionError in a distribution's draw, far from the field that held it
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_yes_no_for_a_number(cls, data: Any) -> Any:
        """``train_steps: true`` validated as 1 (pydantic reads a bool as an int): a number field takes numbers."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and _a_number(field.annotation):
                    raise ValueError(f"{name}: {value!r} is a yes/no, not a number")
        return data


def _a_number(annotation: Any) -> bool:
    """An ``int`` or ``float`` field (or one of them or None) that takes no bool."""
    options = (
        set(typing.get_args(annotation))
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else {annotation}
    )
    return bool(options & {int, float}) and bool not in options
