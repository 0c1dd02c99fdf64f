"""The committed GPU script's own checks, on CPU (its stages run in ``gpu_run.py run --rehearse``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_run.py"


def test_setup_names_wheels_built_for_another_python_instead_of_failing_in_pip(tmp_path):
    """A rehearsal beside the folder ``prepare`` filled for the GPU machine's Python 3.12 ended in pip's
    traceback; setup names the wheels and the Python, and installs nothing."""
    other = "cp39" if sys.version_info[:2] != (3, 9) else "cp310"
    (tmp_path / f"orjson-3.13.0-{other}-{other}-manylinux_2_17_x86_64.whl").write_bytes(b"")
    (tmp_path / "gitpython-3.2.1-py3-none-any.whl").write_bytes(b"")  # pure Python: any interpreter's
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "setup", "--wheels", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"orjson-3.13.0-{other}" in done.stderr and "another Python" in done.stderr, done.stderr
    assert "gitpython" not in done.stderr and "Traceback" not in done.stderr


def _script():
    """``benchmarks/gpu_run.py`` as a module (a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _junit(path: Path, failed: list[str], passed: list[str]) -> None:
    cases = [f'<testcase classname="tests.test_gpu" name="{n}"><failure message="x"/></testcase>' for n in failed]
    cases += [f'<testcase classname="tests.test_gpu" name="{n}"/>' for n in passed]
    path.write_text(f'<testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>')


def test_a_failed_default_engine_falls_back_to_the_first_engine_whose_test_passes_alone_and_says_so(
    tmp_path, monkeypatch
):
    """The H200 run of 11-29 lost its check to one Triton kernel; now the check's stack drops the fused
    kernels (or the Triton attention) when the GPU tests failed the default engine, each fallback's
    test rerun in a process of its own, and ``stages.json`` names what was dropped and why."""
    import json

    gpu_run = _script()
    monkeypatch.setattr(gpu_run.signal, "signal", lambda *handler: None)  # pytest's SIGTERM stays pytest's
    out = tmp_path / "out"
    stages = gpu_run.Stages(out, deadline_s=300)
    # a stand-in for pytest, reporting as pytest does: the unfused Triton engine's test skipped (exit 0,
    # not a pass), the bf16 SDPA engine's test passed
    stand_in = (
        "import sys\n"
        "name = sys.argv[sys.argv.index('-k') + 1]\n"
        "report = next(a for a in sys.argv if a.startswith('--junitxml=')).split('=', 1)[1]\n"
        "skip = '' if 'sdpa' in name else '<skipped message=\"no triton\"/>'\n"
        "open(report, 'w').write(f'<testsuites><testsuite><testcase name=\"{name}\">{skip}</testcase>"
        "</testsuite></testsuites>')\n"
    )
    tests = [sys.executable, "-c", stand_in]
    _junit(out / "gpu_tests.xml", [gpu_run.DEFAULT_ENGINE_TEST], ["test_cuda_graph_decode_gives_the_eager_tokens"])
    options = gpu_run.engine_fallback(stages, tests, {})
    assert options == {"attention": "sdpa", "fused_kernels": False}
    recorded = json.loads((out / "stages.json").read_text())["stages"]
    assert recorded["fallback_unfused"]["status"] == "ok" and recorded["fallback_sdpa"]["status"] == "ok"
    assert "-k test_triton_engine_without_the_fused_kernels" in recorded["fallback_unfused"]["command"]
    assert "-k test_sdpa_engine_in_bf16_passes_checks_1_and_3" in recorded["fallback_sdpa"]["command"]
    assert recorded["engine"]["options"] == options and gpu_run.DEFAULT_ENGINE_TEST in recorded["engine"]["status"]

    # the check's starter takes them (its other parameters the defaults), and so does generate's round 0
    from typer.testing import CliRunner

    from orchestrator.cli import app
    from skills.recipes.build import _validate_params
    from skills.starter import starter_params
    from targets.spec import load_target

    starter = ["starter", "qwen3-0.6b-h100x1", "--out", str(tmp_path / "starter"), "--controller", "colocate"]
    written = CliRunner().invoke(app, [*starter, *gpu_run.param_flags(options, "--param")])
    assert written.exit_code == 0, written.output
    params = json.loads((tmp_path / "starter" / "stack" / "params.json").read_text())
    assert params == {**starter_params(load_target("qwen3-0.6b-h100x1"), "colocate"), **options}
    _validate_params(params)
    generate = ["generate", "qwen3-0.6b-h100x1", *gpu_run.param_flags(options, "--starter-param"), "--print-config"]
    printed = CliRunner().invoke(app, generate)
    assert printed.exit_code == 0, printed.output
    assert yaml.safe_load(printed.output)["starter_param"] == ['attention="sdpa"', "fused_kernels=false"]

    # the default engine passed: no fallback runs, none is taken
    again = gpu_run.Stages(tmp_path / "again", deadline_s=300)
    _junit(again.out / "gpu_tests.xml", [], [gpu_run.DEFAULT_ENGINE_TEST])
    assert gpu_run.engine_fallback(again, tests, {}) == {}
    recorded = json.loads((again.out / "stages.json").read_text())["stages"]
    assert set(recorded) == {"engine"} and recorded["engine"]["status"] == "default"

    # the GPU tests cut short before the default engine's test said anything (no report): as a failure,
    # since the check would otherwise take an engine nothing tested (a timed-out stage read as a pass)
    cut = gpu_run.Stages(tmp_path / "cut", deadline_s=300)
    assert gpu_run.engine_fallback(cut, tests, {}) == {"attention": "sdpa", "fused_kernels": False}
    status = json.loads((cut.out / "stages.json").read_text())["stages"]["engine"]["status"]
    assert status.startswith(f"fallback: {gpu_run.DEFAULT_ENGINE_TEST} gave no outcome"), status

    # not run at all (a generate-only call, --skip gpu_tests, on a fresh OUT): no report, and no fallback
    # either (a fallback here cost that call 75 s and gave generate an engine other than the check's)
    alone = gpu_run.Stages(tmp_path / "alone", deadline_s=300, skip=frozenset({"gpu_tests"}))
    assert gpu_run.engine_fallback(alone, tests, {}) == {}
    recorded = json.loads((alone.out / "stages.json").read_text())["stages"]
    assert set(recorded) == {"engine"} and "gpu_tests skipped" in recorded["engine"]["status"]
    # ... but an earlier call's report in OUT still rules (a warm machine's second call)
    _junit(alone.out / "gpu_tests.xml", [gpu_run.DEFAULT_ENGINE_TEST], [])
    assert gpu_run.engine_fallback(alone, tests, {}) == {"attention": "sdpa", "fused_kernels": False}


def test_a_pytest_stage_cut_at_its_limit_still_writes_its_report(tmp_path, monkeypatch):
    """A stage past its limit was sent SIGTERM, on which pytest writes no JUnit report, so the GPU tests'
    stage cut short said nothing of the default engine; pytest's stages are now asked with SIGINT, on
    which pytest ends its session and writes the report of what ran; and SIGINT is the stage's to take
    even where the script was started with it ignored (a shell's background job), which the stage would
    otherwise inherit. A report cut off mid-write reads as none."""
    import signal

    gpu_run = _script()
    monkeypatch.setitem(gpu_run.STAGES, "gpu_tests", 10)
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(60)\n"
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_slow.py")]
    terminate, interrupt = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell starting the script in the background leaves it
    try:
        stages = gpu_run.Stages(tmp_path / "out", deadline_s=60)
        report = stages.out / "gpu_tests.xml"
        ran = stages.run("gpu_tests", [*command, f"--junitxml={report}"], cwd=tmp_path, stop=signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, terminate)
        signal.signal(signal.SIGINT, interrupt)
    assert not ran and stages.results["gpu_tests"]["status"].startswith("timed out")
    assert gpu_run.junit_outcomes(report).get("test_quick") == "passed"
    report.write_text(report.read_text()[:60])
    assert gpu_run.junit_outcomes(report) == {}


def test_a_pytest_stage_killed_in_a_call_that_never_returns_still_says_which_tests_ended(tmp_path, monkeypatch):
    """A test hung where SIGINT cannot reach it (a CUDA call that never returns; here, SIGINT ignored) is
    killed after the grace, and pytest writes no JUnit report: the GPU tests' stage then said nothing of the
    default engine, which had passed, and the fallbacks ran for nothing. Each outcome is written as the test
    ends (tests/conftest.py, where $VIBETRAIN_TEST_OUTCOMES names a file), and read where no report is."""
    gpu_run = _script()
    monkeypatch.setitem(gpu_run.STAGES, "gpu_tests", 10)
    monkeypatch.setattr(gpu_run, "GRACE_S", 1)
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")  # as tests/test_gpu.py has it
    (tmp_path / "test_hung.py").write_text(
        "import signal, time\n\ndef test_quick():\n    pass\n\n"
        "def test_hung():\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    time.sleep(60)\n"
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_hung.py")]
    stages = gpu_run.Stages(tmp_path / "out", deadline_s=60)
    ran = gpu_run.pytest_stage(stages, "gpu_tests", command, {**os.environ, "PYTHONPATH": str(ROOT)})
    assert not ran and not (stages.out / "gpu_tests.xml").exists()
    assert gpu_run.stage_outcomes(stages.out, "gpu_tests") == {"test_quick": "passed"}


def test_generate_resumes_the_run_an_earlier_call_left_and_starts_again_one_cut_before_its_state(tmp_path):
    """generate --rounds 2 does not fit the call the other stages share, and a second call found its
    run directory there (the machine still warm) and was refused: "already exists". It now resumes a
    run with a state, its validated rounds kept, and starts again one cut before it had any."""
    from orchestrator.run_dir import RunDir

    gpu_run, run = _script(), tmp_path / "run"
    vibetrain = [sys.executable, "-m", "orchestrator.cli"]
    fresh = gpu_run.generate_command(vibetrain, "qwen3-0.6b-h100x1", run, "auto", {"fused_kernels": False})
    assert "--resume" not in fresh and fresh[fresh.index("--rounds") + 1] == "2"
    assert fresh[-2:] == ["--starter-param", "fused_kernels=false"] and "--sandbox" in fresh
    (run / ".git").mkdir(parents=True)  # cut before its first state was saved
    assert gpu_run.generate_command(vibetrain, "qwen3-0.6b-h100x1", run, "auto", {}) == [
        x for x in fresh if x not in ("--starter-param", "fused_kernels=false")
    ]
    assert not run.exists()
    RunDir(run).state_file.parent.mkdir(parents=True)
    RunDir(run).state_file.write_text("{}")
    resumed = gpu_run.generate_command(vibetrain, "qwen3-0.6b-h100x1", run, "auto", {"fused_kernels": False})
    assert "--resume" in resumed and "--rounds" not in resumed and "--starter-param" not in resumed  # the run's own
    assert resumed[resumed.index("--out") + 1] == str(run) and (run / ".git").exists()
