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


def _run(tmp_path, fast_target, params: dict, simulate: bool):
    spec = parse_target(yaml.safe_load(fast_target.read_text()))
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
