"""``--track``: per-step ROLL-named scalars from the harness trace, read back with TensorBoard's own
reader and as JSONL; the Chrome trace Perfetto opens; a hand-made trace whose every figure is known;
and the clear errors (no tensorboard, an unknown writer, --track-dir alone)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from targets.api import TraceEvent
from targets.harness.measure.tracking import JsonlTracker, steps, track_round, write_chrome_trace

runner = CliRunner()
ENV = {"COLUMNS": "120"}
ROLL_TAGS = {
    "time/step_total",
    "time/step_model_update",
    "time/step_rollout",
    "time/step_shrink",
    "time/step_train",
    "shrink/shrink_duration_ms",
    "shrink/aborted",
    "expand/expand_duration_ms",
    "expand/aborted",
    "system/tps",
    "system/samples",
}
OURS = {
    "time/step_weight_export",
    "system/goodput",
    "system/rollout_throughput",
    "system/tokens_per_s",
    "system/timeouts",
    "system/timeout_ratio",
    "system/aborted_turns",
}
STEPS = 4  # the fast target's train_steps


def _bench(fast_target: Path, out: Path, track: str, baselines: str) -> dict:
    result = runner.invoke(
        app,
        [
            "bench",
            str(fast_target),
            "--simulate",
            *("--sandbox", "subprocess"),  # its candidate processes start warm
            *("--baselines", baselines, "--repeat", "1"),
            *("--json", str(out / "b.json"), "--track", track),
        ],
        env=ENV,
    )
    assert result.exit_code == 0, result.output
    assert f"tracking ({track}): {out / 'b-track'}" in result.output  # the default: beside --json
    return {run["name"]: run["repeats"][0] for run in json.loads((out / "b.json").read_text())["runs"]}


@pytest.fixture(scope="module")
def tensorboard_bench(tmp_path_factory, fast_target):
    out = tmp_path_factory.mktemp("bench-tb")
    return out / "b-track", _bench(fast_target, out, "tensorboard", "time_multiplex")["time_multiplex"]


def _check_steps(value, metrics: dict) -> None:
    """What holds for every schedule: STEPS points a tag, positive times, and the per-step figures add
    up to the benchmark's own (targets/harness/measure/metrics.py) over the steps."""
    assert all(v > 0 for v in value("time/step_total") + value("time/step_train") + value("system/tps"))
    assert value("time/step_rollout")[0] > 0  # step 1 waits for its whole batch
    samples = value("system/samples")
    assert samples[0] > 0 and samples == [samples[0] * k for k in range(1, STEPS + 1)]  # one batch a step
    assert sum(value("time/step_total")) <= metrics["duration_s"] + 1e-6
    trained = sum(g * t for g, t in zip(value("system/goodput"), value("time/step_total")))
    assert trained == pytest.approx(metrics["goodput"] * metrics["duration_s"], rel=1e-5)
    assert sum(value("system/aborted_turns")) <= metrics["aborted_turns"]
    for k in range(STEPS):  # the wait for the batch, the switches and the training fit in the step
        parts = ("time/step_rollout", "time/step_shrink", "time/step_train", "time/step_weight_export")
        assert sum(value(tag)[k] for tag in parts) <= value("time/step_total")[k] + 1e-5


def test_bench_track_tensorboard_opens_with_tensorboards_own_reader(tensorboard_bench):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    track_dir, metrics = tensorboard_bench
    reader = EventAccumulator(str(track_dir / "time_multiplex" / "r0"))
    reader.Reload()
    assert set(reader.Tags()["scalars"]) == ROLL_TAGS | OURS
    series = {tag: reader.Scalars(tag) for tag in ROLL_TAGS | OURS}
    assert all([s.step for s in points] == list(range(1, STEPS + 1)) for points in series.values())
    values = {tag: [s.value for s in points] for tag, points in series.items()}
    _check_steps(values.__getitem__, metrics)
    # time-multiplexing shrinks a device to train on it, and expands it back with the new weights
    assert all(v > 0 for v in values["shrink/shrink_duration_ms"] + values["time/step_shrink"])
    assert all(v > 0 for v in values["expand/expand_duration_ms"][1:] + values["time/step_model_update"][1:])
    assert values["time/step_rollout"][1:] == [0.0] * (STEPS - 1)  # the batch was ready: rollout overlapped training


def test_bench_track_writes_a_chrome_trace_with_a_thread_per_device(tensorboard_bench):
    track_dir, _ = tensorboard_bench
    trace = json.loads((track_dir / "trace.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert list(processes.values()) == ["time_multiplex/r0"]
    threads = {e["tid"]: e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["cpu:0", "cpu:1", "steps"]
    slices = [e for e in trace if e["ph"] == "X"]
    assert all(e["dur"] > 0 and e["ts"] >= 0 and e["tid"] in threads for e in slices)
    for tid, name in threads.items():
        mine = sorted((e["ts"], e["ts"] + e["dur"]) for e in slices if e["tid"] == tid)
        assert mine and all(a[1] <= b[0] + 1e-3 for a, b in zip(mine, mine[1:]))  # no overlap within a thread
        if name == "steps":
            assert len(mine) == STEPS
    assert {e["name"] for e in slices} >= {"rollout", "train", "switching", "sync"}


def test_bench_track_jsonl_is_one_object_per_step(tmp_path, fast_target):
    metrics = _bench(fast_target, tmp_path, "jsonl", "colocate")["colocate"]
    lines = [json.loads(line) for line in (tmp_path / "b-track" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["run"], r["step"]) for r in lines] == [("colocate/r0", k) for k in range(1, STEPS + 1)]
    assert all(set(r) == {"run", "step"} | ROLL_TAGS | OURS for r in lines)
    _check_steps(lambda tag: [r[tag] for r in lines], metrics)
    # colocation rolls out on every device, then suspends them all (its shrink), trains, and resumes
    # them with the new weights (its model update)
    assert all(r["time/step_rollout"] > 0 and r["time/step_shrink"] > 0 for r in lines)
    assert all(r["time/step_model_update"] > 0 for r in lines[1:])
    assert (tmp_path / "b-track" / "trace.json").is_file()


# -- a trace whose every figure is known ------------------------------------------------------------


def _event(kind: str, t: float, **data) -> TraceEvent:
    return TraceEvent(kind=kind, t=t, data=data)


def _step(episode: str, t: float, action: int, done: bool = True, timed_out: bool = False) -> TraceEvent:
    return _event("env_step", t, episode=episode, action=action, done=done, timed_out=timed_out)


def _turn(episode: str, device: str, start: float, t: float, aborted: bool = False) -> TraceEvent:
    return _event("generate", t, episode=episode, device=device, start=start, aborted=aborted)


HAND = [  # two devices; cpu:1 is shrunk to train on, then expanded back
    _event("run_start", 0.0, devices=["cpu:0", "cpu:1"], engines={"cpu:0": ["cpu:0"], "cpu:1": ["cpu:1"]}),
    _turn("g0/e0", "cpu:0", 0.0, 1.0),
    _step("g0/e0", 1.1, action=5),
    _turn("g0/e1", "cpu:1", 0.0, 1.5, aborted=True),  # the shrink aborts it ...
    _event("shrink", 2.0, start=1.5, devices=["cpu:1"]),
    _turn("g0/e1", "cpu:0", 1.5, 2.5),  # ... and it is retried on cpu:0
    _step("g0/e1", 2.6, action=6, timed_out=True),
    _event(
        "train",
        4.0,
        start=2.6,
        step=1,
        devices=["cpu:1"],
        trajectories=[{"episode": "g0/e0", "tokens": 10}, {"episode": "g0/e1", "tokens": 20}],
    ),
    _event("weight_export", 4.2, start=4.0, step=1),  # the harness's copy; overlaps the sync here
    _event("sync", 4.5, start=4.0, devices=["cpu:0"]),
    _event("expand", 5.5, start=4.5, devices=["cpu:1"]),
    _turn("g1/e0", "cpu:0", 2.6, 5.0),
    _step("g1/e0", 5.2, action=7),
    _event("shrink", 6.0, start=5.5, devices=["cpu:1"]),
    _event("train", 7.0, start=6.0, step=2, devices=["cpu:1"], trajectories=[{"episode": "g1/e0", "tokens": 30}]),
    _event("sync", 7.5, start=7.0, devices=["cpu:0"]),  # the tail after the last step is no step's
    _event("run_end", 7.5),
]


def test_each_roll_name_measures_what_its_docstring_says():
    first, second = steps(HAND)
    assert (first.number, first.start, first.end, second.start, second.end) == (1, 0.0, 4.0, 4.0, 7.0)
    assert first.scalars == pytest.approx(
        {
            "time/step_total": 4.0,
            "time/step_model_update": 0.0,
            "time/step_rollout": 2.6 - 0.5,  # waiting for the batch, less the shrink in that time
            "time/step_shrink": 0.5,
            "time/step_train": 1.4,
            "time/step_weight_export": 0.0,
            "shrink/shrink_duration_ms": 500.0,
            "shrink/aborted": 1,
            "expand/expand_duration_ms": 0.0,
            "expand/aborted": 0,
            "system/tps": 30 / 4.0,
            "system/samples": 2,
            "system/goodput": 1 / 4.0,  # g0/e1 timed out: trained, but not good
            "system/rollout_throughput": 2 / 4.0,
            "system/tokens_per_s": 11 / 4.0,
            "system/timeouts": 1,
            "system/timeout_ratio": 0.5,
            "system/aborted_turns": 1,
        }
    )
    assert second.scalars == pytest.approx(
        {
            "time/step_total": 3.0,
            "time/step_model_update": 1.5,  # the sync to cpu:0 and cpu:1's reload with the new weights
            "time/step_rollout": 0.0,  # the batch was ready when the switches were done
            "time/step_shrink": 0.5,
            "time/step_train": 1.0,
            "time/step_weight_export": 0.2,  # the copy after step 1 falls in step 2's window
            "shrink/shrink_duration_ms": 500.0,
            "shrink/aborted": 0,
            "expand/expand_duration_ms": 1000.0,
            "expand/aborted": 0,
            "system/tps": 60 / 7.0,  # ROLL's window of the last 5 steps
            "system/samples": 3,
            "system/goodput": 1 / 3.0,
            "system/rollout_throughput": 1 / 3.0,
            "system/tokens_per_s": 7 / 3.0,
            "system/timeouts": 0,
            "system/timeout_ratio": 0.0,
            "system/aborted_turns": 0,
        }
    )


def test_a_generate_round_is_tracked_with_its_headline_and_chrome_trace(tmp_path):
    trace = tmp_path / "round-3.jsonl"
    trace.write_text("".join(json.dumps({"kind": e.kind, "t": e.t, "data": e.data}) + "\n" for e in HAND))
    tracker = JsonlTracker(tmp_path / "track")
    chrome = track_round(tracker, 3, 0.42, trace)
    tracker.close()
    lines = [json.loads(line) for line in (tmp_path / "track" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 3, "run": "rounds", "round/headline": 0.42}
    assert [(r["run"], r["step"]) for r in lines[1:]] == [("round-3", 1), ("round-3", 2)]
    events = json.loads(chrome.read_text())["traceEvents"]
    cpu1 = next(e["tid"] for e in events if e["name"] == "thread_name" and e["args"]["name"] == "cpu:1")
    slices = sorted(
        ((e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == cpu1), key=lambda s: s[1]
    )
    expected = [
        ("rollout", 0.0, 1.5e6),
        ("switching", 1.5e6, 0.5e6),
        ("train", 2.6e6, 1.4e6),
        ("switching", 4.5e6, 1.5e6),  # expand then shrink, back to back: one slice
        ("train", 6.0e6, 1.0e6),
    ]
    assert [name for name, _, _ in slices] == [name for name, _, _ in expected]
    assert [x for _, ts, dur in slices for x in (ts, dur)] == pytest.approx(
        [x for _, ts, dur in expected for x in (ts, dur)]
    )
    missing = JsonlTracker(tmp_path / "other")
    with pytest.raises(ValueError, match="round 4 kept no trace"):
        track_round(missing, 4, 0.5, tmp_path / "absent.jsonl")
    missing.close()
    assert json.loads((tmp_path / "other" / "metrics.jsonl").read_text()) == {
        "step": 4,
        "run": "rounds",
        "round/headline": 0.5,
    }


def test_a_trace_of_an_unfinished_run_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a finished harness run"):
        steps(HAND[:-1])
    with pytest.raises(ValueError, match="not a finished harness run"):
        write_chrome_trace({"run": HAND[:-1]}, tmp_path / "t.json")


# -- clear errors, before any run ------------------------------------------------------------------


def test_track_tensorboard_without_tensorboard_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where bench's default track folder would go
    monkeypatch.setenv("VIBETRAIN_SCRATCH", str(tmp_path))  # (both: it went to the first before the second)
    result = runner.invoke(app, ["bench", "tiny-qwen3-cpu", "--track", "tensorboard"], env=ENV)
    assert result.exit_code == 2 and "pip install tensorboard" in result.output, result.output
    assert list(tmp_path.iterdir()) == []  # refused before a folder was made


def test_bad_track_options_are_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    monkeypatch.setenv("VIBETRAIN_SCRATCH", str(tmp_path / "temp"))
    (tmp_path / "temp").mkdir()
    result = runner.invoke(app, ["bench", "tiny-qwen3-cpu", "--track", "wandb"], env=ENV)
    assert result.exit_code == 2 and "choose one of tensorboard, jsonl" in result.output, result.output
    assert list((tmp_path / "temp").iterdir()) == []  # no empty vibetrain-track-* folder left behind
    result = runner.invoke(app, ["bench", "tiny-qwen3-cpu", "--track-dir", str(tmp_path)], env=ENV)
    assert result.exit_code == 2 and "--track-dir needs --track" in result.output, result.output
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--track-dir", str(tmp_path)], env=ENV)
    assert result.exit_code == 2 and "--track-dir needs --track" in result.output, result.output
