"""``vibetrain export``: a candidate as a standalone project that trains on its target's hardware with
no part of vibetrain installed.

The project (``--out DIR``)::

    stack/            the candidate's package, its ``targets`` imports rewritten to ``vt_harness``
    DESIGN.md         the candidate's planning document
    vt_harness/       the modules of vibetrain's ``targets`` package that stack/ and train.py import,
                      directly or through each other, copied with the same rewrite
    train.py          the launcher (orchestrator/export_launcher.py, rewritten the same way)
    target.yaml       the resolved target spec the launcher loads
    requirements.txt  the installed distributions the exported code imports, pinned to their versions here
    README.md

What is vendored is found, not listed: starting from the stack's and the launcher's files, every
import of a ``targets`` module (in function bodies and ``TYPE_CHECKING`` blocks too) pulls that
module's file in, until nothing new appears. The rewrite touches import statements only, so the
copied code is vibetrain's, line for line. A stack importing vibetrain's own packages
(``orchestrator``, ``agents``, ``skills``) is refused: the contract lets it import ``targets.api`` only.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import targets
from agents.offline.planner import OfflinePlanner
from targets.errors import UserError
from targets.spec import SpecError, TargetSpec, load_target, parse_target

VENDORED = "targets"  # vibetrain's package an export carries (the parts it needs)
PACKAGE = "vt_harness"  # its name in the export: nothing there imports vibetrain's packages
INTERNAL = ("orchestrator", "agents", "skills")  # vibetrain's own: never exported
SOURCE_ROOT = Path(targets.__file__).resolve().parent.parent  # the directory holding targets/
LAUNCHER = Path(__file__).with_name("export_launcher.py")
LOCAL_TOP_LEVEL = ("stack", PACKAGE, "__future__")  # imports that are the export's own (or the language's)


class ExportError(UserError, ValueError):
    """A candidate that cannot be exported as asked (the message names what and why)."""


@dataclass
class Exported:
    out: Path
    vendored: list[str] = field(default_factory=list)  # vibetrain module names copied into vt_harness/
    requirements: list[str] = field(default_factory=list)  # pinned distributions
    optional: dict[str, str] = field(default_factory=dict)  # import -> the files importing it, what provides it here
    environment: str = ""  # a user's environment: the pinned distribution providing it, or the files copied


def resolve_candidate(ref: str, target: str | None) -> tuple[Path, str, str]:
    """The candidate directory, the target it trains with, and where it came from (for the README): a
    directory needs ``target``; a run's ``RUN@best`` / ``RUN@round-N`` / ``RUN@<commit>`` is read from its
    history, its target the run's unless ``target`` names another, and its commit is named (``best``
    moves on as the run goes)."""
    path = Path(ref)
    if path.is_dir():
        from orchestrator.run_dir import RunDir

        if RunDir(path).state_file.exists():  # a run's worktree holds its best candidate, not what it means
            raise ExportError(f"{ref} is a run: export one of its candidates ({ref}@best, {ref}@round-N)")
        if not (path / "stack" / "__init__.py").is_file():
            raise ExportError(f"{ref} is a directory but not a candidate (it holds no stack/__init__.py)")
        if target is None:
            raise ExportError(f"{ref} is a candidate directory: name the target it trains with (--target TARGET)")
        return path, target, ref
    if "@" not in ref:
        from orchestrator.runs import NAMES_A_CANDIDATE

        raise ExportError(f"{ref}: not a candidate directory, and not {NAMES_A_CANDIDATE}")
    from orchestrator.config import ConfigError
    from orchestrator.runs import RunSetupError, export_candidate_at
    from orchestrator.state import RunState, RunStateError

    try:
        run = Path(ref.rpartition("@")[0])
        run_target = target or RunState.load(run).config.recorded_target(run, ", or name one with --target")
        path, commit = export_candidate_at(ref)
        return path, run_target, f"{ref}, commit {commit}"
    except (RunSetupError, RunStateError, ConfigError) as error:
        raise ExportError(str(error)) from None


def export_project(candidate: Path, target: str, out: Path, source: str | None = None) -> Exported:
    """Write the standalone project for ``candidate`` on ``target`` to ``out`` (new, or an empty
    directory). Built beside ``out`` and moved into place, so a failed export leaves nothing."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a file" if not out.is_dir() else "is a directory that is not empty"
        raise ExportError(f"--out {out} {what}: give a new or empty directory")
    if not (candidate / "stack" / "__init__.py").is_file():
        raise ExportError(f"{candidate} holds no stack/__init__.py: it is not a candidate directory")
    try:
        spec = load_target(target)
    except SpecError as error:
        raise ExportError(str(error)) from None
    if spec.workload.reward_model is not None:
        raise ExportError(
            f"target {spec.id} has a reward model (workload.reward_model): the exported launcher trains on its "
            "environment's rewards alone, with no judge to score them; export is for targets without one"
        )
    if spec.execution == "simulated":  # simulated for the search; the export trains on the hardware itself
        try:
            spec = parse_target({**spec.model_dump(mode="json"), "execution": "auto"}, source=f"{spec.id} exported")
        except SpecError as error:
            raise ExportError(f"target {spec.id} runs simulated only, and an export trains for real: {error}") from None
    _refuse_unplaceable(candidate, spec, source or str(candidate))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-export-", dir=out.parent))
    try:
        exported = _write(candidate, spec, staging, source or str(candidate))
        if out.exists():
            out.rmdir()
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    exported.out = out
    return exported


def _refuse_unplaceable(candidate: Path, spec: TargetSpec, source: str) -> None:
    """A stack whose ``params.json`` asks for devices the target lacks (a run's best exported with
    ``--target`` naming a smaller machine) would fail its own placement check in ``train.py``: named
    here instead. The parameters the skills library declares are held to their ranges on this target,
    and the devices they name to its count; a parameter of the stack's own is its business."""
    path = candidate / "stack" / "params.json"
    if not path.is_file():
        return  # a stack of its own making, without the library's parameters
    try:
        params = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ExportError(f"{path}: not JSON ({error})") from None
    planner = OfflinePlanner(spec)
    declared = {name for skill in planner.skills.values() for name in skill.params}
    outside = [f"{k}={v!r}" for k, v in params.items() if k in declared and not planner.legal(k, v)]
    if outside or not planner.fits(params):
        what = f"{', '.join(outside)} outside its range" if outside else "its devices do not add up"
        raise ExportError(
            f"{source}: the stack does not fit target {spec.id} ({spec.hardware.count} devices): {what} "
            f"(stack/params.json); export it for the target it was made for, or edit its params.json"
        )


def _write(candidate: Path, spec: TargetSpec, root: Path, source: str) -> Exported:
    exported = Exported(root)
    shutil.copytree(candidate / "stack", root / "stack", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if (candidate / "DESIGN.md").is_file():
        shutil.copy2(candidate / "DESIGN.md", root / "DESIGN.md")
    shutil.copy2(LAUNCHER, root / "train.py")
    copied: list[Path] = []
    if spec.workload.environment.entry is not None:  # first: a module of the user's is rewritten like the stack
        exported.environment, copied = _environment(spec.workload.environment.entry, root)
    pending: list[str] = []
    for path in sorted(root.joinpath("stack").rglob("*.py")) + [root / "train.py"] + copied:
        pending += _rewrite(path, path.relative_to(root))
    exported.vendored = _vendor(pending, root)
    (root / "target.yaml").write_text(_target_yaml(spec))
    exported.requirements, exported.optional = _requirements(root, copied)
    if "==" in exported.environment:
        exported.requirements = sorted({*exported.requirements, exported.environment}, key=str.lower)
    (root / "requirements.txt").write_text("".join(f"{r}\n" for r in exported.requirements))
    (root / "README.md").write_text(_readme(spec, source, exported))
    return exported


# -- imports -------------------------------------------------------------------------------------------


def _top(name: str) -> str:
    return name.split(".")[0]


def _module_file(module: str) -> Path | None:
    """The file of a ``targets`` module (``targets.harness.model``), or None when the name is not a module
    (an attribute imported from one)."""
    base = SOURCE_ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _rewrite(path: Path, shown: Path) -> list[str]:
    """Rewrite ``path``'s imports of ``targets`` to ``vt_harness`` in place; returns the ``targets``
    modules it imports (and names that may be modules: ``from targets.x import y``)."""
    source = path.read_text()
    lines = source.splitlines(keepends=True)
    imported: list[str] = []
    try:
        tree = ast.parse(source, str(shown))
    except SyntaxError as error:
        raise ExportError(f"{shown}:{error.lineno}: not valid Python ({error.msg})") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            candidates = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names, candidates = [a.name for a in node.names], []
        else:
            continue
        for name in names:
            if _top(name) in INTERNAL:
                raise ExportError(
                    f"{shown}:{node.lineno} imports {name}, a vibetrain internal: a stack may import only "
                    f"{VENDORED}.api from vibetrain"
                )
        if not any(_top(n) == VENDORED for n in names):
            continue
        if isinstance(node, ast.Import) and any(_top(a.name) == VENDORED and a.asname is None for a in node.names):
            raise ExportError(
                f"{shown}:{node.lineno}: 'import {VENDORED}...' without 'as' names {VENDORED} in the code "
                f"that follows; use 'from {VENDORED}... import ...' to export it"
            )
        line = lines[node.lineno - 1]
        head, tail = line[: node.col_offset], line[node.col_offset :]
        keyword = "from" if isinstance(node, ast.ImportFrom) else "import"
        new_tail = re.sub(rf"(?<![\w.]){VENDORED}(?=[.\s,]|$)", PACKAGE, tail, count=1 if keyword == "from" else 0)
        if new_tail == tail or not tail.startswith(keyword):
            raise ExportError(f"{shown}:{node.lineno}: cannot rewrite this import of {VENDORED}: {line.strip()}")
        lines[node.lineno - 1] = head + new_tail
        imported += [n for n in names if _top(n) == VENDORED] + candidates
    path.write_text("".join(lines))
    return imported


def _vendor(pending: list[str], root: Path) -> list[str]:
    """Copy every ``targets`` module reachable from ``pending`` (and the packages holding them) into
    ``root/vt_harness``, rewritten; returns the module names copied."""
    done: set[str] = set()
    while pending:
        name = pending.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # a module's packages come with it: their __init__ runs first
            module = ".".join(parts[:i])
            if module in done:
                continue
            source = _module_file(module)
            if source is None:  # an attribute of the module before it
                continue
            done.add(module)
            relative = source.relative_to(SOURCE_ROOT / VENDORED)
            copy = root / PACKAGE / relative
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy)
            pending += _rewrite(copy, Path(VENDORED) / relative)
            _copy_data(source, copy.parent)
    return sorted(done)


def _copy_data(module: Path, into: Path) -> None:
    """The data files a vendored module names beside itself (the BPE tokenizer's training corpus)."""
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[\w.-]+\.\w+", node.value):
            data = module.parent / node.value
            if data.is_file() and data.suffix != ".py":
                shutil.copy2(data, into / node.value)


def _environment(entry: str, root: Path) -> tuple[str, list[Path]]:
    """What makes the user's environment importable where the export trains, and the Python files
    copied for it: the distribution providing its package, pinned, when it came from an index; else (a
    module of the user's own, or a package installed from a local directory, an archive or a checkout,
    which an index may not have, or may have as someone else's) its source copied beside train.py, whose
    folder Python puts first on the import path."""
    top = _top(entry.partition(":")[0])
    if top in (*LOCAL_TOP_LEVEL, "train", VENDORED, *INTERNAL):
        raise ExportError(f"environment entry {entry!r}: its package {top} has the name of the export's own {top}")
    for distribution in importlib.metadata.packages_distributions().get(top, []):
        if _from_an_index(distribution):
            return f"{distribution}=={importlib.metadata.version(distribution).split('+')[0]}", []
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None or not Path(spec.origin).is_file():
        raise ExportError(f"environment entry {entry!r}: {top} is not importable here as a module or a package")
    origin = Path(spec.origin)
    if origin.stem == "__init__":
        shutil.copytree(origin.parent, root / top, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        return f"{top}/ (copied)", sorted((root / top).rglob("*.py"))
    shutil.copy2(origin, root / origin.name)
    return f"{origin.name} (copied)", [root / origin.name] if origin.suffix == ".py" else []


def _from_an_index(distribution: str) -> bool:
    """Installed from a package index: one from a local directory, an archive or a checkout records
    where it came from (PEP 610's ``direct_url.json``)."""
    return importlib.metadata.distribution(distribution).read_text("direct_url.json") is None


def _normalized(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _core_dependencies() -> set[str]:
    """vibetrain's own required distributions (not its extras), normalized names."""
    try:
        declared = importlib.metadata.requires("vibetrain") or []
    except importlib.metadata.PackageNotFoundError:
        raise ExportError("vibetrain's package metadata is missing: install it (pip install -e .) to export") from None
    names = (re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r) for r in declared if "extra ==" not in r)
    return {_normalized(m.group(0)) for m in names if m}


def _requirements(root: Path, environment: list[Path]) -> tuple[list[str], dict[str, str]]:
    """Third-party imports of the exported files, split in two. Required: those vibetrain's own
    dependencies provide (the stack kit is built on them), and whatever a copied user environment
    (``environment``, its files) imports that is installed here, pinned to the versions installed here
    (local build labels such as ``+cpu`` dropped: no public index serves them). Optional: everything
    else (the kit's optional engines, vLLM and FlashInfer, are vibetrain extras imported only where they
    run), each with the files importing it and what provides it here, for the README."""
    local = {*LOCAL_TOP_LEVEL, *(path.relative_to(root).parts[0].removesuffix(".py") for path in environment)}
    environment_imports: set[str] = set()
    users: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = _top(name)
                if top not in sys.stdlib_module_names and top not in local:
                    users.setdefault(top, set()).add(str(path.relative_to(root)))
                    if path in environment:
                        environment_imports.add(top)
    core, providers = _core_dependencies(), importlib.metadata.packages_distributions()
    pins: set[str] = set()
    optional: dict[str, str] = {}
    for top, files in sorted(users.items()):
        installed = [f"{d}=={importlib.metadata.version(d)}" for d in providers.get(top, [])]
        required = [d for d in providers.get(top, []) if _normalized(d) in core or top in environment_imports]
        if required:
            pins.update(f"{d}=={importlib.metadata.version(d).split('+')[0]}" for d in required)
        else:
            here = f"{', '.join(installed)} here" if installed else "not installed here"
            optional[top] = f"{', '.join(sorted(files))} ({here})"
    return sorted(pins, key=str.lower), optional


# -- the target and the README -------------------------------------------------------------------------


def _target_yaml(spec: TargetSpec) -> str:
    """The resolved spec (catalog hardware numbers filled in), checked to load back as the same spec."""
    text = yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False, width=10_000)
    if parse_target(yaml.safe_load(text), source="target.yaml").model_dump() != spec.model_dump():
        raise ExportError(f"target {spec.id}: the resolved spec does not load back as itself from YAML")
    return f"# target {spec.id}, resolved by vibetrain export\n{text}"


def _readme(spec: TargetSpec, source: str, exported: Exported) -> str:
    hardware, workload = spec.hardware, spec.workload
    torch_pin = next((r for r in exported.requirements if r.lower().startswith("torch==")), None)
    weights = (
        f"random weights `{spec.model.weights}`, built from its config on the first run and cached under "
        "`$VIBETRAIN_CACHE` (default `~/.cache/vibetrain`)"
        if spec.model.random_seed is not None
        else f"the weights in `{spec.model.weights}`, a directory that must exist on the machine that trains"
    )
    python = importlib.metadata.metadata("vibetrain")["Requires-Python"]
    lines = [
        f"# {spec.id}: an exported vibetrain stack",
        "",
        f"The stack `{source}`, exported by `vibetrain export` as a project of its own: it trains a "
        f"{spec.model.family} model ({weights}) on {hardware.summary} device(s), "
        f"{workload.batch_size} trajectories a step in groups of {workload.group_size}, on the "
        f"`{workload.environment.label}` environment. Nothing here imports vibetrain.",
        "",
        "## Install and train",
        "",
        f"Python {python}; a fresh virtual environment is enough:",
        "",
        "```bash",
        "python3 -m venv .venv && . .venv/bin/activate",
        "pip install -r requirements.txt",
        f"python train.py --steps {workload.train_steps}",
        "```",
        "",
        "`train.py` prints one line per training step: the batch's mean reward, the step's wall time "
        "(since the previous step ended) and the time of the train call itself.",
    ]
    if exported.environment:
        lines += ["", f"The environment `{workload.environment.entry}` comes from `{exported.environment}`."]
    if torch_pin and hardware.kind != "cpu":
        lines += [
            "",
            f"requirements.txt pins `{torch_pin}`; on a GPU machine install your CUDA build of that "
            "torch version first.",
        ]
    if exported.optional:
        lines += [
            "",
            "Optional, not in requirements.txt: imported only inside the code that uses them (vibetrain "
            "does not require them either); install one if the stack runs that code on your hardware:",
            "",
        ]
        lines += [f"* `{name}`: {where}" for name, where in exported.optional.items()]
    lines += [
        "",
        "## What is here",
        "",
        "| path | what |",
        "|---|---|",
        "| `stack/` | the candidate's package; `build(runtime)` is its entry point |",
        "| `DESIGN.md` | the candidate's decisions, plan and findings |",
        "| `train.py` | the launcher: the target's runtime and environments, the stack's cluster, "
        "`controller.run` for N steps |",
        f"| `{PACKAGE}/` | the parts of vibetrain's `{VENDORED}` package these import (the contract "
        f"`{PACKAGE}/api.py`, the target spec, model factory, tokenizer, environments), copied with "
        f"`{VENDORED}` renamed `{PACKAGE}` in their imports |",
        "| `target.yaml` | the target spec `train.py` loads |",
        "| `requirements.txt` | the distributions the code imports, at the versions it was exported with |",
        "",
        "Vendored modules: " + ", ".join(f"`{m}`" for m in exported.vendored) + ".",
        "",
        "`train.py` runs the stack in one process. What vibetrain adds to judge a candidate (separate "
        "processes, its own trace, the audit's replay of every training step) is not part of this export.",
        "",
    ]
    return "\n".join(lines)


def describe(exported: Exported) -> str:
    """What the command prints: where, what was vendored, how to run it."""
    return (
        f"exported to {exported.out}: stack/, {len(exported.vendored)} vendored modules in {PACKAGE}/, "
        f"{len(exported.requirements)} pinned requirements\n"
        f"run it: cd {shlex.quote(str(exported.out))} && pip install -r requirements.txt && python train.py"
    )
