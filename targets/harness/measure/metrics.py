"""Benchmark metrics, computed from the harness trace alone.

The headline is **goodput**: trajectories trained on that neither timed out nor lost their environment in a
crash, per second of the run.
An episode that finished but was never trained (dropped at the end, or stale) does not count, nor
does one that timed out: launching more episodes than training uses cannot raise it. Rollout
throughput (episodes the environments saw finish, per second; the time-sharing report's figure)
stays as a secondary metric, and so does goodput counted in the response tokens of those trajectories
(``trained_tokens_per_s``): a schedule that trains the shorter trajectories of a workload (spares keep
the first to finish, a staleness bound drops the longest-lived) raises goodput more than this. Device
activity comes from the proxy's stamps of generate/train/sync/shrink/expand.
"""

from __future__ import annotations

from collections import defaultdict

from targets.api import TraceEvent
from targets.harness.trace import token_count

ACTIVITIES = ("switching", "train", "sync", "rollout")  # priority when intervals overlap


def device_intervals(events: list[TraceEvent]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """device -> activity -> [(start, end)] relative to the run start."""
    run_start = next(e for e in events if e.kind == "run_start")
    start, engines = run_start.t, run_start.data.get("engines", {})
    out: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e.kind == "generate" and "device" in e.data:  # finished turns and interrupted segments decoded
            for device in engines.get(e.data["device"], [e.data["device"]]):  # an engine spans its devices
                out[device]["rollout"].append((e.data["start"] - start, e.t - start))
        elif e.kind in ("train", "train_part", "sync", "shrink", "expand", "suspend", "resume"):
            activity = {"train": "train", "train_part": "train", "sync": "sync"}.get(e.kind, "switching")
            for device in e.data["devices"]:
                out[device][activity].append((e.data["start"] - start, e.t - start))
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _subtract(intervals, taken) -> list[tuple[float, float]]:
    out = []
    for a, b in intervals:
        pieces = [(a, b)]
        for c, d in taken:
            pieces = [p for x, y in pieces for p in ((x, min(y, c)), (max(x, d), y)) if p[1] > p[0]]
        out += pieces
    return out


def exclusive_activity(per_activity: dict[str, list[tuple[float, float]]]) -> dict[str, list[tuple[float, float]]]:
    """Each moment counted once, under the highest-priority activity happening then."""
    taken: list[tuple[float, float]] = []
    out = {}
    for activity in ACTIVITIES:
        mine = _subtract(_union(per_activity.get(activity, [])), taken)
        out[activity] = mine
        taken = _union(taken + mine)
    return out


def failed_episodes(done: list[TraceEvent]) -> set[str]:
    """Episodes that ended without a result worth the name (from their last ``env_step``): timed
    out, or lost with their environment's state in a crash. Trained on, never goodput."""
    return {e.data["episode"] for e in done if e.data["timed_out"] or e.data.get("lost", False)}


def compute_metrics(events: list[TraceEvent], devices: list[str]) -> dict:
    start = next(e.t for e in events if e.kind == "run_start")
    end = next(e.t for e in events if e.kind == "run_end")
    duration = end - start
    steps = [e for e in events if e.kind == "env_step"]
    done = [e for e in steps if e.data["done"]]
    trains = [e for e in events if e.kind == "train"]
    failed = failed_episodes(done)
    checkpoints = [e for e in events if e.kind == "env_checkpoint"]
    trained = {t["episode"] for e in trains for t in e.data["trajectories"]}
    counted = trained - failed  # goodput's trajectories
    intervals = device_intervals(events)
    utilization = {}
    for device in devices:
        exclusive = exclusive_activity(intervals.get(device, {}))
        shares = {a: sum(b - c for c, b in exclusive[a]) / duration for a in ACTIVITIES}
        shares["idle"] = max(0.0, 1.0 - sum(shares.values()))
        shares["busy"] = 1.0 - shares["idle"]
        utilization[device] = shares

    def mean_duration(kind: str) -> float:
        spans = [e.t - e.data["start"] for e in events if e.kind == kind]
        return sum(spans) / len(spans) if spans else 0.0

    return (
        {
            "duration_s": duration,
            "goodput": len(counted) / duration,
            "rollout_throughput": len(done) / duration,
            "tokens_per_s": sum(token_count(e.data["action"]) for e in steps) / duration,
            # the goodput in response tokens: beside it, a schedule that trains shorter trajectories shows
            "trained_tokens_per_s": sum(token_count(e.data["action"]) for e in steps if e.data["episode"] in counted)
            / duration,
            "step_time_s": duration / len(trains) if trains else float("inf"),
            "timeout_ratio": sum(e.data["timed_out"] for e in done) / len(done) if done else 0.0,
            "lost_ratio": sum(e.data.get("lost", False) for e in done) / len(done) if done else 0.0,
            "checkpoint_mb": sum(e.data["mb"] for e in checkpoints) / len(done) if done else 0.0,
            "checkpoint_s": sum(e.t - e.data["start"] for e in checkpoints) / len(done) if done else 0.0,
            "trajectories": len(done),
            "mean_device_busy": sum(u["busy"] for u in utilization.values()) / len(utilization),
            "device_utilization": utilization,
            "shrink_s": mean_duration("shrink"),
            "expand_s": mean_duration("expand"),
            "sync_s": mean_duration("sync"),
            "train_s": mean_duration("train"),
            "aborted_turns": sum(1 for e in events if e.kind == "generate" and e.data["aborted"]),
        }
        | step_phases(utilization, duration, len(trains))
        | serving_metrics(events, end)
        | reward_metrics(events)
    )


def serving_metrics(events: list[TraceEvent], end: float) -> dict[str, float]:
    """A serving pool's run (``serving`` event): its traffic's p99 TTFT and TPOT, the devices lent on
    average over the run (to ``end``, the job's: the record itself comes once the traffic is served
    out), and what lending cost rollout: how often serving devices were borrowed (an expand that
    takes one) and given back (a shrink), and the turns those give-backs cut short. Nothing on a
    target without one."""
    serving = [e for e in events if e.kind == "serving"]
    if not serving:
        return {}
    s, start = serving[-1].data, events[0].t
    devices = set(s["devices"])

    def touching(kind: str) -> int:
        return sum(1 for e in events if e.kind == kind and devices & set(e.data["devices"]))

    return {
        "serving_ttft_p99_s": s["ttft_p99_s"],
        "serving_tpot_p99_s": s["tpot_p99_s"],
        "lent_devices": s["lent_device_s"] / (end - start) if end > start else 0.0,
        "serving_lends": touching("expand"),
        "serving_give_backs": touching("shrink"),
        "serving_aborted_turns": sum(
            1 for e in events if e.kind == "generate" and e.data["aborted"] and e.data.get("device") in devices
        ),
    }


def reward_metrics(events: list[TraceEvent]) -> dict[str, float]:
    """A reward model's run (``reward`` and ``reward_service`` events): the mean seconds a verdict
    took, the device-seconds the judge held beyond the job's rollout engines and its busy share of
    them. Nothing on a target without one."""
    service = [e.data for e in events if e.kind == "reward_service"]
    if not service:
        return {}
    verdicts = [e.t - e.data["start"] for e in events if e.kind == "reward"]
    return {
        "reward_verdict_s": sum(verdicts) / len(verdicts) if verdicts else 0.0,
        "judge_device_s": service[-1]["device_s"],
        "judge_utilization": service[-1]["utilization"],
    }


def step_phases(utilization: dict[str, dict[str, float]], duration: float, steps: int) -> dict[str, float]:
    """Where a step's time went, per device on average (``step_<activity>_s``; they sum to the step
    time): what ``sim/lower_bound.py``'s per-phase work is set beside."""
    if not steps:
        return {f"step_{a}_s": 0.0 for a in (*ACTIVITIES, "idle")}
    return {
        f"step_{a}_s": sum(u[a] for u in utilization.values()) / len(utilization) * duration / steps
        for a in (*ACTIVITIES, "idle")
    }
