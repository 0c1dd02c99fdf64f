"""``vibetrain export``: the exported project trains from its own launcher with nothing of vibetrain
importable, and the export refuses what it cannot carry."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import git
import pytest
import yaml
from typer.testing import CliRunner

from orchestrator import export as export_module
from orchestrator.cli import app
from orchestrator.export import PACKAGE, SOURCE_ROOT, ExportError, _module_file, export_project, resolve_candidate
from orchestrator.history import History
from orchestrator.runs import RunSetupError, export_candidate
from skills.starter import write_starter
from targets.spec import load_target

runner = CliRunner()
VIBETRAIN_PACKAGES = ("targets", "orchestrator", "skills", "agents")
STEP_LINE = re.compile(r"^step (\d+)/(\d+) reward (\S+) step_time (\S+)s train_time (\S+)s", re.MULTILINE)

# Every process started with this directory on PYTHONPATH (the launcher and the Ray workers it
# starts, which inherit PYTHONPATH) fails to import vibetrain's packages, installed or not.
BLOCKER = f"""
import sys

class _NoVibetrain:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {VIBETRAIN_PACKAGES!r}:
            raise ImportError(f"{{name}}: vibetrain is not importable from an exported project")
        return None

sys.meta_path.insert(0, _NoVibetrain())
"""


@pytest.fixture
def starter(tmp_path, fast_target):
    return write_starter(tmp_path / "candidate", load_target(fast_target), "time_multiplex")


@pytest.fixture
def without_vibetrain(tmp_path) -> dict[str, str]:
    """An environment in which no process can import vibetrain's packages (checked here)."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    probe = subprocess.run([sys.executable, "-c", "import targets.api"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "vibetrain is not importable" in probe.stderr
    return env


def _imports(root: Path) -> set[str]:
    names = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module)
    return names


def _train(out: Path, env: dict[str, str], *options: str) -> subprocess.CompletedProcess:
    """The exported launcher's two training steps, which must succeed."""
    run = subprocess.run(
        [sys.executable, "train.py", "--steps", "2", *options],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


@pytest.mark.slow
def test_an_exported_starter_trains_from_its_launcher_with_vibetrain_unimportable(
    tmp_path, starter, fast_target, without_vibetrain
):
    out = tmp_path / "exported"
    result = runner.invoke(app, ["export", str(starter), "--out", str(out), "--target", str(fast_target)])
    assert result.exit_code == 0, result.output
    assert {n.split(".")[0] for n in _imports(out)}.isdisjoint(VIBETRAIN_PACKAGES)
    assert f"{PACKAGE}.api" in _imports(out / "stack")
    assert "pip install -r requirements.txt" in (out / "README.md").read_text()

    run = _train(out, without_vibetrain, "--track", "jsonl")
    steps = STEP_LINE.findall(run.stdout)
    assert [(int(s), int(n)) for s, n, *_ in steps] == [(1, 2), (2, 2)], run.stdout
    for _, _, reward, step_time, train_time in steps:
        assert 0.0 <= float(reward) <= 1.0 and math.isfinite(float(reward))
        assert float(step_time) >= float(train_time) > 0.0
    assert "done: 2 step(s)" in run.stdout
    tracked = [json.loads(line) for line in (out / "track" / "metrics.jsonl").read_text().splitlines()]
    assert [t["step"] for t in tracked] == [1, 2] and tracked[1]["system/samples"] == 2 * tracked[0]["system/samples"]
    assert all(t["time/step_total"] >= t["time/step_train"] > 0 for t in tracked)


def test_vendored_modules_are_vibetrains_with_only_their_imports_renamed(tmp_path, starter, fast_target):
    exported = export_project(starter, str(fast_target), tmp_path / "out")
    assert {"targets.api", "targets.harness.environments.pool", "targets.harness.target"} <= set(exported.vendored)
    for module in exported.vendored:
        original = _module_file(module)
        copy = tmp_path / "out" / PACKAGE / original.relative_to(SOURCE_ROOT / "targets")
        lines, copied = original.read_text().splitlines(), copy.read_text().splitlines()
        assert len(lines) == len(copied), module
        changed = [(a, b) for a, b in zip(lines, copied) if a != b]
        assert all(b == a.replace("targets", PACKAGE, 1) and "import" in a for a, b in changed), (module, changed)
    torch_version = __import__("torch").__version__.split("+")[0]
    assert f"torch=={torch_version}" in exported.requirements
    assert not any(r.lower().startswith(("vllm", "flashinfer")) for r in exported.requirements)
    assert "vllm" in exported.optional  # an optional engine: listed in the README, never installed by it
    assert load_target(tmp_path / "out" / "target.yaml") == load_target(fast_target)


def test_an_out_that_is_a_file_or_a_non_empty_directory_is_refused(tmp_path, starter):
    file = tmp_path / "file"
    file.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    for out, says in ((file, "a file is there"), (full, "is a directory that is not empty")):
        result = runner.invoke(app, ["export", str(starter), "--out", str(out), "--target", "tiny-qwen3-cpu"])
        assert result.exit_code == 2 and says in result.output, result.output
    assert (full / "keep.txt").read_text() == "mine" and sorted(p.name for p in full.iterdir()) == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    export_project(starter, "tiny-qwen3-cpu", empty)  # an empty directory is filled
    assert (empty / "train.py").is_file() and not list(tmp_path.glob(".empty-export-*"))


def test_a_stack_asking_for_more_devices_than_the_target_has_is_refused_before_anything_is_written(tmp_path):
    """The best of a 16-device run exported for the 2-device CPU target: train.py would fail the stack's own
    placement check; the export names the parameter instead."""
    big = write_starter(tmp_path / "big", load_target("qwen3-8b-h800x16"), "time_multiplex")
    with pytest.raises(ExportError, match=r"does not fit target tiny-qwen3-cpu \(2 devices\): train_devices=8 outside"):
        export_project(big, "tiny-qwen3-cpu", tmp_path / "out")
    (big / "stack" / "params.json").write_text("{not json")
    with pytest.raises(ExportError, match=r"params.json: not JSON"):
        export_project(big, "tiny-qwen3-cpu", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out-export-*"))


def test_a_stack_importing_vibetrain_internals_is_refused_by_file_and_line(tmp_path, starter):
    (starter / "stack" / "sneaky.py").write_text('"""x"""\n\nfrom orchestrator.state import RunState\n')
    with pytest.raises(ExportError, match=r"stack/sneaky.py:3 imports orchestrator.state"):
        export_project(starter, "tiny-qwen3-cpu", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out-export-*"))
    (starter / "stack" / "sneaky.py").write_text("def broken(:\n")
    with pytest.raises(ExportError, match=r"stack/sneaky.py:1: not valid Python"):
        export_project(starter, "tiny-qwen3-cpu", tmp_path / "out")


def test_a_candidate_directory_needs_its_target_and_a_missing_run_is_named(tmp_path, starter):
    with pytest.raises(ExportError, match="--target TARGET"):
        resolve_candidate(str(starter), None)
    with pytest.raises(ExportError, match="not RUN@best"):
        resolve_candidate(str(tmp_path / "nowhere"), None)
    (tmp_path / "plain").mkdir()  # a folder that is no candidate: said so, not asked for its target
    with pytest.raises(ExportError, match="plain is a directory but not a candidate"):
        resolve_candidate(str(tmp_path / "plain"), "tiny-qwen3-cpu")
    result = runner.invoke(app, ["export", f"{tmp_path / 'norun'}@best", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "norun" in result.output and "Traceback" not in result.output


def test_a_run_with_no_validated_candidate_says_so_for_best(tmp_path):
    """``best`` points at the run's empty first commit until a candidate is validated: export and bench of
    RUN@best read it as a candidate and ended in tarfile's ReadError traceback."""
    from orchestrator.history import History
    from orchestrator.state import new_state
    from tests.review_run import run_config

    run = tmp_path / "run"
    History.create(run, "vibetrain run: test").release()
    new_state(run_config()).save(run)
    result = runner.invoke(app, ["export", f"{run}@best", "--out", str(tmp_path / "o")], env={"COLUMNS": "200"})
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "has no validated candidate yet" in said and "Traceback" not in said, said
    # and `log`, which export's message points to, printed a table's header alone (round 0 cut short)
    logged = " ".join(runner.invoke(app, ["log", str(run)], env={"COLUMNS": "200"}).output.split())
    assert "no round has finished yet; one cut short is redone by: vibetrain generate" in logged, logged
    assert f"--resume --out {run}" in logged


def test_a_candidate_reference_the_run_does_not_know_says_how_to_write_one(tmp_path):
    from tests.review_run import make_review_run

    run = make_review_run(tmp_path)
    result = runner.invoke(app, ["export", f"{run}@3", "--out", str(tmp_path / "o")], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "write RUN@best, RUN@latest, RUN@round-N or RUN@<commit>" in result.output
    # a misspelt name: git's own words (stderr: 'fatal: not a valid object name') and no suggestion before
    result = runner.invoke(app, ["export", f"{run}@bets", "--out", str(tmp_path / "o")], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and f"has no commit 'bets' (did you mean {run}@best?)" in result.output
    assert "fatal" not in result.output
    # the run itself, @best forgotten: it was told to name a target for the run's checked-out tree
    result = runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "o")], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and f"{run} is a run: export one of its candidates ({run}@best" in result.output
    # a run folder that is not there, or a file: said so, not "has no run state"
    for missing in (tmp_path / "nosuchrun", tmp_path / "afile"):
        result = runner.invoke(app, ["log", str(missing)], env={"COLUMNS": "200"})
        assert result.exit_code == 2 and "give the folder a run was started in" in result.output, result.output
        (tmp_path / "afile").write_text("x")
    # RUN@best is where the run's best is now: the export names the commit it read (its README says it)
    best = History.open(run).best()
    assert best and resolve_candidate(f"{run}@best", "tiny-qwen3-cpu")[2] == f"{run}@best, commit {best}"
    # one grammar: RUN@latest is the last round (it reached git as a commit name), show takes round-N
    latest = runner.invoke(app, ["export", f"{run}@latest", "--out", str(tmp_path / "o")], env={"COLUMNS": "200"})
    assert latest.exit_code == 2 and "round 2 was rejected" in latest.output, latest.output  # the review run's last
    shown = runner.invoke(app, ["show", str(run), "round-1"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "Round 1" in shown.output, shown.output
    result = runner.invoke(app, ["export", f"{run}@round-9", "--out", str(tmp_path / "o")], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "no such candidate" in result.output
    # a round the judge rejected is there, under its own ref: said so, with the commit that reads it
    result = runner.invoke(app, ["export", f"{run}@round-2", "--out", str(tmp_path / "o")], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and f"round 2 was rejected (its attempt: {run}@" in result.output, result.output
    # a superscript is a digit to str.isdigit, not to int(); a git repository that is no run has no best:
    # all three were tracebacks (check resolves --stack first)
    result = runner.invoke(app, ["show", str(run), "\u00b2"], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "ROUND must be a round number" in result.output
    repo = git.Repo.init(tmp_path / "not-a-run")
    (tmp_path / "not-a-run" / "x").write_text("x")
    repo.index.add(["x"])
    repo.index.commit("x")
    for ref in (f"{run}@round-\u00b2", f"{tmp_path / 'not-a-run'}@best"):
        result = runner.invoke(app, ["check", "no-such-target", "--stack", ref], env={"COLUMNS": "200"})
        assert result.exit_code == 2, result.output  # an error message: a crash exits 1
    with pytest.raises(RunSetupError, match="not-a-run has no round with a commit yet"):  # was: no candidate "latest"
        export_candidate(f"{tmp_path / 'not-a-run'}@latest")


def test_the_launcher_refuses_a_target_whose_hardware_this_machine_lacks(tmp_path, without_vibetrain):
    spec = load_target("qwen3-8b-h100x8")  # 8 GPUs: simulated here, and on any test machine with fewer
    out = tmp_path / "exported"
    export_project(write_starter(tmp_path / "candidate", spec, "time_multiplex"), spec.id, out)
    run = subprocess.run(
        [sys.executable, "train.py"], cwd=out, env=without_vibetrain, capture_output=True, text=True, timeout=300
    )
    assert run.returncode != 0 and "step 1/" not in run.stdout
    assert "trains on 8x h100 device(s)" in run.stderr and "this machine has" in run.stderr, run.stderr[-2000:]
    # a target the catalog simulates (for the search) trains on its hardware once exported: its
    # execution was kept as "simulated", and train.py refused on any machine, 16 H800s too
    spec = load_target("qwen3-8b-h800x16")
    out = tmp_path / "exported-at-scale"
    export_project(write_starter(tmp_path / "candidate-at-scale", spec, "time_multiplex"), spec.id, out)
    assert yaml.safe_load((out / "target.yaml").read_text())["execution"] == "auto"


USER_ENVIRONMENT = '''
import random
import re

from targets.api import TextStep


class HiddenNumber:
    """A text environment (async): find a number from 1 to 3; any answer without it goes on."""

    async def reset(self, task):
        self.secret = random.Random(task).randint(1, 3)
        return "Guess a number from 1 to 3."

    async def step(self, action):
        found = re.findall(r"\\d+", action)
        if found and int(found[0]) == self.secret:
            return TextStep("Correct!", 1.0, True)
        return TextStep("Again.", 0.0, False)
'''


def _user_target(tmp_path: Path, fast_target: Path, monkeypatch, source: str = USER_ENVIRONMENT) -> Path:
    """The fast target on the user's own module (importable where vibetrain exports it, nowhere else)."""
    package = tmp_path / "users_code"
    package.mkdir()
    (package / "number_envs.py").write_text(source)
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.delitem(sys.modules, "number_envs", raising=False)  # another test's copy, imported earlier
    data = yaml.safe_load(fast_target.read_text())
    data["model"]["tokenizer"] = "bpe"
    data["model"]["config"]["vocab_size"] = 320
    data["workload"].update(environment={"entry": "number_envs:HiddenNumber", "adapter": "text"}, turns={"max": 3})
    target = tmp_path / "target.yaml"
    target.write_text(yaml.safe_dump(data))
    return target


def test_an_export_carries_the_environment_the_target_names(tmp_path):
    """An installed ecosystem package is pinned; the BPE tokenizer's corpus comes with the tokenizer."""
    pytest.importorskip("reasoning_gym", reason="reasoning-gym comes with the envs extra: pip install -e '.[envs]'")
    spec = load_target("tiny-qwen3-cpu-arithmetic")
    candidate = write_starter(tmp_path / "candidate", spec, "colocate")
    exported = export_project(candidate, "tiny-qwen3-cpu-arithmetic", tmp_path / "out")
    version = __import__("importlib.metadata").metadata.version("reasoning_gym")
    assert f"reasoning_gym=={version}" in exported.requirements
    assert f"reasoning_gym=={version}\n" in (tmp_path / "out" / "requirements.txt").read_text()
    assert (tmp_path / "out" / PACKAGE / "harness" / "tokenizer_corpus.txt").is_file()
    assert "comes from `reasoning_gym==" in (tmp_path / "out" / "README.md").read_text()


def test_a_users_package_installed_from_a_directory_is_copied_not_pinned(tmp_path, fast_target, monkeypatch):
    """An editable or path install (PEP 610's direct_url.json) is not on an index, or is someone else's
    there: its source goes with the export."""
    pytest.importorskip("tabulate", reason="reasoning-gym's dependency, with the envs extra")
    source = USER_ENVIRONMENT.replace("import re\n", "import re\n\nimport tabulate  # noqa: F401\n")
    target = _user_target(tmp_path, fast_target, monkeypatch, source)
    site = tmp_path / "site" / "n_e-1.0.dist-info"  # installed as pip records a local directory's install
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: n-e\nVersion: 1.0\n")
    (site / "top_level.txt").write_text("number_envs\n")
    (site / "direct_url.json").write_text('{"url": "file:///home/me/number-envs", "dir_info": {"editable": true}}')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert "n-e" in export_module.importlib.metadata.packages_distributions()["number_envs"]
    candidate = write_starter(tmp_path / "candidate", load_target(target), "colocate")
    exported = export_project(candidate, str(target), tmp_path / "out")
    assert exported.environment == "number_envs.py (copied)" and not any("n-e" in r for r in exported.requirements)
    copied = (tmp_path / "out" / "number_envs.py").read_text()
    assert f"from {PACKAGE}.api import TextStep" in copied  # rewritten as the stack is
    assert copied.replace(PACKAGE, "targets", 1) == source
    version = __import__("importlib.metadata").metadata.version("tabulate")
    assert f"tabulate=={version}" in exported.requirements  # what the copied environment imports: required
    assert "number_envs" not in exported.optional  # itself: the export's own now


@pytest.mark.slow
def test_an_export_trains_on_the_users_own_environment_copied_beside_its_launcher(
    tmp_path, fast_target, without_vibetrain, monkeypatch
):
    target = _user_target(tmp_path, fast_target, monkeypatch)
    candidate = write_starter(tmp_path / "candidate", load_target(target), "time_multiplex")
    out = tmp_path / "exported"
    result = runner.invoke(app, ["export", str(candidate), "--out", str(out), "--target", str(target)])
    assert result.exit_code == 0, result.output
    assert (out / "number_envs.py").read_text() == USER_ENVIRONMENT.replace("targets.api", f"{PACKAGE}.api")
    assert "comes from `number_envs.py (copied)`" in (out / "README.md").read_text()
    run = _train(out, without_vibetrain)
    assert [int(s) for s, *_ in STEP_LINE.findall(run.stdout)] == [1, 2], run.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["check", "tiny-qwen3-cpu"],
        ["calibrate", "tiny-qwen3-cpu"],
        ["workload", "profile", "tiny-qwen3-cpu", "--out", "p.yaml"],
    ],
    ids=["check", "calibrate", "workload profile"],
)
def test_every_command_that_takes_a_stack_takes_a_runs_candidate(tmp_path, command):
    """bench took RUN@best and check, calibrate and profile said it did not exist: each now exports it
    (this run's commits hold no stack package, which is what each then says, of the exported folder)."""
    from tests.review_run import make_review_run

    run = make_review_run(tmp_path)
    result = runner.invoke(app, [*command, "--stack", f"{run}@best"], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert "run@best holds no stack/__init__.py" in result.output and "does not exist" not in result.output
