"""Each scheduling technique, seen working from the harness's trace: in a real run of the tiny CPU
target and in a simulated one, with the audit passing. (The audit's plants of each technique's
misuse are in tests/test_audit.py.)"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import yaml

from skills.starter import write_starter
from targets.harness.launch import Limits, run_harness
from targets.harness.sandbox import Sandbox
from targets.harness.target import Target
from targets.harness.trace import Trace
from targets.spec import parse_target

pytestmark = pytest.mark.slow


def _run(tmp_path, fast_target, params: dict, simulate: bool, workload: dict | None = None):
    data = yaml.safe_load(fast_target.read_text())
    data["workload"].update(workload or {})
    fast_target = tmp_path / "target.yaml"
    fast_target.write_text(yaml.safe_dump(data))
    spec = parse_target(data)
    stack = write_starter(tmp_path / "stack", spec, "time_multiplex")
    path = stack / "stack" / "params.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **params}))
    run = run_harness(
        Target.load(fast_target, simulate=simulate),
        stack,
        tmp_path / "out",
        "measure",
        Limits(time_s=300),
        Sandbox("subprocess"),
    )
    assert run.ok, run.cause
    audit = run.results["audit"]["result"]
    assert audit["passed"], audit["reasons"]
    return spec, Trace.load_events(run.out / "trace.jsonl")


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_redundant_envs_keep_the_first_members_and_drop_the_spares(tmp_path, fast_target, simulate):
    spec, events = _run(tmp_path, fast_target, {"redundant_envs": 2}, simulate)
    created = Counter(e.data["group"] for e in events if e.kind == "episode_created")
    assert set(created.values()) == {spec.workload.group_size + 2}  # every group launched with its spares
    group_of = {e.data["episode"]: e.data["group"] for e in events if e.kind == "episode_created"}
    redundant = Counter(
        group_of[e.data["episode"]] for e in events if e.kind == "sample_dropped" and e.data["reason"] == "redundant"
    )
    trained = Counter(group_of[t["episode"]] for e in events if e.kind == "train" for t in e.data["trajectories"])
    assert trained and set(trained.values()) == {spec.workload.group_size}  # groups train whole, spares never
    assert redundant and max(redundant.values()) <= 2
    assert sum(redundant[g] for g in trained) == 2 * len(trained)  # a trained group's spares all went back


@pytest.mark.parametrize("simulate", [False, True], ids=["real", "simulated"])
def test_progress_shrink_starts_the_switch_before_the_batch_is_complete(tmp_path, fast_target, simulate):
    """async_ratio 0: at half the batch ready, half the outstanding groups still run, so one of the two
    rollout devices is free; it is the training device, and it shrinks before the batch's last episode ends."""
    spec, events = _run(tmp_path, fast_target, {"shrink_at": 0.5}, simulate, {"async_ratio": 0})
    finished = {e.data["episode"]: e.t for e in events if e.kind == "env_step" and e.data["done"]}
    trains = [e for e in events if e.kind == "train"]
    shrinks = [e for e in events if e.kind == "shrink"]
    assert len(trains) == spec.workload.train_steps
    early, previous_end = 0, 0.0
    for train in trains:  # a shrink of this step (after the last train ended) before its batch was complete
        batch_done = max(finished[t["episode"]] for t in train.data["trajectories"])
        early += any(previous_end < s.data["start"] < batch_done for s in shrinks)
        previous_end = train.t
    assert early >= 1, [(s.t, s.data) for s in shrinks]
