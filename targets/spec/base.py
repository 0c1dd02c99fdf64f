"""What every part of a target spec shares: the strict base model and the error a bad spec raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from targets.errors import UserError


class SpecError(UserError, ValueError):
    """A target spec that cannot be used; the message names the field path and the value."""


class Strict(BaseModel):
    # no float field means "unbounded" by infinity: an inf latency or bandwidth divides into a NaN, or a
    # ZeroDivisionError in a distribution's draw, far from the field that held it
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
