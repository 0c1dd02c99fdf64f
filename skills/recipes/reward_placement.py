"""reward_placement: where the target's reward model (an LLM judge of each finished trajectory) runs.

``colocated`` (0, the default) leaves the judge beside the policy on the rollout engines: each
verdict is prefill and decode work on the engine that ran the episode's last turn, and the judge's
weights take room from every engine's KV cache. ``dedicated`` (1) sets the job's last
``reward_devices`` devices aside for it: they never roll out or train, and the controller places
its pools on the others. ``serverless`` (2) sends verdicts to the target's elastic service: no
device of the job's is given up, an instance's cold start is paid when the verdicts outgrow those
running, and idle ones are let go. The harness runs the judge where this says and records each
verdict; the stack only declares (``EngineSettings.reward``)."""

from __future__ import annotations

import dataclasses

from targets.api import Runtime

PLACEMENTS = ("colocated", "dedicated", "serverless")


def place_reward(runtime: Runtime, params: dict) -> tuple[Runtime, str, tuple[str, ...]]:
    """(the runtime the controller places its pools in, the placement, the devices set aside)."""
    # VAL: VAL_INT_RANGE (value=params.get("reward_placement", 0), min=0, max=2)
    where = PLACEMENTS[params.get("reward_placement", 0)]
    if where != "dedicated":
        return runtime, where, ()
    count = params.get("reward_devices", 2)
    # VAL: VAL_INT_RANGE (value=count, min=1, max=len(runtime.devices) - 2)
    kept, reserved = runtime.devices[:-count], runtime.devices[-count:]
    return dataclasses.replace(runtime, devices=kept), where, tuple(d.id for d in reserved)
