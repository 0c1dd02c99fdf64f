"""The stack kit end to end on the CPU target: the three starter stacks pass ``vibetrain check`` in the
default sandbox; each planted cheat is rejected with a reason that names it; a crash and a hang fail
cleanly; the benchmark prints its table and writes JSON and the timeline. The verdicts read the
harness's own trace whatever the sandbox, so the plants, the hang and the bench run in the subprocess
sandbox on the test session's shared Ray cluster (conftest.py's ``shared_ray``), as a stack on a Ray
cluster would."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli import app
from skills.starter import write_starter
from targets.harness.isolation.launch import Limits
from targets.harness.measure.session import Session
from targets.harness.target import Target
from targets.spec import parse_target

pytestmark = pytest.mark.slow
runner = CliRunner()


def _check(target: Path, stack: Path, sandbox: str = "auto") -> tuple[int, str]:
    result = runner.invoke(
        app,
        ["check", str(target), "--stack", str(stack), "--time-limit", "300", "--sandbox", sandbox],
        env={"COLUMNS": "200"},
    )
    return result.exit_code, result.output


def _planted(
    tmp_path: Path,
    target: Path,
    controller: str,
    edits: dict[str, tuple[str, str]],
    extra: dict[str, str] | None = None,
) -> Path:
    spec = parse_target(yaml.safe_load(target.read_text()))
    directory = write_starter(tmp_path / "candidate", spec, controller)
    for name, (old, new) in edits.items():
        path = directory / "stack" / name
        text = path.read_text()
        assert old in text, f"planting failed: {old!r} not in {name}"
        path.write_text(text.replace(old, new))
    for name, text in (extra or {}).items():
        (directory / "stack" / name).write_text(text)
    return directory


@pytest.mark.parametrize("controller", ["colocate", "static_split", "time_multiplex"])
def test_starter_stacks_pass_check(tmp_path, fast_target, controller, shared_ray):
    """On the test session's shared cluster (the default sandbox's check, bubblewrap with a Ray cluster of
    its own: tests/test_isolation.py's run that rewrites its own files)."""
    code, output = _check(fast_target, _planted(tmp_path, fast_target, controller, {}), "subprocess")
    assert code == 0, output
    assert "PASS" in output and "-fast: real execution, " in output


CHEATS = {
    "drops trajectories": (
        "time_multiplex",
        {
            "controller_base.py": (
                "        self.version = await cluster.train(TrainBatch(batch,",
                "        batch = batch[self.group_size:]  # planted: discard a group unseen\n"
                "        self.version = await cluster.train(TrainBatch(batch,",
            )
        },
        "unaccounted: episode",
    ),
    "uses a trajectory twice": (
        "time_multiplex",
        {
            "controller_base.py": (
                "        self.version = await cluster.train(TrainBatch(batch,",
                "        batch = batch + batch[: self.group_size]  # planted\n"
                "        self.version = await cluster.train(TrainBatch(batch,",
            )
        },
        "used twice",
    ),
    "exceeds the staleness bound": (
        "static_split",
        {
            "static_split.py": (
                "cluster, buffer, manager = self._wire(cluster, envs, self.async_ratio)",
                "cluster, buffer, manager = self._wire(cluster, envs, 3)  # planted: samples up to 3 versions old",
            )
        },
        "stale sample",
    ),
    "serves from stale weights": (
        "time_multiplex",
        {
            "engine_server.py": (
                "                await asyncio.to_thread(self.engine.load_weights, state, version)",
                "                self.engine.weight_version = version  # planted",
            )
        },
        "did not run with those weights",
    ),
    # static_split: no shrink for the held requests to run through. Held half a second, not two: a run of
    # the fast target can end within two seconds of its first requests, and requests still held then are
    # never answered, so nothing witnesses the hold (this plant passed 3 runs of 7 so on this VM)
    "holds requests in its cluster": (
        "static_split",
        {
            "ray_cluster.py": (
                "        while self._suspended or not self._active:  # no await between the look and clear()",
                "        if request.episode_id.startswith(('g1/', 'g2/')):  # planted: these tasks wait, looking busy\n"
                "            await asyncio.sleep(0.5)\n"
                "        while self._suspended or not self._active:  # no await between the look and clear()",
            )
        },
        "served out of order",
    ),
    "fabricates rollouts": (
        "static_split",
        {
            "engine_server.py": (
                "        request = self.engine.submit(prompt, params, episode, arrival)",
                "        return Completion([5] * params.max_new_tokens, [-0.5] * params.max_new_tokens, 'length', "
                "self.engine.weight_version, self.name)  # planted\n"
                "        request = self.engine.submit(prompt, params, episode, arrival)",
            )
        },
        "did not run with those weights",
    ),
    "skips environment steps": (
        "static_split",
        {
            "env_manager.py": (
                "                result = await episode.step(completion.tokens)",
                "                result = await episode.step(completion.tokens) if turn == 0 else StepResult([], 0.0, "
                "True)\n"
                "                from targets.api import StepResult  # noqa (planted)",
            )
        },
        "skipped environment steps",
    ),
    "reports its own metrics": (
        "static_split",
        {},
        "names the harness metric 'rollout_throughput'",
    ),
    "imports harness internals": (
        "static_split",
        {
            "build.py": (
                "from targets.api import Declared, EngineSettings, Runtime, Stack",
                "from targets.api import Declared, EngineSettings, Runtime, Stack\n"
                "from targets.harness.trace import Trace  # noqa",
            )
        },
        "imports harness internals (targets.harness.trace)",
    ),
}
EXTRA = {
    "reports its own metrics": {
        "report.py": (
            "def report(trajectories, seconds):\n    return {'rollout_throughput': len(trajectories) / seconds}\n"
        )
    }
}


# Through `vibetrain check`, exit code and table: one plant the system run's audit names, and the two the
# integrity scan stops before anything runs. The other runtime plants change only what the system run
# uses (checks 1-3 build their components apart), so they are measured, not checked: a measured run is
# judged by the same audit, without the accuracy checks (about 2 s a plant less here).
CHECKED = ("drops trajectories", "reports its own metrics", "imports harness internals")


@pytest.mark.parametrize("cheat", list(CHEATS))
def test_planted_cheats_are_rejected_with_a_named_reason(tmp_path, fast_target, judge_sandbox, cheat):
    controller, edits, reason = CHEATS[cheat]
    stack = _planted(tmp_path, fast_target, controller, edits, EXTRA.get(cheat, {}))
    if cheat not in CHECKED:
        seed = secrets.randbelow(2**31)  # a new workload each run, as the command draws one
        session = Session(Target.load(fast_target), judge_sandbox, Limits(time_s=300))
        measurement = session.measure(stack, tmp_path / "out", seed=seed)
        assert not measurement.ok and any(reason in r for r in measurement.reasons), (seed, measurement.reasons)
        return
    code, output = _check(fast_target, stack, sandbox="subprocess")
    assert code == 1, output
    assert reason in output, output
    if cheat != "drops trajectories":
        assert "was not executed: it failed the integrity scan" in output, output


def test_a_crashing_candidate_fails_cleanly_with_its_cause(tmp_path, fast_target):
    stack = _planted(
        tmp_path,
        fast_target,
        "static_split",
        {
            "build.py": (
                "    params = json.loads(",
                "    raise RuntimeError('planted crash in build')\n    params = json.loads(",
            )
        },
    )
    code, output = _check(fast_target, stack)
    assert code == 1 and "planted crash in build" in output, output


def test_a_hanging_candidate_is_killed_at_its_time_limit(tmp_path, fast_target, judge_sandbox):
    stack = _planted(
        tmp_path,
        fast_target,
        "static_split",
        {
            "static_split.py": (
                "        for _ in range(steps):",
                "        await cluster.sleep(10_000)  # planted hang\n        for _ in range(steps):",
            )
        },
    )
    # a measured run (no accuracy phase, whose own limit would race the system run's): the shared cluster
    # is ready within seconds and the controller hangs at its first step (a limit met sooner, still
    # starting, is the system run's all the same)
    measurement = Session(Target.load(fast_target), judge_sandbox, Limits(time_s=5)).measure(
        stack, tmp_path / "out", seed=1
    )
    reasons = "\n".join(measurement.reasons)
    assert not measurement.ok and "system run exceeded its time limit of 5s" in reasons, reasons


def test_bench_prints_ratios_and_writes_json_and_timeline(tmp_path, fast_target, shared_ray):
    result = runner.invoke(
        app,
        [
            "bench",
            str(fast_target),
            "--sandbox",
            "subprocess",
            "--baselines",
            "static_split,time_multiplex",
            "--repeat",
            "1",
            "--json",
            str(tmp_path / "b.json"),
            "--timeline",
            str(tmp_path / "t.png"),
        ],
        env={"COLUMNS": "120"},
    )
    assert result.exit_code == 0, result.output
    assert "1.00x" in result.output and "ratio" in result.output
    data = json.loads((tmp_path / "b.json").read_text())
    assert [r["name"] for r in data["runs"]] == ["static_split", "time_multiplex"]
    source = data["provenance"]  # where the figures came from, with the spec's hash
    assert data["schema"] == 3 and data["failed"] == []
    assert source["execution"] == "real" and len(source["spec_sha256"]) == 64
    assert source["versions"]["torch"].startswith("2.") and source["commit"] and source["host"]
    for run in data["runs"]:
        metrics = run["metrics"]
        assert metrics["rollout_throughput"] > 0 and metrics["tokens_per_s"] > 0 and metrics["step_time_s"] > 0
        assert set(metrics["device_utilization"]) == {"cpu:0", "cpu:1"} and len(run["repeats"]) == 1
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_on_a_one_device_target_bench_takes_the_starters_that_fit_and_generate_refuses_one_that_does_not(tmp_path):
    """The one-GPU target (simulated here) has one device: static_split and time_multiplex keep rollout
    and training on different devices. bench's default baselines are the starters that fit (colocate
    alone); generate with --starter static_split is refused before a run directory is made."""
    result = runner.invoke(
        app, ["bench", "qwen3-0.6b-h100x1", "--repeat", "1", "--json", str(tmp_path / "b.json")], env={"COLUMNS": "120"}
    )
    assert result.exit_code == 0, result.output
    assert "qwen3-0.6b-h100x1: simulated execution (execution auto: this machine lacks its 1x h100)" in result.output
    assert [r["name"] for r in json.loads((tmp_path / "b.json").read_text())["runs"]] == ["colocate"]
    run = tmp_path / "run"
    result = runner.invoke(
        app, ["generate", "qwen3-0.6b-h100x1", "--starter", "static_split", "--rounds", "1", "--out", str(run)]
    )
    assert result.exit_code != 0 and "--starter static_split" in result.output and "one device" in result.output
    assert "Traceback" not in result.output and not run.exists()
