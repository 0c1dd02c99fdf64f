"""The judge against a motivated candidate, end to end on real runs of the CPU target: each test
plants one cheat in a starter stack and shows the judge rejecting it with a reason that names it,
or shows that what the cheat patches changes nothing the harness records."""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from planting import FIRED, PLANTS, plant, planted
from typer.testing import CliRunner

from agents.offline.evaluator import OfflineEvaluator
from orchestrator.cli import app
from targets.harness.isolation.launch import Limits
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.measure.session import Session
from targets.harness.target import Target
from targets.spec import CATALOG_DIR

pytestmark = pytest.mark.slow

WARP = '''"""Planted: make the run look ten times faster from inside the controller, without naming any
module or import call the static scan looks for (a scan can always be evaded: what keeps the record
true is the process boundary), and hunt for the harness's trace in this process's memory."""


def warp():
    load = getattr(getattr(print, "__se" + "lf__"), "".join(("__imp", "ort__")))  # a builtin's module: builtins
    modules = getattr(load("s" + "ys"), "mod" + "ules")
    clock = modules["ti" + "me"]
    real = getattr(clock, "mono" + "tonic")
    start = real()
    setattr(clock, "mono" + "tonic", lambda: start + (real() - start) / 10)
    setattr(clock, "perf_" + "counter", getattr(clock, "mono" + "tonic"))
    collector = load("g" + "c")
    names = ("Trace", "TracedCluster", "WallClock", "EnvironmentPool", "VirtualClock")
    found = [o for o in getattr(collector, "get_" + "objects")() if type(o).__name__ in names]
    print(f"WARP: clock patched; harness objects in this process: {len(found)}", flush=True)
'''


def _session(fast_target: Path, sandbox: Sandbox) -> Session:
    return Session(Target.load(fast_target), sandbox, Limits(time_s=300))


def _reasons(measurement) -> str:
    return "\n".join(measurement.reasons)


def test_harness_files_changed_under_a_read_only_sandbox_are_the_checkouts_fault_not_the_candidates(
    tmp_path, fast_target, monkeypatch
):
    """A vibetrain checkout edited (or updated) during a run rejected the running starter for good
    ("harness files changed during the run", paths without their root): under bubblewrap or Docker the
    candidate has them read-only, so the run stops naming the checkout and the round is redone on --resume."""
    from skills.starter import write_starter
    from targets.harness.measure import session as session_module
    from targets.harness.measure.session import EnvironmentFailed

    digests = iter([{"audit.py": "a"}, {"audit.py": "b"}])
    monkeypatch.setattr(session_module, "harness_digest", lambda: next(digests))
    monkeypatch.setattr(session_module, "run_harness", lambda *args, **kwargs: None)  # the run itself: not needed
    stack = write_starter(tmp_path / "c", Target.load(fast_target).spec, "colocate")
    with pytest.raises(EnvironmentFailed, match="vibetrain's own files under .* changed during the run") as caught:
        _session(fast_target, Sandbox("bubblewrap")).measure(stack, tmp_path / "out", seed=1)
    assert caught.value.part == "vibetrain checkout" and "audit.py changed" in str(caught.value)


def test_a_controller_that_patches_the_clock_and_hunts_the_trace_changes_nothing_recorded(
    tmp_path, fast_target, judge_sandbox
):
    stack = planted(
        tmp_path / "c",
        fast_target,
        "time_multiplex",
        {
            "time_multiplex.py": (
                "        rollout, train = self.placement(cluster.devices)\n",
                "        from .warp import warp\n\n        warp()\n        began = cluster.now()\n"
                "        rollout, train = self.placement(cluster.devices)\n",
            ),
        },
        {"warp.py": WARP},
    )
    text = (stack / "stack" / "time_multiplex.py").read_text()
    (stack / "stack" / "time_multiplex.py").write_text(
        text.replace(
            "        await self._finish(buffer, manager)\n",
            "        await self._finish(buffer, manager)\n        print(f'WARP: the controller clock says "
            "{cluster.now() - began:.3f}s', flush=True)\n",
        )
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "check",
            str(fast_target),
            "--stack",
            str(stack),
            "--sandbox",
            judge_sandbox.name,
            "--out",
            str(out),
            "--json",
            str(tmp_path / "check.json"),
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output  # vibetrain check passes: the patch is invisible to the judge ...
    log = (out / "controller.log").read_text()
    assert "harness objects in this process: 0" in log, log  # ... there is no harness state to reach ...
    claimed = float(re.search(r"controller clock says ([\d.]+)s", log).group(1))
    clock = next(c for c in json.loads((tmp_path / "check.json").read_text()) if c["name"] == "clock")
    recorded = clock["details"]["trace_seconds"]
    assert recorded == pytest.approx(
        clock["details"]["parent_seconds"], rel=0.05, abs=0.5
    )  # ... the trace kept real time
    assert claimed < recorded / 5, (claimed, recorded)  # while the controller's own clock ran ten times slow


def test_a_trainer_that_passes_the_check_but_trains_on_half_of_each_system_batch(tmp_path, fast_target, judge_sandbox):
    """The cluster hands its trainers half the batch: check 2 (which meets the trainer alone) passes,
    the system run's training replay does not.

    The plant keeps the half with the smallest advantages: a dropped half of zero advantages would
    change no gradient, and clipping and Adam can then leave the weights within the replay's tolerance."""
    stack = planted(
        tmp_path / "c",
        fast_target,
        "static_split",
        {
            "ray_cluster.py": (
                "versions = await asyncio.gather(*(t.train_step.remote(batch) for t in self._trainers))",
                "order = sorted(range(len(batch.advantages)), key=lambda i: abs(batch.advantages[i]))  # planted\n"
                "        kept = order[: len(order) // 2]\n"
                "        trajectories = [batch.trajectories[i] for i in kept]\n"
                "        batch = TrainBatch(trajectories, [batch.advantages[i] for i in kept])\n"
                "        versions = await asyncio.gather(*(t.train_step.remote(batch) for t in self._trainers))",
            ),
        },
    )
    results = {r.name: r for r in _session(fast_target, judge_sandbox).check(stack, tmp_path / "out")}
    assert results["trainer"].passed
    assert not results["system_audit"].passed
    said = "the weights are not the reference GRPO step"
    assert any(said in reason for reason in results["system_audit"].reasons), results["system_audit"].reasons


def test_an_engine_that_samples_colder_than_the_spec(tmp_path, fast_target, judge_sandbox):
    """At half the spec's temperature the temperature test's z was 24 (the rejection takes about 5);
    at 0.7 of it, 7.6: a margin luck could eat."""
    stack = planted(
        tmp_path / "c",
        fast_target,
        "static_split",
        {
            "paged_engine.py": (
                "torch.multinomial(torch.softmax(tempered, -1), 1, generator=self._generator)",  # a system run's draw
                "torch.multinomial(torch.softmax(tempered * 2, -1), 1, generator=self._generator)",  # planted: at T / 2
            ),
        },
    )
    measurement = _session(fast_target, judge_sandbox).measure(stack, tmp_path / "out", seed=1)
    assert "sampling temperature" in _reasons(measurement), _reasons(measurement)


def test_a_buffer_that_picks_the_shortest_groups(tmp_path, fast_target, judge_sandbox):
    """Waiting for a spare group and training the shortest ones biases training toward short
    episodes: the audit wants the oldest finished first.

    On a target whose staleness bound outlasts the run, so the group held back stays in the buffer
    to the next step. With ``async_ratio: 1`` it often went stale and was handed back before the
    next batch was taken, and when it had finished while the previous batch was awaited, the trace
    was one an honest buffer can leave too (a group whose last answer is still on its way when the
    batch is taken, which then goes stale): the audit cannot tell them apart, and the plant escaped
    (a fresh-clone CI run at a728c35)."""
    data = yaml.safe_load(fast_target.read_text())
    steps = data["workload"]["train_steps"]
    data["workload"].update(async_ratio=steps, max_async_ratio=steps)
    target = tmp_path / "no-stale.yaml"
    target.write_text(yaml.safe_dump(data))
    stack = planted(
        tmp_path / "c",
        target,
        "static_split",
        {
            "sample_buffer.py": (
                "sorted(self._ready, key=self._rank.__getitem__)",
                "sorted(self._ready, key=lambda g: sum(len(t.tokens) for t in self._ready[g]))",
            ),
        },
    )
    text = (stack / "stack" / "sample_buffer.py").read_text()
    (stack / "stack" / "sample_buffer.py").write_text(
        text.replace(
            "            if len(self._ready) >= groups:",
            "            if len(self._ready) >= groups + 1:  # planted: a spare to choose from",
        )
    )
    measurement = _session(target, judge_sandbox).measure(stack, tmp_path / "out", seed=1)
    assert "took younger groups over group" in _reasons(measurement), _reasons(measurement)  # not the engines'


def test_launching_more_episodes_than_training_needs(tmp_path, fast_target, judge_sandbox):
    """Extra episodes would raise rollout throughput; goodput ignores them and the audit bounds them.
    Every measured run is judged: the evaluator's repeat alone rejects the candidate."""
    stack = planted(
        tmp_path / "c",
        fast_target,
        "static_split",
        {
            "controller_base.py": (
                "outstanding = self.groups_per_step * (1 + buffer.async_ratio)",
                "outstanding = self.groups_per_step * (3 + buffer.async_ratio)  # planted",
            ),
        },
    )
    evaluation = OfflineEvaluator(_session(fast_target, judge_sandbox), repeat=1).evaluate(
        stack, tmp_path / "out", None, [11]
    )
    assert any("too many episodes" in finding for finding in evaluation.findings), evaluation.findings


def test_environment_handles_expose_only_the_contract(tmp_path, fast_target, judge_sandbox):
    stack = planted(
        tmp_path / "c",
        fast_target,
        "static_split",
        {
            "env_manager.py": (
                "        t = Trajectory.start(",
                "        budget = episode.max_turns  # planted: peek at the turn limit\n        t = Trajectory.start(",
            ),
        },
    )
    measurement = _session(fast_target, judge_sandbox).measure(stack, tmp_path / "out", seed=1)
    assert "has no attribute 'max_turns'" in _reasons(measurement), _reasons(measurement)


def test_a_candidate_that_rewrites_its_own_files_during_the_run(
    tmp_path, fast_target, sandbox, judge_sandbox, monkeypatch
):
    """Unsandboxed (subprocess, on the shared Ray cluster) the writes land, to its own files and to the
    harness's, and the before/after hashes catch both; in bubblewrap the candidate's directory is
    read-only, the harness not even visible, and no write lands: its whole check passes there, as a
    user's ``vibetrain check`` runs it (the default sandbox, a Ray cluster of its own). (The harness the
    hash reads is a copy here, so the plant never edits the repository: ``HARNESS_ROOT`` points at it.)"""
    from targets.harness.judge import integrity

    harness = tmp_path / "harness"
    harness.mkdir()
    (harness / "audit.py").write_text("BOUND = 1\n")
    (harness / "gone.py").write_text("GONE = 1\n")
    monkeypatch.setattr(integrity, "HARNESS_ROOT", harness)
    # what Python imports in place of a source: a bytecode cache forged under its header, an extension module
    cache = Path(importlib.util.cache_from_source(str(harness / "audit.py")))
    extension = harness / f"replay{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    plant = {
        "static_split.py": (
            "        rollout, train = self.placement(cluster.devices)\n",
            "        import pathlib\n        try:\n"
            "            target = pathlib.Path(__file__).with_name('params.json')\n"
            "            target.write_text(target.read_text() + ' ')  # planted\n"
            f"            pathlib.Path('{harness / 'audit.py'}').write_text('BOUND = 99\\n')  # planted\n"
            f"            pathlib.Path('{cache}').write_bytes(pathlib.Path('{cache}').read_bytes() + b'x')  # planted\n"
            f"            pathlib.Path('{extension}').write_bytes(b'ELF')  # planted\n"
            f"            pathlib.Path('{harness / 'gone.py'}').unlink()  # planted\n"
            "        except OSError as error:\n            print('REFUSED', error, flush=True)\n"
            "        rollout, train = self.placement(cluster.devices)\n",
        )
    }
    stack = planted(tmp_path / "c", fast_target, "static_split", plant)
    measurement = _session(fast_target, judge_sandbox).measure(stack, tmp_path / "out", seed=1)
    assert "candidate_unchanged" in _reasons(measurement), _reasons(measurement)
    forged = str(cache.relative_to(harness))
    said = f"harness files under {harness} changed during the run: {forged} changed, audit.py changed, "
    said += f"{extension.name} added, "
    assert said + "gone.py removed" in _reasons(measurement), _reasons(measurement)
    (harness / "audit.py").write_text("BOUND = 1\n")
    (harness / "gone.py").write_text("GONE = 1\n")
    extension.unlink(missing_ok=True)
    if sandbox.backend != "bubblewrap":  # said, not passed over: the half above ran and held
        pytest.skip("bubblewrap unusable here: its half (every such write refused, the run judged) did not run")
    again = planted(tmp_path / "d", fast_target, "static_split", plant)
    measurement = _session(fast_target, sandbox).judge(again, tmp_path / "out2", seed=1)
    assert measurement.ok, _reasons(measurement)
    assert {"engine", "trainer", "weight_sync", "system_audit"} <= {c.name for c in measurement.checks}
    assert "REFUSED" in (tmp_path / "out2" / "controller.log").read_text()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_the_sandbox_shows_no_host_files_beyond_what_the_run_needs(tmp_path):
    import os
    import subprocess
    import sys

    from targets.cache import cache_home

    secret = Path.home() / f"vibetrain-secret-{os.getpid()}"
    harness_out = tmp_path / "harness-out"
    harness_out.mkdir()
    secret.write_text("api key")
    # the cache's models are the candidate's to read; not what else it holds (a CLI agent's login, copied there
    # for the length of its call, once mounted with the whole cache)
    login = cache_home() / "codex-homes" / f"home-probe-{os.getpid()}" / "auth.json"
    login.parent.mkdir(parents=True)
    login.write_text("a login")
    probe = (
        "import os, pathlib\n"
        f"print('secret', pathlib.Path('{secret}').exists())\n"
        f"print('login', pathlib.Path('{login}').exists())\n"
        f"print('models', pathlib.Path('{login.parents[2] / 'models'}').is_dir())\n"
        f"print('harness', pathlib.Path('{harness_out}').exists())\n"
        "print('home', sorted(os.listdir(os.environ['HOME'])))\n"
        "print('etc shadow', pathlib.Path('/etc/shadow').exists())\n"
    )
    (tmp_path / "w").mkdir()
    try:
        command, env = Sandbox.detect("bubblewrap").wrap(
            [sys.executable, "-c", probe], dict(os.environ), writable=[tmp_path / "w"]
        )
        result = subprocess.run(command, env=env or None, capture_output=True, text=True, timeout=60)
    finally:
        secret.unlink()
        shutil.rmtree(login.parent)
    assert result.returncode == 0, result.stderr
    assert "secret False" in result.stdout and "harness False" in result.stdout, result.stdout
    assert "login False" in result.stdout and "models True" in result.stdout, result.stdout
    assert "home []" in result.stdout and "etc shadow False" in result.stdout, result.stdout


def test_a_killed_command_takes_the_candidate_processes_with_it(tmp_path, fast_target, monkeypatch):
    """`timeout vibetrain check ...` sends SIGTERM: the candidate's processes (in their own sessions)
    must not outlive the command and keep holding memory and devices. Its Ray cluster is its own (the
    session's shared one would hold its actors outside the command's tree)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from targets.harness.isolation.process_tree import process_tree

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    stack = tmp_path / "cand"
    cli = [sys.executable, "-m", "orchestrator.cli"]
    subprocess.run(
        [*cli, "starter", str(fast_target), "--out", str(stack), "--controller", "time_multiplex"],
        check=True,
        capture_output=True,
    )
    command = subprocess.Popen(
        [*cli, "check", str(fast_target), "--stack", str(stack), "--sandbox", "subprocess"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline, tree = time.monotonic() + 120, []
    while time.monotonic() < deadline and len(tree) < 3:  # the command, the harness child, a candidate process
        time.sleep(0.5)
        tree = process_tree(command.pid)
    assert len(tree) >= 3, f"the check never started its candidate processes: {tree}"
    command.send_signal(signal.SIGTERM)
    assert command.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    alive = tree[1:]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in alive if os.path.exists(f"/proc/{pid}") and _state(pid) != "Z"]
    assert not alive, f"left running after the command was killed: {alive}"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"  # gone while we looked


def test_a_stack_honest_only_on_the_checks_known_tasks_gains_nothing(tmp_path, fast_target, judge_sandbox):
    """The plant recognises the check by its first eight groups' opening observations, as the public
    seed 0 makes them, and launches more episodes than training needs once one differs. Under the
    public derivation (what every check ran before the workload key) it passes; a session draws a secret
    key that every run it judges uses (a check's and a measured run's alike: these are measured, seed 0
    both), so the plant never recognises it and is rejected. (One opening would not do: the
    CPU target's shows one of four letters, so a secret draw matched it one run in four.)"""
    from targets.harness.clock import WallClock
    from targets.harness.environments import EnvironmentPool
    from targets.harness.trace import Trace
    from targets.spec import parse_target

    spec = parse_target(__import__("yaml").safe_load(fast_target.read_text()))
    pool = EnvironmentPool(spec.workload, WallClock(), Trace(WallClock()), seed=0)
    known = {f"g{k}": list(asyncio.run(pool.new_group()[0].reset())) for k in range(8)}
    stack = planted(
        tmp_path / "c",
        fast_target,
        "static_split",
        {
            "env_manager.py": (
                "        t = Trajectory.start(episode.episode_id, episode.group_id, await episode.reset())",
                "        t = Trajectory.start(episode.episode_id, episode.group_id, await episode.reset())\n"
                "        if episode.episode_id in {f'{g}/e0' for g in KNOWN}:  # planted: the check's known tasks?\n"
                "            if list(t.tokens) != KNOWN[episode.group_id]:\n"
                "                SEEN['check'] = False",
            ),
            "controller_base.py": (
                "            manager.launch(max(0, outstanding - manager.groups_in_flight - buffer.ready_groups"
                " - buffer.streamed))",
                "            extra = 2 * self.groups_per_step if SEEN.get('check') is False else 0  # planted\n"
                "            ahead = outstanding + extra\n"
                "            manager.launch(max(0, ahead - manager.groups_in_flight - buffer.ready_groups"
                " - buffer.streamed))",
            ),
        },
    )
    for name, old, new in (
        (
            "env_manager.py",
            "from .sample_buffer import GroupBuffer\n",
            f"from .sample_buffer import GroupBuffer\n\nSEEN = {{}}\nKNOWN = {known!r}\n",
        ),
        (
            "controller_base.py",
            "from .env_manager import EnvManager\n",
            "from .env_manager import SEEN, EnvManager\n",
        ),
    ):
        path = stack / "stack" / name
        path.write_text(path.read_text().replace(old, new, 1))
    public = Session(Target.load(fast_target), judge_sandbox, Limits(time_s=300), task_key=b"")
    known_run = public.measure(stack, tmp_path / "public", seed=0).checks
    assert all(c.passed for c in known_run), [c.reasons for c in known_run]  # the plant passes when it knows
    secret = _session(fast_target, judge_sandbox).measure(stack, tmp_path / "secret", seed=0)
    results = {r.name: r for r in secret.checks}
    assert not results["system_audit"].passed
    assert any("too many episodes" in reason for reason in results["system_audit"].reasons)


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_plant_that_chooses_its_samples_is_rejected_by_name(tmp_path, fast_target, judge_sandbox, name):
    """Each plant (tests/planting.py) passed last round's judge while choosing which samples train or
    which tokens were drawn: the engine preferring the stop token where it is typical (the temperature
    test's sum stays near its target: it caught this plant in 1 of 3 runs, the stop calibration in
    every one), one decode copied to every request for the same prompt, empty partials
    for turns that had decoded (so they restart from scratch), deferral of groups that had not waited a
    whole step (a relaunch redraws them).

    The empty-partial rule needs a witness (a request the engine received later that decoded first).
    On the fast target's four steps it found one in 2 of 6 runs in which the plant acted; on the CPU
    target's eight steps in 9 of 10, so that plant runs there, on up to eight seeds as a candidate's
    check and measured runs are each audited: it must be caught in one run in which it acted (a run
    in which it did not act, or found no witness, is the documented gap, not a failure)."""
    target = CATALOG_DIR / "tiny-qwen3-cpu.yaml" if name == "empty_partials" else fast_target
    candidate = plant(name, tmp_path / "c", target)
    acted = []
    for seed in range(3, 11) if name == "empty_partials" else (3, 4):  # it stops at the first catch
        out = tmp_path / f"o{seed}"
        reasons = _reasons(_session(target, judge_sandbox).measure(candidate, out, seed))
        if name == "empty_partials":
            acted.append(FIRED in (out / "cluster.log").read_text())
            if not acted[-1]:
                continue  # the plant emptied no partial in this run: there was nothing to catch
        if PLANTS[name][3] in reasons:
            break
    assert PLANTS[name][3] in reasons, (acted, reasons)


def test_a_real_runs_trace_survives_a_kill_up_to_its_last_step(tmp_path):
    """The first GPU check of 2026-11-28 was cut at its stage's limit after ~200 s of system run and left
    no trace: the harness saved it only when the run ended. It is now written as it is recorded, flushed
    at every train and sync, so a kill leaves every step done; ``save`` then writes the whole trace."""
    import subprocess
    import sys

    path = tmp_path / "trace.jsonl"
    script = f"""
import os, signal
from pathlib import Path
from targets.harness.clock import WallClock
from targets.harness.trace import Trace
trace = Trace(WallClock())
trace.stream_to(Path({str(path)!r}))
trace.record("run_start")
trace.record("generate", tokens=[1, 2, 3])
trace.record("train", version=1, tokens=3)
os.kill(os.getpid(), signal.SIGKILL)
"""
    killed = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parent.parent)
    assert killed.returncode == -9
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    assert kinds == ["run_start", "generate", "train"]

    from targets.harness.clock import WallClock
    from targets.harness.trace import Trace

    trace = Trace(WallClock())
    trace.stream_to(path)
    trace.record("run_start")
    trace.record("generate", tokens=[4])
    trace.save(path)
    assert [e.kind for e in Trace.load_events(path)] == ["run_start", "generate"]


def test_an_episode_is_held_only_while_others_generate_and_until_it_finishes():
    """The controller link's count (``episode_activity.py``): an episode with nothing under way is held
    only while another's generate request is; a pause of the whole rollout (nothing generating, or the
    cluster suspended) holds no one, and a finished episode waiting to be trained is not held."""
    from targets.harness.isolation.episode_activity import EpisodeActivity

    now = [0.0]
    activity = EpisodeActivity(lambda: now[0])
    for episode in ("a", "b", "c"):
        activity.created(episode)
    activity.begin("a", generate=True)
    activity.begin("c", generate=True)
    now[0] = 4.0  # b sits idle while a and c generate: held 4 s
    activity.end("a", generate=True)
    activity.end("c", generate=True)
    activity.begin("c")
    now[0] = 10.0  # nothing generates (c's tool call runs): a and b are idle, held by no one
    activity.end("c", finished=True)
    activity.begin("b", generate=True)
    now[0] = 13.0  # b generates: a is held 3 s more; c, finished, is not
    b, a, c = activity.of("b"), activity.of("a"), activity.of("c")
    assert (b.idle_s, b.idle_total_s, b.held_s, b.serving_s) == (0.0, 10.0, 4.0, 7.0)
    assert (a.idle_s, a.idle_total_s, a.held_s, a.serving_s) == (9.0, 9.0, 3.0, 7.0)
    assert (c.idle_s, c.held_s) == (0.0, 0.0)
    assert (b.waiting_s, a.waiting_s) == (3.0, 0.0)  # b's request has been under way 3 s
    activity.suspended(True)
    now[0] = 20.0  # the rollout suspended, b's request parked in the cluster: a is held by no one
    activity.suspended(False)
    now[0] = 21.0
    assert activity.of("a").held_s == 4.0 and activity.of("a").serving_s == 8.0
    assert activity.of("never created") is None


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_a_model_directory_outside_the_cache_is_readable_to_a_bubblewrapped_candidate(tmp_path, fast_target):
    """The bubblewrap sandbox showed the candidate vibetrain's cache, Python and its stack: a user's model
    directory anywhere else was missing to it, and every candidate failed to build an engine (a review of
    user input). The directory is readable now, and where its files link (a Hugging Face snapshot's blobs)."""
    from skills.starter import write_starter
    from targets.harness.isolation.launch import run_harness
    from targets.harness.model import model_dir
    from targets.spec import parse_target

    data = yaml.safe_load(fast_target.read_text())
    mine, blobs = tmp_path / "models" / "mine", tmp_path / "blobs"
    shutil.copytree(model_dir(parse_target(data).model), mine)
    blobs.mkdir()
    (mine / "model.safetensors").rename(blobs / "0123abcd")
    (mine / "model.safetensors").symlink_to(blobs / "0123abcd")
    data["model"]["weights"] = str(mine)
    path = tmp_path / "target.yaml"
    path.write_text(yaml.safe_dump(data))
    target = Target.load(path)
    stack = write_starter(tmp_path / "stack", target.spec, "colocate")
    run = run_harness(target, stack, tmp_path / "out", "accuracy", Limits(time_s=300), Sandbox("bubblewrap"))
    assert run.ok, run.cause
    assert all(c["passed"] for c in run.results["accuracy"]["checks"]), run.results["accuracy"]
