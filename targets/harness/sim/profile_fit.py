"""The workload a real run's trace shows, fitted for the simulator: the response lengths the
calibration writes into a twin, and a whole workload profile (``vibetrain workload profile``; the
fragment's format is ``targets/workload_profile.py``'s).

* **response lengths** (``workload.tokens.response_length``): the mean tokens a completed turn
  generated, and the log-space spreads by moments: ``turn_sigma^2`` the mean variance of log lengths
  within a group, ``task_sigma^2`` the variance of the groups' mean log lengths less
  ``turn_sigma^2 / turns per group`` (at least 0). Turns cut at the budget count at the budget, so a
  model that often runs to its budget gets spreads on the low side; the profile records the share
  that did (``samples.turns_at_budget``), and a spec with a larger budget refuses a profile where it
  is over 1% (what the policy does past the measured budget was never seen).
* **the profile**, from the episodes the runs finished and the steps the harness timed in them: the
  turn count of those the environment ended itself, and of those the turn cap ended at the cap (how
  many, said: what the environment does past it was never seen) (``fixed`` when all took as many, else the
  counts seen, each as likely (``empirical``: a lognormal lost a second peak, 2.4x the work); an episode cut by
  the trajectory timeout or the context window is the simulation's to cut again), the mean prompt and
  observation lengths, the response lengths above (the policy's: the fragment names the model, tokenizer and
  budget), the latency of the steps no failure slowed (lognormal) and its largest, and the failure rate (failed
  attempts over attempts; a user's environment that raises fails its run instead, so its rate is 0).
  The fragment says how many samples are behind each.

Several runs pool their samples (a group is a task of its own run).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict

from targets.api import TraceEvent
from targets.harness.environments.pool import group_of
from targets.harness.trace import token_count
from targets.spec import ResponseLengthSpec, TargetSpec
from targets.spec.workload import LENGTH_SIGMA_MAX
from targets.workload_profile import MEASURED

STAND_IN = {"name": "synthetic_agent"}  # plays a profiled environment in simulation: its shape, not its text


class ProfileError(ValueError):
    """The runs hold too little to fit a profile from (no finished episode)."""


def _whole_turns(runs: list[list[TraceEvent]]):
    """(run, episode, tokens) of each turn the runs completed whole (neither aborted nor a resumed
    remainder) and that generated something."""
    for run, events in enumerate(runs):
        for e in events:
            if e.kind == "generate" and not e.data["aborted"] and not e.data.get("continues"):
                n = token_count(e.data["tokens"])
                if n:
                    yield run, e.data["episode"], n


def response_lengths(spec: TargetSpec, runs: list[list[TraceEvent]]) -> ResponseLengthSpec | None:
    """The response-length model fitted to the turns the runs completed whole (see the module doc)."""
    budget = spec.workload.tokens.response
    by_group: dict[tuple[int, str], list[float]] = defaultdict(list)
    lengths = []
    for run, episode, n in _whole_turns(runs):
        lengths.append(n)
        by_group[run, group_of(episode)].append(math.log(n))
    if not lengths:
        return None

    def variance(xs: list[float]) -> float:
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)

    groups = [g for g in by_group.values() if len(g) > 1]
    turn_var = sum(variance(g) for g in groups) / len(groups) if groups else 0.0
    means = [sum(g) / len(g) for g in by_group.values()]
    per_group = sum(len(g) for g in by_group.values()) / len(by_group)
    task_var = max(0.0, variance(means) - turn_var / per_group) if len(means) > 1 else 0.0
    mean = sum(lengths) / len(lengths)
    if turn_var + task_var == 0 or mean >= budget:
        return ResponseLengthSpec(mean=min(mean, budget))  # every turn alike: no spread to fit
    # a few small groups of lengths 1 and 1000 spread wider than any model of a tail is asked to: held
    # at the spec's cap (a spread of e^3 a standard deviation), which the calibration notes say
    task_sigma, turn_sigma = (min(LENGTH_SIGMA_MAX, math.sqrt(v)) for v in (task_var, turn_var))
    return ResponseLengthSpec(mean=mean, task_sigma=task_sigma, turn_sigma=turn_sigma)


def share_at_budget(spec: TargetSpec, runs: list[list[TraceEvent]]) -> float:
    """The share of whole turns that ran to the response budget: their lengths past it were never
    seen, so a spec with a larger budget cannot take the fit as measured (``workload_profile.py``)."""
    lengths = [n for _, _, n in _whole_turns(runs)]
    budget = spec.workload.tokens.response
    return sum(n >= budget for n in lengths) / len(lengths) if lengths else 0.0


def held_spread(lengths: ResponseLengthSpec) -> list[str]:
    """A note when the fit held a spread at the spec's cap (none otherwise)."""
    if LENGTH_SIGMA_MAX not in (lengths.task_sigma, lengths.turn_sigma):
        return []
    return [f"response lengths spread wider than the simulator models: their sigma held at {LENGTH_SIGMA_MAX:g}"]


def _spread(logs: list[float]) -> float:
    return round(statistics.pstdev(logs), 4) if len(logs) > 1 else 0.0


def _lognormal(values: list[float]) -> dict:
    logs = [math.log(v) for v in values if v > 0]
    if not logs:
        return {"kind": "fixed", "value": 0.0}
    return {"kind": "lognormal", "median": round(math.exp(statistics.median(logs)), 6), "sigma": _spread(logs)}


def lengths_yaml(lengths: ResponseLengthSpec) -> dict:
    """Response lengths as a spec writes them: rounded down, since a mean rounded up to the budget
    would no longer be one a spread reaches."""
    return {k: math.floor(v * 1e4) / 1e4 for k, v in lengths.model_dump().items()}


def fit_profile(
    spec: TargetSpec, runs: list[list[TraceEvent]], measured_on: str, lengths: ResponseLengthSpec | None = None
) -> dict:
    """The profile fragment of real runs of ``spec``'s environment (see the module doc); ``lengths``:
    the runs' response lengths, where the caller has fitted them already."""
    steps: dict[tuple[int, str], list[TraceEvent]] = defaultdict(list)
    resets: dict[tuple[int, str], TraceEvent] = {}
    for run, events in enumerate(runs):
        for e in events:
            if e.kind == "env_step":
                steps[run, e.data["episode"]].append(e)
            elif e.kind == "env_reset":
                resets[run, e.data["episode"]] = e
    finished = [key for key, taken in steps.items() if taken[-1].data["done"] and key in resets]
    # the turn count is the environment's where the episode ended by itself (not cut by the clock, the
    # context window or a crash that lost its state, which the simulation applies again under its own
    # budgets and rates; a trace from before env_state has no "lost")
    ended = [key for key in finished if not _cut(steps[key][-1].data)]
    # those the turn cap ended count at the cap (as lengths cut at the budget count at the budget): how
    # many said, since what the environment does past the cap was never seen
    capped = [key for key in ended if steps[key][-1].data.get("capped", False)]
    # likewise those the environment's own limit ended (gymnasium's truncated): its play would have gone on
    limited = [key for key in ended if steps[key][-1].data.get("env_truncated", False)]
    if len(capped) + len(limited) == len(ended):
        cut = [steps[key][-1].data for key in finished if _cut(steps[key][-1].data)]
        timed_out = sum(bool(d["timed_out"]) for d in cut)
        full = sum(bool(d["truncated"]) and not d["timed_out"] for d in cut)
        lost = sum(bool(d.get("lost")) for d in cut)
        unfinished = len(set(resets) - set(finished))  # reset, never ended (the run's end cut them off)
        why = [f"{len(capped)} ran to workload.turns.max, {spec.workload.turns.max}: raise it"] if capped else []
        why += [f"the environment truncated {len(limited)} (a limit of its own): raise it"] if limited else []
        why += [f"{timed_out} timed out (workload.trajectory_timeout_s, a step slower than it?)"] if timed_out else []
        why += [f"{full} filled the context (workload.tokens.max_sequence)"] if full else []
        why += [f"{lost} lost their state in a crash"] if lost else []
        why += [f"{unfinished} never finished in the run"] if unfinished and not why else []
        raise ProfileError(
            "the run finished no episode by the environment's own end"
            + (f" ({'; '.join(why)})" if why else "")
            + ": nothing to fit a profile from"
        )
    turns = [len(steps[key]) for key in ended]
    taken = [s for key in finished for s in steps[key]]
    observations = [token_count(s.data["observation"]) for s in taken if not s.data["done"]]
    # a failed attempt's restart is in its step's latency, and the simulator adds it again from the rate
    latencies = [s.data["latency"] for s in taken if not s.data["failures"]]
    failures = sum(s.data["failures"] for s in taken)
    tokens: dict = {
        "prompt": max(1, round(statistics.fmean(token_count(resets[key].data["observation"]) for key in finished))),
        "observation": max(1, round(statistics.fmean(observations))) if observations else 1,
    }
    lengths = lengths or response_lengths(spec, runs)
    notes = []
    if capped:
        notes.append(
            f"{len(capped)} of {len(ended)} episodes ran to workload.turns.max ({spec.workload.turns.max}) without the "
            "environment ending them: counted at the cap; what it does past the cap was never seen (profile with a "
            "larger turns.max to see it)"
        )
    if limited:
        notes.append(
            f"{len(limited)} of {len(ended)} episodes the environment truncated (a limit of its own, such as "
            "gymnasium's TimeLimit): counted at their length; what its play does past the limit was never seen"
        )
    reset_s = [resets[key].data["latency"] for key in finished if "latency" in resets[key].data]
    if lengths is not None:
        tokens["response_length"] = lengths_yaml(lengths)
        notes += held_spread(lengths)
    drawn = (
        {"kind": "fixed", "value": float(turns[0])}
        if len(set(turns)) == 1
        else {"kind": "empirical", "values": [float(t) for t in sorted(set(turns))], "counts": _counts(turns)}
    )
    return {
        "measured_on": measured_on,
        "samples": {
            "episodes": len(finished),
            "ended_by_the_environment": len(ended) - len(capped) - len(limited),
            "ended_at_max_turns": len(capped),
            "truncated_by_the_environment": len(limited),
            "reset_latency_s": {"median": round(statistics.median(reset_s), 6), "max": round(max(reset_s), 6)}
            if reset_s
            else None,
            "steps": len(taken),
            "failed_attempts": failures,
            # response lengths are the policy's: the model, tokenizer and budget they were measured with
            "model": spec.model.weights,
            "tokenizer": spec.model.tokenizer_kind or "the model directory's",
            "response_budget": spec.workload.tokens.response,
            "turns_at_budget": round(share_at_budget(spec, runs), 4),  # lengths cut there, unseen past it
            "notes": notes,
        },
        "turns": {"max": max(turns), "dist": drawn},
        "tokens": tokens,
        "env_latency_s": _lognormal(latencies),
        "env_latency_max_s": round(max(max(latencies, default=0.0), 1e-6), 6),
        "env_failure_rate": round(failures / (len(taken) + failures), 6),
        # a reset (making the environment included: a sandbox's start), which the stand-in then takes as long
        **({"env_reset_s": _lognormal(reset_s)} if reset_s else {}),
    }


def _counts(values: list[int]) -> list[int]:
    """How many times each distinct value was seen, in the values' order."""
    seen = Counter(values)
    return [seen[v] for v in sorted(seen)]


def _cut(last_step: dict) -> bool:
    """Whether an episode's last step ended it from outside the environment's own play."""
    return last_step["timed_out"] or last_step["truncated"] or last_step.get("lost", False)


def stand_in_workload(workload: dict, profile: dict) -> dict:
    """A spec's ``workload`` (YAML) with its environment played by the stand-in and the keys the
    profile measured in place of the spec's own: what a simulation of a user's environment runs."""
    kept = {k: v for k, v in workload.items() if k not in (*MEASURED, "environment", "profile")}
    tokens = {**workload["tokens"], **profile["tokens"]}
    measured = {k: profile[k] for k in MEASURED if k in profile}  # a profile from before env_reset_s has none
    return {**kept, "environment": dict(STAND_IN), **measured, "tokens": tokens}
