"""All of the GPU work, as stages, on one GPU machine that starts bare: the first thing to run in any
session lent a GPU.

    python benchmarks/gpu_run.py prepare [--wheels gpu-wheels]        # here: what the machine lacks
    # there, carrying gpu-wheels (the wheels first: a newer typer needs pydantic to parse arguments)
    python3 -m pip install -q --no-index --no-deps gpu-wheels/*.whl && \
        python3 benchmarks/gpu_run.py run --out /tmp/gpu-work --bundle $OUT/gpu-run.tar.gz --deadline-s 568
    python benchmarks/gpu_run.py run --out /tmp/rehearsal --rehearse    # here: the same stages on CPU

``prepare`` downloads, for the GPU machine's Python (3.12), the wheels vibetrain needs that the machine
does not have (pydantic, orjson, GitPython, nvidia-ml-py, and the versions of their own dependencies pip
resolves with them: pydantic pins its pydantic-core, which needs a recent typing-extensions), and
bubblewrap's binary; carry that folder with
the run (64 MiB a call in all), and bwrap and git behind wrappers (used only where the machine lacks
its own). FlashInfer is not carried (62 MB, and a JIT build of minutes): the paged engine's ``auto``
attention takes its Triton decode kernel there, in CUDA graphs (``skills/recipes/triton_attention.py``).

``run`` goes through the stages below, each with its own time limit, and writes ``OUT/stages.json``
after every one (so a run cut short still returns what it measured), each stage's log beside it:

1. ``setup``: installs the carried wheels, says what the machine is, and stops the run if something every
   later stage imports is missing (the wheels not carried); then ``gpu_tests``:
   ``pytest -m gpu tests/test_gpu.py`` (the engine's kernels and graphs against the reference, sleep,
   wake, the trainer on the device), its JUnit report kept: first, as it says in a minute or two
   whether the engine the check needs is sound (each test's outcome also written as it ends: a stage
   killed in a CUDA call that never returns writes no report). Where it failed the default engine (fused Triton
   kernels, Triton attention in graphs), or was cut short before that test said, ``fallback_unfused``
   and then ``fallback_sdpa`` rerun the test of an engine without them, alone, and the check's stack and
   generate's starter take the first that passes (the ``engine`` record says which and why): one broken
   kernel does not cost the session its other figures;
2. ``components``: ``benchmarks/gpu_components.py`` (decode greedy and at temperature 1 against the
   HBM roofline of the card that runs, prefill, the train step cold and warm, the weight export stage
   by stage, sleep, wake; each section's figures written as soon as it has them): before the check,
   whose time is the least certain, so a check that runs long never costs the session these figures;
3. ``check``: ``vibetrain check`` of the colocate starter (written with those engine options by the
   ``starter`` stage, before the components), sandboxed as a user would run it, its trace (written as
   the run goes, so a check cut short keeps its steps) and per-phase timings kept; then
   ``train_ratio``: ``benchmarks/train_step_ratio.py`` on that trace (each system train step against
   the trainer alone on the same batch);
4. ``calibrate``: the simulator fitted to the check's trace, and its prediction error;
5. ``generate``: ``vibetrain generate --rounds 2``, the run tarred back for ``log``/``show``/``report``
   (last: it takes whatever time is left; a call right after, on the machine still warm, resumes it).

``--bundle FILE`` packs OUT after every stage into one tarball (weight snapshots and workspaces left
out): the device tool brings back at most 8 files, and a run cut short still returns its last bundle.
The figures' files (``BESIDE_BUNDLE``) are copied beside it too, each a file of its own.

``--skip`` leaves stages out: generate's two rounds (two checks of ~5 minutes) fit only a call of their
own, ``--skip gpu_tests,check,train_ratio,calibrate,components``.

``--rehearse`` runs the same stages on a one-device variant of the CPU target (the local cluster, as
the GPU target uses), to prove the script before a GPU is lent.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from xml.etree import ElementTree

import typer
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: the project's packages (the rehearsal found it)
    sys.path.insert(0, str(ROOT))
app = typer.Typer(add_completion=False, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]})

DEVICE_PYTHON = "3.12"  # the GPU machine's (the device tool's README)
# and their dependencies, resolved together: fetched one by one, the newest pydantic-core need not be the one
# the newest pydantic pins (it refuses to import beside another), and typing-extensions was left to the machine
CARRIED = ("pydantic", "orjson", "gitpython", "nvidia-ml-py")  # nvidia-ml-py: the harness's device memory
CARRIED_BINARIES = ("bwrap", "git")  # the sandbox, and what GitPython runs
CARRIED_LIBRARIES = ("libselinux.so.1", "libcap.so.2", "libpcre2-8.so.0")  # theirs beyond libc and zlib
STAGES = {  # name: seconds it may take, in the order they run; a stage gets at most what is left
    "setup": 30,
    "starter": 30,  # the check's stack written (the CLI's start-up: ~3 s)
    "gpu_tests": 90,
    "fallback_unfused": 75,  # these two run only when gpu_tests failed the engine's default kernels
    "fallback_sdpa": 75,
    "components": 120,  # 73 s on the H200 of 11-29
    "check": 420,  # the H200 run of 11-29: accuracy 88 s, 2-step system run 105 s, then the audit; 300 s cut it
    "train_ratio": 45,
    "calibrate": 40,
    "generate": 560,  # whatever is left; alone (--skip the others) a whole call
}
# what every stage after setup imports: carried (pydantic, orjson, GitPython) or the machine's; and on a GPU,
# NVML's (nvidia-ml-py, carried: the harness samples device memory through it)
NEEDED_MODULES = ("pydantic", "orjson", "git", "torch", "transformers", "safetensors", "typer", "yaml")
DEFAULT_ENGINE_TEST = "test_triton_engine_in_bf16_passes_checks_1_and_3_with_its_decode_graphs"
UNFUSED, SDPA = {"fused_kernels": False}, {"attention": "sdpa", "fused_kernels": False}
FALLBACKS = (  # stage, the GPU test that must pass alone, the engine options the check then takes
    ("fallback_unfused", "test_triton_engine_without_the_fused_kernels_passes_checks_1_and_3", UNFUSED),
    ("fallback_sdpa", "test_sdpa_engine_in_bf16_passes_checks_1_and_3", SDPA),
)
GRACE_S = 10  # a stage past its limit is asked to stop (SIGTERM: the CLI unwinds) this long before it is killed
BUNDLE_LEFT_OUT = ("workspaces", "run", "starter")  # folders of OUT the bundle leaves out (run is tarred apart)
# copied beside the bundle too (the device tool brings back 8 files of up to 16 MiB: a bundle past that is lost)
BESIDE_BUNDLE = ("stages.json", "components.json", "check.json", "train_ratio.json", "twin.yaml")


@app.command()
def prepare(
    wheels: Path = typer.Option(Path("gpu-wheels"), help="the folder to carry with the run"),
    python: str = typer.Option(DEVICE_PYTHON, help="the Python the wheels are for (this one's, to rehearse)"),
    without_bwrap: bool = typer.Option(False, help="carry no bubblewrap (the check then runs unsandboxed there)"),
) -> None:
    """Download what the bare GPU machine lacks into WHEELS (run here, where the registries are)."""
    if shutil.which("bwrap") is None and not without_bwrap:  # before minutes of downloads, not after
        typer.echo(
            "prepare: no bwrap here to carry, and the GPU machine may lack it (the check would then run its "
            "candidate unsandboxed, unlike a user's): apt-get install bubblewrap, or pass --without-bwrap",
            err=True,
        )
        raise typer.Exit(2)
    wheels.mkdir(parents=True, exist_ok=True)
    for old in wheels.glob("*.whl"):  # an earlier prepare's: two versions of one package would fail the install
        old.unlink()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--only-binary=:all:",
            "--python-version",
            python,
            "--platform",
            "manylinux2014_x86_64",
            "--platform",
            "manylinux_2_17_x86_64",
            "-d",
            str(wheels),
            *CARRIED,
        ],
        check=True,
    )
    carried = [name for name in CARRIED_BINARIES if _carry_binary(name, wheels)]
    size = sum(p.stat().st_size for p in wheels.rglob("*") if p.is_file())
    typer.echo(f"{wheels}: {size / 2**20:.1f} MiB to carry (binaries: {', '.join(carried) or 'none'})")


def _carry_binary(name: str, wheels: Path) -> bool:
    """This machine's NAME, with the libraries a bare image may lack, behind a wrapper in WHEELS/bin.

    The run puts WHEELS/bin last on PATH, so the machine's own binary wins where it has one."""
    found = shutil.which(name)
    if found is None:
        return False
    for folder in ("bin", "libexec", "lib"):
        (wheels / folder).mkdir(exist_ok=True)
    shutil.copy2(found, wheels / "libexec" / name)
    for library in CARRIED_LIBRARIES:
        if Path("/lib/x86_64-linux-gnu", library).exists():
            shutil.copy2(Path("/lib/x86_64-linux-gnu", library), wheels / "lib" / library)
    wrapper = wheels / "bin" / name
    wrapper.write_text(
        '#!/bin/sh\nhere=$(dirname "$(readlink -f "$0")")\n'
        f'LD_LIBRARY_PATH="$here/../lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" exec "$here/../libexec/{name}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return True


class Stages:
    """Runs the stages in order, each a subprocess with its limit, recording as it goes."""

    def __init__(self, out: Path, deadline_s: float, bundle: Path | None = None, skip: frozenset = frozenset()) -> None:
        self.out, self.started, self.deadline_s, self.bundle = out, time.monotonic(), deadline_s, bundle
        self.skip = skip
        self.results: dict[str, dict] = {}
        self.current: subprocess.Popen | None = None  # the stage running now
        out.mkdir(parents=True, exist_ok=True)
        if bundle is not None and out in bundle.parents:
            raise typer.BadParameter(f"--bundle {bundle} must lie outside --out {out} (it packs --out)")
        if bundle is not None:
            bundle.parent.mkdir(parents=True, exist_ok=True)
        signal.signal(signal.SIGTERM, self._terminated)

    def _terminated(self, signum: int, frame: object) -> None:
        """The device tool ending this script ends the stage too (its session would outlive us)."""
        if self.current is not None:
            _end_session(self.current)
        sys.exit(128 + signum)

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.started)

    def run(
        self, name: str, command: list[str], env: dict | None = None, cwd: Path = ROOT, stop=signal.SIGTERM
    ) -> bool:
        """``stop``: how a stage past its limit is asked to end (pytest: SIGINT, on which it still writes
        its JUnit report; the CLI: SIGTERM, on which it unwinds)."""
        limit = min(STAGES[name], self.left() - 2 * GRACE_S)
        record = {"command": " ".join(command), "limit_s": round(limit, 1)}
        if name in self.skip:
            record["status"] = "skipped: --skip"
            self._save(name, record)
            return False
        if limit < 10:
            record["status"] = "skipped: no time left"
            self._save(name, record)
            return False
        log = self.out / f"{name}.log"
        started = time.monotonic()
        with log.open("w") as handle:  # a session of its own: a stage cut short leaves no process on the GPU
            process = self.current = subprocess.Popen(
                command,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_default_stop,
            )
            try:
                returncode = process.wait(timeout=limit)
                record["status"] = "ok" if returncode == 0 else f"exit {returncode}"
            except subprocess.TimeoutExpired:
                record["status"] = f"timed out after {limit:.0f} s"
            finally:
                _end_session(process, stop)
                self.current = None
        record["seconds"] = round(time.monotonic() - started, 2)
        record["log_tail"] = log.read_text(errors="replace").splitlines()[-15:]
        self._save(name, record)
        return record["status"] == "ok"

    def _save(self, name: str, record: dict) -> None:
        self.results[name] = record
        summary = {"elapsed_s": round(time.monotonic() - self.started, 1), "stages": self.results}
        (self.out / "stages.json").write_text(json.dumps(summary, indent=1))
        typer.echo(f"[{summary['elapsed_s']:6.1f}s] {name}: {record['status']}")
        if self.bundle is not None:
            self.pack()

    def pack(self) -> None:
        """OUT into one tarball, written beside and renamed, so the bundle is never half a file."""
        partial = self.bundle.with_name(self.bundle.name + ".partial")
        with tarfile.open(partial, "w:gz") as tar:
            for path in sorted(self.out.iterdir()):
                if path.name not in BUNDLE_LEFT_OUT:
                    tar.add(path, arcname=f"gpu-run/{path.name}", filter=_without_weights)
        partial.replace(self.bundle)
        for name in BESIDE_BUNDLE:  # each also a file of its own: one that comes back even if the bundle cannot
            if (self.out / name).exists():
                shutil.copy2(self.out / name, self.bundle.with_name(name))


def _without_weights(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Weight snapshots stay behind (a 0.6B version is 2.4 GB in float32), also one a stage cut short was
    still writing (``v3.tmp``, renamed when whole)."""
    return None if member.name.endswith((".safetensors", ".tmp")) else member


def _default_stop() -> None:
    """In the stage's process: SIGINT does what it does by default (a shell that starts this script in
    the background has it ignored, and the stage would inherit that: pytest then writes no report)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _end_session(process: subprocess.Popen, stop=signal.SIGTERM) -> None:
    """Stop what a stage left running (its candidate processes, judges, sandboxes): asked first (``stop``),
    so a check cut short writes what it can, then killed."""
    for sig in (stop, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return  # the stage's whole session has already ended
        try:
            process.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            continue


def stage_outcomes(out: Path, stage: str) -> dict[str, str]:
    """What a pytest stage said of each test: its JUnit report, or where there is none (the stage killed in
    a CUDA call that never returned: pytest writes the report at its end), the lines it wrote as each test
    ended (``tests/conftest.py``)."""
    outcomes = junit_outcomes(out / f"{stage}.xml")
    lines = out / f"{stage}.outcomes.jsonl"
    if outcomes or not lines.exists():
        return outcomes
    for line in lines.read_text().splitlines():
        try:
            said = json.loads(line)
        except json.JSONDecodeError:  # the last line, cut off as the stage was killed
            continue
        outcomes[said["test"]] = said["outcome"]
    return outcomes


def pytest_stage(stages: Stages, stage: str, tests: list[str], env: dict) -> bool:
    """``tests`` (a pytest command) as ``stage``, its JUnit report and its outcome lines in OUT."""
    report, lines = stages.out / f"{stage}.xml", stages.out / f"{stage}.outcomes.jsonl"
    lines.unlink(missing_ok=True)  # an earlier call's (a warm machine's second call)
    env = {**env, "VIBETRAIN_TEST_OUTCOMES": str(lines)}
    return stages.run(stage, [*tests, f"--junitxml={report}"], env, stop=signal.SIGINT)


def junit_outcomes(junit: Path) -> dict[str, str]:
    """Each test of a JUnit report by name: "failed" (a failure or an error), "skipped" or "passed";
    none when there is no report, or only part of one."""
    if not junit.exists():
        return {}
    try:
        root = ElementTree.parse(junit).getroot()
    except ElementTree.ParseError:  # written in part by a stage killed mid-write: no outcome, as none written
        return {}
    outcomes = {}
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[case.get("name", "")] = "failed"
        else:
            outcomes[case.get("name", "")] = "skipped" if case.find("skipped") is not None else "passed"
    return outcomes


def engine_fallback(stages: Stages, tests: list[str], env: dict) -> dict:
    """The engine options the check's stack and generate's starter take: none while the GPU tests
    passed the default engine (fused Triton kernels, Triton attention in CUDA graphs); after a failure
    there, or no outcome (the stage cut short before that test ended), the first fallback whose test
    passes in a process of its own (a failed kernel can poison the CUDA context of every test after
    it), so one broken kernel does not cost the session its check, calibration, figures and generated
    rounds. Recorded as the ``engine`` stage: a fallback is never silent."""
    outcome = stage_outcomes(stages.out, "gpu_tests").get(DEFAULT_ENGINE_TEST)
    if outcome in ("passed", "skipped"):  # skipped: no GPU here (a rehearsal), nothing to fall back from
        stages._save("engine", {"status": "default", "options": {}})
        return {}
    if outcome is None and "gpu_tests" in stages.skip:  # not cut short: not run (a generate-only call)
        status = "default: gpu_tests skipped (--skip), and no report of an earlier call's in OUT"
        stages._save("engine", {"status": status, "options": {}})
        return {}
    said = "failed" if outcome else "gave no outcome (the GPU tests were cut short or crashed before it ended)"
    for stage, test, options in FALLBACKS:
        ran = pytest_stage(stages, stage, [*tests, "-k", test], env)
        if ran and stage_outcomes(stages.out, stage).get(test) == "passed":
            status = f"fallback: {DEFAULT_ENGINE_TEST} {said}, {test} passed"
            stages._save("engine", {"status": status, "options": options})
            return options
    status = f"default: {DEFAULT_ENGINE_TEST} {said}, and no fallback's test passed (see each fallback stage)"
    stages._save("engine", {"status": status, "options": {}})
    return {}


def param_flags(options: dict, flag: str) -> list[str]:
    """``options`` as ``flag KEY=VALUE`` pairs: ``starter --param`` for the check's stack, ``generate
    --starter-param`` for the run's round 0 (which every later round inherits)."""
    from skills.starter import format_param

    return [text for name, value in options.items() for text in (flag, format_param(name, value))]


def generate_command(vibetrain: list[str], target: str, run_dir: Path, sandbox: str, options: dict) -> list[str]:
    """``generate --rounds 2`` with the check's engine options (not the default engine that failed its
    test). Where an earlier call on this machine (still warm: the device keeps it 30 s) was cut short
    and left the run's state, ``--resume``: its validated rounds stay and the rest go on; a run cut
    before its first state is started again."""
    from orchestrator.run_dir import RunDir

    workspaces = ["--workspaces", str(run_dir.parent / "workspaces")]
    if RunDir(run_dir).state_file.exists():
        return [*vibetrain, "generate", target, "--out", str(run_dir), "--resume", *workspaces]
    if run_dir.exists():
        shutil.rmtree(run_dir)
    generate = [*vibetrain, "generate", target, "--rounds", "2", "--repeat", "1", "--out", str(run_dir)]
    return [*generate, *workspaces, "--sandbox", sandbox, *param_flags(options, "--starter-param")]


def _rehearsal_target(out: Path) -> str:
    """The CPU target on one device: the local cluster the GPU target's colocate stack uses."""
    from targets.spec import CATALOG_DIR

    data = yaml.safe_load((CATALOG_DIR / "tiny-qwen3-cpu.yaml").read_text())
    data["id"] = "tiny-qwen3-cpu-one"
    data["hardware"]["count"] = 1
    data["workload"].update(batch_size=16, train_steps=3)
    data["baselines"] = [{"name": "colocate"}]
    path = out / "rehearsal-target.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _sandbox(env: dict) -> tuple[str, str]:
    """bubblewrap where it runs on this machine (as a user would), else the plain subprocess, and why."""
    from targets.harness.isolation.sandbox import BWRAP_PROBE  # the probe the harness's own detection makes

    bwrap = shutil.which("bwrap", path=env["PATH"])
    if bwrap is None:
        return "subprocess", "no bwrap on PATH, carried or the machine's"
    try:
        probe = subprocess.run([bwrap, *BWRAP_PROBE], env=env, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "subprocess", f"{bwrap}'s probe did not end in 30 s"
    if probe.returncode != 0:
        return "subprocess", f"{bwrap} cannot make a sandbox here: {probe.stderr.strip()[:300]}"
    return "auto", f"{bwrap} works"


@app.command()
def setup(wheels: Path = typer.Option(Path("gpu-wheels"))) -> None:
    """Stage 1, on the machine: install the carried wheels, then say what the machine is."""
    found = sorted(str(p) for p in wheels.glob("*.whl")) if wheels.exists() else []
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    other = [Path(p).name for p in found if "-cp3" in Path(p).name and f"-{here}-" not in Path(p).name]
    if other:  # said by name, not as pip's traceback (a rehearsal beside a folder prepared for the GPU)
        typer.echo(
            f"{wheels} holds wheels built for another Python than this {platform.python_version()}: "
            f"{', '.join(other)}; run `prepare --python` for this one, or rehearse without the folder",
            err=True,
        )
        raise typer.Exit(1)
    if found:
        pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile", "-q"]
        subprocess.run([*pip, *found], check=True)
    import torch

    typer.echo(f"{platform.platform()}; python {platform.python_version()}; torch {torch.__version__}")
    typer.echo(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
    needed = (*NEEDED_MODULES, "pynvml") if torch.cuda.is_available() else NEEDED_MODULES
    missing = []
    for module in (*needed, "ray"):
        try:
            __import__(module)
            typer.echo(f"{module}: present")
        except ImportError as error:
            typer.echo(f"{module}: missing ({error})")
            missing += [module] if module in needed else []
    for binary in CARRIED_BINARIES:
        typer.echo(f"{binary}: {shutil.which(binary) or 'missing'}")
    if missing:  # every later stage imports them: better said now than as each stage's traceback
        typer.echo(f"missing {', '.join(missing)}: carry {wheels} (`prepare`) with the run", err=True)
        raise typer.Exit(1)


@app.command()
def run(
    out: Path = typer.Option(Path(os.environ.get("OUT", "gpu-out")), help="where results go (default $OUT)"),
    wheels: Path = typer.Option(Path("gpu-wheels"), help="the folder `prepare` filled, carried with the run"),
    target: str = typer.Option("qwen3-0.6b-h100x1"),
    rehearse: bool = typer.Option(False, help="the same stages on the CPU target, here"),
    deadline_s: float = typer.Option(580.0, help="the whole run's time; a stage gets what is left"),
    bundle: Path | None = typer.Option(None, help="a tarball of OUT refreshed after every stage"),
    skip: str = typer.Option(
        "", help="stages to leave out, comma-separated (a second call: all but setup and generate, to give it 10 min)"
    ),
) -> None:
    """Every stage, as the GPU session runs it; ``stages.json`` in OUT says what each did."""
    skipped = frozenset(name for name in skip.split(",") if name)
    if skipped - set(STAGES) or skipped & {"setup", "starter"}:
        raise typer.BadParameter(f"--skip takes stages but setup and starter, of {', '.join(STAGES)}; not {skip!r}")
    stages = Stages(out.resolve(), deadline_s, bundle.resolve() if bundle else None, skipped)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if (wheels / "bin").exists():  # last: the machine's own bwrap and git come first
        env["PATH"] = f"{env['PATH']}:{(wheels / 'bin').resolve()}"
    if not stages.run("setup", [sys.executable, __file__, "setup", "--wheels", str(wheels.resolve())], env):
        stages._save("done", {"status": "stopped: setup failed (its log says what is missing)"})
        raise typer.Exit(1)
    tests = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider"]
    pytest_stage(stages, "gpu_tests", tests, env)
    options = engine_fallback(stages, tests, env)
    if rehearse:
        target = _rehearsal_target(stages.out)
    vibetrain = [sys.executable, "-m", "orchestrator.cli"]
    starter = stages.out / "starter"
    if starter.exists():  # an earlier run's, perhaps with other engine options
        shutil.rmtree(starter)
    write = [*vibetrain, "starter", target, "--out", str(starter), "--controller", "colocate"]
    stages.run("starter", [*write, *param_flags(options, "--param")], env)  # failed: the check says so too
    if rehearse:
        components = [sys.executable, "gpu_components.py", "--target", "tiny-qwen3-cpu", "--device", "cpu"]
        components += ["--batch", "4", "--new-tokens", "8", "--train-batch", "4", "--repeat", "1"]
    else:  # 128 new tokens: the first H200 run's SDPA decode did not finish 256 (x3, and transformers') in 100 s
        components = [sys.executable, "gpu_components.py", "--target", target, "--repeat", "2", "--new-tokens", "128"]
    if options.get("fused_kernels") is False:  # the fallback's engine
        components.append("--no-fused-kernels")
    if "attention" in options:
        components += ["--attention", options["attention"]]
    stages.run("components", [*components, "--json", str(stages.out / "components.json")], env, ROOT / "benchmarks")
    sandbox, why = _sandbox(env)
    stages.results["sandbox"] = {"status": sandbox, "why": why}
    check = [*vibetrain, "check", target, "--stack", str(starter), "--out", str(stages.out / "check")]
    stages.run("check", [*check, "--json", str(stages.out / "check.json"), "--sandbox", sandbox], env)
    trace = stages.out / "check" / "trace.jsonl"  # streamed: a check cut short leaves its steps
    if trace.exists():  # the system run's train step against the trainer alone
        ratio = [sys.executable, "train_step_ratio.py", str(stages.out / "check"), "--target", target]
        ratio += ["--device", "cpu" if rehearse else "cuda:0", "--repeat", "2"]
        ratio += ["--json", str(stages.out / "train_ratio.json")]
        stages.run("train_ratio", ratio, env, ROOT / "benchmarks")
    if trace.exists():
        calibrate = [*vibetrain, "calibrate", target, "--stack", str(starter), "--trace", str(trace)]
        stages.run("calibrate", [*calibrate, "--out", str(stages.out / "twin.yaml"), "--sandbox", sandbox], env)
    else:
        stages._save("calibrate", {"status": "skipped: the check left no trace"})
    run_dir = stages.out / "run"
    stages.run("generate", generate_command(vibetrain, target, run_dir, sandbox, options), env)
    if run_dir.exists():
        with tarfile.open(stages.out / "run.tar.gz", "w:gz") as tar:
            tar.add(run_dir, arcname="run", filter=_without_weights)
    stages.results["machine"] = {"status": platform.node()}
    stages._save("done", {"status": f"{sum(r.get('status') == 'ok' for r in stages.results.values())} stages ok"})


if __name__ == "__main__":
    app()
