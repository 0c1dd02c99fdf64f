"""A reward model (RollArt-like targets): an LLM judge that scores each finished trajectory before
its reward is known, and where a stack may run it (``docs/targets.md``): on the rollout engines'
devices beside the policy, on devices of the job's it sets aside, or on an elastic serverless
service that starts instances on demand (a cold start each) and lets idle ones go."""

from __future__ import annotations

from pydantic import Field

from targets.spec.base import Strict
from targets.spec.model import ModelSpec


class ServerlessSpec(Strict):
    """The elastic service a stack may send its reward requests to: instances of the reward model on
    devices outside the job's, each ready ``cold_start_s`` after it is asked for, let go after
    ``keep_warm_s`` idle, on at most ``max_devices`` devices at once; billed from its start to its release."""

    cold_start_s: float = Field(ge=0, description="seconds from asking for an instance to its first request")
    keep_warm_s: float = Field(ge=0, description="an instance idle this long is released")
    max_devices: int = Field(
        ge=1,
        description="devices its instances hold at most at once (an instance: as many as the judge's weights need)",
    )


class RewardModelSpec(Strict):
    """The judge: its model (its sizes set its cost), the tokens of its verdict, and the serverless
    service a stack may use instead of its own devices (none: colocated or dedicated only)."""

    model: ModelSpec
    output_tokens: int = Field(default=1, ge=1, description="tokens the judge generates per verdict (1: a score)")
    serverless: ServerlessSpec | None = None
