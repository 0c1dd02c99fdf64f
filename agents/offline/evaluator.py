"""Offline evaluator: audited repeats (paired with the incumbent best, interleaved, one seed per
pair), medians and spreads, the paired ratio with its interval, the harness's profile of the calls,
and rule-based hints read from the median trace: the findings the planner maps to skill triggers."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from agents.roles import Evaluation, Hint
from targets.harness.measure.benchmark import BenchRun
from targets.harness.measure.session import Measurement, MeasurementFailed, Paired, Session
from targets.harness.sim.request_spans import request_concurrency

DEVICES_BUSY = 0.75  # mean device busy share under which devices idle
STALL_SHARE = 0.10  # share of the run with no request in flight
TAIL_SHARE = 0.15  # share of the run with under a quarter of the peak in flight
TRAIN_IDLE_SHARE = 0.4  # idle share of a training device that says it waits for data
ABORT_SHARE = 0.05
STALE_SHARE = 0.05  # share of created episodes dropped as stale
LOST_SHARE = 0.01  # share of finished trajectories lost with their environment's state in a crash
JUDGE_BUSY = 0.5  # a reward model's own devices busy less than this share of the time they are held: move it
SERVING_SLACK = 0.6  # a serving pool whose p99 TTFT stayed under this share of its SLO has room to lend
SMALL_BATCH = 4.0
SYNC_SHARE = 0.10
RESET_SHARE = 0.10  # an environment's mean reset over this share of a step: starting them early pays
# of the engines' busy time spent prefilling (decode paused meanwhile); time_multiplex at paper scale spent
# 25-27%, which the host tier took to 6.6% for 1.44x colocate (benchmarks/results/simulated-generalization.yaml)
PREFILL_SHARE = 0.2
MAX_PAIRS_FACTOR = 2  # a real target's undecided candidate gets up to this many times its pairs


def concurrency_shares(events: list) -> tuple[float, float]:
    """Shares of the run with no request in flight (rollout stalled) and with under a quarter of
    the run's peak in flight (the long tail), from the generate events' start and end stamps."""
    start = next(e.t for e in events if e.kind == "run_start")
    end = next(e.t for e in events if e.kind == "run_end")
    changes = sorted(
        [(e.data["start"], 1) for e in events if e.kind == "generate"]
        + [(e.t, -1) for e in events if e.kind == "generate"]
    )
    if not changes or end <= start:
        return 1.0, 0.0
    level, peak, levels = 0, 0, []  # (from, to, requests in flight)
    previous = start
    for when, delta in changes:
        levels.append((previous, when, level))
        level += delta
        peak = max(peak, level)
        previous = when
    levels.append((previous, end, level))
    duration = end - start
    stalled = sum(b - a for a, b, n in levels if n == 0) / duration
    tail = sum(b - a for a, b, n in levels if 0 < n < peak / 4) / duration
    return stalled, tail


def hints_from(metrics: dict, events: list, simulated: bool, kinds: dict[str, str] | None = None) -> list[Hint]:
    """Findings, each with its evidence; ``code`` is what skills list as triggers. ``kinds``: each
    device's kind (one kind unless the target has pools of several)."""
    hints = []
    served = Counter((kinds or {}).get(e.data["device"], "") for e in events if e.kind == "generate")
    served.pop("", None)
    if len(served) > 1:
        hints.append(
            Hint(
                code="mixed_kinds",
                message="rollout ran on devices of "
                + ", ".join(f"{k} ({n} turns)" for k, n in sorted(served.items()))
                + ": each turn may go where its prefill or decode is cheapest",
                evidence={"turns_by_kind": dict(served)},
            )
        )
    stalled, tail = concurrency_shares(events)
    if stalled > STALL_SHARE:
        hints.append(
            Hint(
                code="rollout_stalls",
                message=f"no rollout in flight for {stalled:.0%} of the run (training blocks it)",
                evidence={"stalled_share": stalled},
            )
        )
    if tail > TAIL_SHARE:
        hints.append(
            Hint(
                code="tail_idle",
                message=f"under a quarter of the peak requests in flight for {tail:.0%} of the run "
                "(the batch's long tail)",
                evidence={"tail_share": tail},
            )
        )
    busy = metrics["mean_device_busy"]
    if busy < DEVICES_BUSY:
        hints.append(
            Hint(
                code="devices_idle",
                message=f"devices are busy {busy:.0%} of the run",
                evidence={"mean_device_busy": busy},
            )
        )
    utilization = metrics["device_utilization"]
    trainers = {d: u for d, u in utilization.items() if u["train"] > 0}
    if trainers:
        idle = statistics.mean(u["idle"] for u in trainers.values())
        if idle > TRAIN_IDLE_SHARE:
            hints.append(
                Hint(
                    code="train_devices_idle",
                    message=f"training devices idle {idle:.0%} of the run (waiting for data)",
                    evidence={"train_device_idle": idle, "devices": sorted(trainers)[:8]},
                )
            )
    if metrics["timeout_ratio"] > 0.01:
        hints.append(
            Hint(
                code="timeouts",
                message=f"{metrics['timeout_ratio']:.0%} of trajectories timed out",
                evidence={"timeout_ratio": metrics["timeout_ratio"]},
            )
        )
    if metrics["lost_ratio"] > LOST_SHARE:
        hints.append(
            Hint(
                code="lost_episodes",
                message=f"{metrics['lost_ratio']:.0%} of trajectories lost their environment in a crash "
                "(state no checkpoint held)",
                evidence={"lost_ratio": metrics["lost_ratio"], "checkpoint_s": metrics["checkpoint_s"]},
            )
        )
    serving = [e.data for e in events if e.kind == "serving"]
    if serving and serving[-1]["ttft_p99_s"] < SERVING_SLACK * serving[-1]["ttft_slo_s"]:
        s = serving[-1]
        hints.append(
            Hint(
                code="serving_headroom",
                message=f"the serving pool kept its p99 TTFT at {s['ttft_p99_s'] * 1e3:.0f} ms of its "
                f"{s['ttft_slo_s'] * 1e3:.0f} ms SLO while lending {metrics['lent_devices']:.1f} "
                f"of its {len(s['devices'])} devices on average: rollout may borrow more",
                evidence={"ttft_p99_s": s["ttft_p99_s"], "lent_devices": metrics["lent_devices"]},
            )
        )
    judge = [e.data for e in events if e.kind == "reward_service"]
    if judge and (judge[-1]["where"] == "colocated" or judge[-1]["utilization"] < JUDGE_BUSY):
        j = judge[-1]
        where = (
            "beside the policy on the rollout engines (its weights in their KV cache)"
            if j["where"] == "colocated"
            else f"on {j['where']} devices busy {j['utilization']:.0%} of the {j['device_s']:.0f} device-seconds held"
        )
        hints.append(
            Hint(
                code="judge_placement",
                message=f"the reward model judges {where}; a verdict took {metrics['reward_verdict_s']:.1f} s",
                evidence={"where": j["where"], "busy": j["utilization"], "verdict_s": metrics["reward_verdict_s"]},
            )
        )
    turns = sum(1 for e in events if e.kind == "generate")
    if turns and metrics["aborted_turns"] / turns > ABORT_SHARE:
        hints.append(
            Hint(
                code="many_aborts",
                message=f"{metrics['aborted_turns']} of {turns} turns aborted by shrinks",
                evidence={"aborted_turns": metrics["aborted_turns"], "turns": turns},
            )
        )
    created = sum(1 for e in events if e.kind == "episode_created")
    stale = sum(1 for e in events if e.kind == "sample_dropped" and e.data["reason"] == "stale")
    if created and stale / created > STALE_SHARE:
        hints.append(
            Hint(
                code="stale_drops",
                message=f"{stale} of {created} episodes dropped as stale (generated, never trained)",
                evidence={"stale_drops": stale, "episodes": created},
            )
        )
    if not simulated:
        requests = request_concurrency(events)
        if requests:
            size = statistics.mean(batch for _, batch in requests)
            if size < SMALL_BATCH:
                hints.append(
                    Hint(
                        code="small_engine_batches",
                        message=f"a request shares its engine with {size:.1f} requests on average (itself included)",
                        evidence={"mean_engine_batch": size},
                    )
                )
    if metrics.get("prefill_share", 0.0) > PREFILL_SHARE:  # the simulator's engines count it
        hints.append(
            Hint(
                code="prefill_bound",
                message=f"the engines spent {metrics['prefill_share']:.0%} of their busy time prefilling "
                f"({metrics['prefilled_tokens']:,.0f} tokens): contexts evicted while their episodes waited "
                "on tools are computed again whole",
                evidence={"prefill_share": metrics["prefill_share"], "prefilled_tokens": metrics["prefilled_tokens"]},
            )
        )
    steps = max(1, sum(1 for e in events if e.kind == "train"))
    resets = [e.data["latency"] for e in events if e.kind == "env_reset"]
    step_s = metrics["duration_s"] / steps
    if resets and statistics.mean(resets) > RESET_SHARE * step_s:
        hints.append(
            Hint(
                code="reset_wait",
                message=f"an environment takes {statistics.mean(resets):.0f} s to reset on average "
                f"({max(resets):.0f} s at most), {statistics.mean(resets) / step_s:.0%} of a {step_s:.0f} s step: "
                "resets started while the devices train would not hold rollout back",
                evidence={"mean_reset_s": statistics.mean(resets), "max_reset_s": max(resets), "step_s": step_s},
            )
        )
    if metrics["sync_s"] * steps / metrics["duration_s"] > SYNC_SHARE:
        hints.append(
            Hint(
                code="slow_sync",
                message=f"weight sync takes {metrics['sync_s'] * steps / metrics['duration_s']:.0%} of the run",
                evidence={"sync_s": metrics["sync_s"]},
            )
        )
    return hints


def call_profile(events: list) -> str:
    """Where the run's time went, as the harness saw each call: count, mean and slowest duration per
    kind (the harness's view from outside; the candidate's processes are not profiled, so a measured
    run looks exactly like the check's)."""
    spans: dict[str, list[float]] = {}
    for e in events:
        if "start" in e.data:
            spans.setdefault(e.kind, []).append(e.t - e.data["start"])
        elif e.kind == "env_step":
            spans.setdefault("env_step (tool latency)", []).append(e.data["latency"])
    lines = [f"{'call':28s} {'count':>7s} {'mean s':>9s} {'max s':>9s} {'total s':>9s}"]
    for kind, values in sorted(spans.items(), key=lambda kv: -sum(kv[1])):
        lines.append(
            f"{kind:28s} {len(values):7d} {statistics.fmean(values):9.4f} {max(values):9.4f} {sum(values):9.2f}"
        )
    return "\n".join(lines)


def extended(seeds: list[int], count: int) -> list[int]:
    """``seeds`` and ``count`` more, drawn from them: a rerun of the round measures the same ones."""
    rng = random.Random(repr(seeds))
    return seeds + [rng.randrange(2**31) for _ in range(count)]


def undecided(noise_threshold: float) -> Callable[[Paired], bool]:
    """The sequential rule: one more pair while the estimate clears the threshold and the promotion
    rule does not (a gain the pairs so far cannot tell from noise; each look tested at its share of the
    error, ``session.look_confidence``). A candidate estimated below the threshold stops at once."""
    return lambda paired: paired.ratio > 1 + noise_threshold and not paired.clears(noise_threshold)


class BestFailed(RuntimeError):
    """The run's best, measured beside a candidate, failed the judge: the round ends in an error that
    says so; the candidate is neither rejected nor promoted on it."""


class OfflineEvaluator:
    """Every measured run goes through ``Session.measure`` (judged like the check's run); with a
    baseline, runs are paired and interleaved (``Session.compare``)."""

    def __init__(self, session: Session, repeat: int) -> None:
        if repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {repeat}")
        self.session, self.repeat = session, repeat
        # a real target's pairs vary by more than the threshold (tiny-qwen3-cpu: 3 pairs gave
        # time_multiplex +31.9% [-2.0%, +77.3%] over colocate; 4 bench pairs, 1.38x [1.36, 1.41]).
        # The rule needs an interval to start from (one real pair's is unbounded, two pairs' t is
        # 12.7); a simulated pair is exact for its seed, so more pairs would never narrow it.
        sequential = not session.target.simulated and repeat >= 2
        self.max_pairs = MAX_PAIRS_FACTOR * repeat if sequential else repeat

    def evaluate(
        self, workspace: Path, out: Path, baseline: Path | None, seeds: list[int], first: Measurement | None = None
    ) -> Evaluation:
        headline = self.session.target.spec.headline_metric.name
        paired = None
        try:
            if baseline is None:
                measurements = [first] if first is not None else []
                for i, seed in enumerate(seeds[len(measurements) :], start=len(measurements)):
                    measurement = self.session.measure(workspace, out / f"candidate-{i}", seed)
                    if not measurement.ok:
                        raise MeasurementFailed("candidate", i, measurement.reasons)
                    measurements.append(measurement)
            else:
                measurements, _, paired = self.session.compare(
                    workspace,
                    baseline,
                    out,
                    extended(seeds, self.max_pairs - len(seeds)),
                    against="best",
                    first=first,
                    pairs=len(seeds),
                    more=undecided(self.session.target.spec.noise_threshold),
                )
        except MeasurementFailed as failure:
            if failure.name == "baseline":  # the best's run: no finding of the candidate's
                raise BestFailed(
                    f"the best failed measured run {failure.repeat} beside this candidate (on this round's seed): "
                    + "; ".join(failure.reasons[:5])
                ) from None
            return Evaluation(
                0.0,
                {},
                {},
                [],
                [],
                findings=[f"measured run {failure.repeat} of the {failure.name}: {r}" for r in failure.reasons],
            )
        run = BenchRun("candidate", measurements)
        summary = run.summary(headline)
        median = measurements[run.median_index(headline)]
        events = median.events()
        kinds = {d.id: d.kind for d in self.session.target.devices()}
        hints = hints_from(summary["metrics"], events, self.session.target.simulated, kinds)
        return Evaluation(
            summary["metrics"][headline],
            summary["metrics"],
            summary["spread"],
            run.repeats,
            hints,
            call_profile(events),
            median.trace_path,
            paired,
        )
