"""Benchmark metrics on a hand-built trace: goodput counts trained, timely episodes only; throughput
is environment-observed; each moment of a device is counted once under the highest-priority
activity; and the timeline shows the median repeat."""

from __future__ import annotations

from pathlib import Path

import pytest

from targets.api import TraceEvent
from targets.harness.judge.check_result import CheckResult
from targets.harness.measure.benchmark import BenchRun
from targets.harness.measure.metrics import compute_metrics
from targets.harness.measure.session import Measurement


def _event(kind, t, **data):
    return TraceEvent(kind, t, data)


def _trace():
    return [
        _event("run_start", 10.0),
        _event("generate", 12.0, start=10.0, aborted=False, device="d0"),  # rollout 0-2 on d0
        _event("generate", 13.0, start=11.0, aborted=False, device="d0"),  # overlaps: 0-3 in all
        _event("generate", 11.5, start=11.0, aborted=True),  # aborted: no device time
        _event("shrink", 12.5, start=12.0, devices=["d1"]),  # switching 2-2.5 on d1
        _event(
            "train", 16.0, start=12.5, devices=["d1"], version=1, trajectories=[{"episode": "e1"}, {"episode": "e2"}]
        ),
        _event("generate", 15.0, start=13.0, aborted=False, device="d1"),  # hidden under train on d1
        _event("env_step", 12.0, episode="e1", action=[1, 2, 3], done=False, timed_out=False),
        _event("env_step", 14.0, episode="e1", action=[4, 5], done=True, timed_out=False),
        _event("env_step", 19.0, episode="e2", action=[6], done=True, timed_out=True),
        _event("run_end", 20.0),
    ]


def test_metrics_from_a_hand_built_trace():
    m = compute_metrics(_trace(), ["d0", "d1"])
    assert m["duration_s"] == 10.0
    assert m["goodput"] == pytest.approx(0.1)  # two trained, one of them timed out
    assert m["rollout_throughput"] == pytest.approx(0.2)  # two episodes finished in 10 s
    assert m["tokens_per_s"] == pytest.approx(0.6)
    assert m["trained_tokens_per_s"] == pytest.approx(0.5)  # e1's five tokens: e2 timed out
    assert m["timeout_ratio"] == pytest.approx(0.5)
    assert m["step_time_s"] == 10.0 and m["aborted_turns"] == 1
    d0, d1 = m["device_utilization"]["d0"], m["device_utilization"]["d1"]
    assert d0["rollout"] == pytest.approx(0.3) and d0["idle"] == pytest.approx(0.7)
    assert d1["switching"] == pytest.approx(0.05) and d1["train"] == pytest.approx(0.35)
    assert d1["rollout"] == pytest.approx(0.0)  # its generate lay entirely under training
    assert m["mean_device_busy"] == pytest.approx((0.3 + 0.4) / 2)


def test_goodput_ignores_finished_episodes_nobody_trained():
    events = _trace()
    events.insert(
        -1, _event("env_step", 19.5, episode="e3", action=[7], done=True, timed_out=False)
    )  # finished, never trained
    m = compute_metrics(events, ["d0", "d1"])
    assert m["goodput"] == pytest.approx(0.1) and m["rollout_throughput"] == pytest.approx(0.3)
    assert m["trained_tokens_per_s"] == pytest.approx(0.5)


def test_training_the_shorter_trajectories_raises_goodput_more_than_trained_tokens():
    """Two schedules on one workload of a short and a long episode, one trained each: the same goodput,
    and the tokens say which trained the long one."""

    def run(trained: str) -> dict:
        return compute_metrics(
            [
                _event("run_start", 0.0),
                _event("env_step", 1.0, episode="short", action=[1], done=True, timed_out=False),
                _event("env_step", 5.0, episode="long", action=list(range(9)), done=True, timed_out=False),
                _event("train", 6.0, start=5.0, devices=["d0"], version=1, trajectories=[{"episode": trained}]),
                _event("run_end", 10.0),
            ],
            ["d0"],
        )

    short, long = run("short"), run("long")
    assert short["goodput"] == long["goodput"] == pytest.approx(0.1)
    assert short["trained_tokens_per_s"] == pytest.approx(0.1) and long["trained_tokens_per_s"] == pytest.approx(0.9)


def test_the_median_repeat_is_the_middle_measurement_not_the_first_or_fastest():
    passed = [CheckResult("system_audit", True)]
    run = BenchRun(
        "x",
        [
            Measurement(passed, {"goodput": v}, Path(name))
            for v, name in ((23.0, "slow"), (40.0, "fast"), (39.0, "median"))
        ],
    )
    middle = run.measurements[run.median_index("goodput")]
    assert middle.trace_path == Path("median") and run.median("goodput") == 39.0


def test_the_bench_table_says_what_its_headline_counts_and_the_tokens_beside_it(tiny_spec):
    """A target ranked by trained tokens: the caption says so (not goodput's trajectories), and the tokens
    column is each schedule's paired ratio over the first's (the headline's estimator)."""
    from orchestrator.tables import bench_table

    spec = tiny_spec.model_copy(
        update={"headline_metric": tiny_spec.headline_metric.model_copy(update={"name": "trained_tokens_per_s"})}
    )
    figures = {"rollout_throughput": 1.0, "step_time_s": 2.0, "lower_bound_fraction": 0.5, "timeout_ratio": 0.0}
    figures["mean_device_busy"] = 0.9

    def run(name: str, tokens: list[float]) -> BenchRun:
        passed = [CheckResult("system_audit", True)]
        return BenchRun(
            name,
            [
                Measurement(passed, {**figures, "trained_tokens_per_s": t}, Path(f"{name}{i}"))
                for i, t in enumerate(tokens)
            ],
        )

    table = bench_table(spec, [run("colocate", [10.0, 20.0, 30.0]), run("best", [15.0, 50.0, 45.0])], 3, True)
    assert "trained_tokens_per_s: the response tokens of the trajectories trained" in str(table.caption)
    assert "trajectories trained on that" not in str(table.caption).split(";")[0]
    assert list(table.columns[3].cells) == ["1.00x", "1.78x"]  # (1.5 x 2.5 x 1.5)^(1/3); medians said 2.25x
    from rich.console import Console

    narrow = Console(width=80, record=True)  # a terminal of 80 columns cut every number with "…"
    narrow.print(bench_table(spec, [run("generated/tiny-qwen3-cpu@best", [10.0, 20.0, 30.0])] * 2, 3, True))
    assert "…" not in narrow.export_text()
