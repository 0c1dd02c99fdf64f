"""Starter stacks: write a complete candidate directory (``stack/`` + ``DESIGN.md``) for one of the
three controllers and a parameter set. The offline implementer and the baselines both start here."""

from __future__ import annotations

import difflib
import json
import shutil
from pathlib import Path

from skills.design_doc import DesignDoc
from skills.library import defaults, legal, load_skills, not_applicable
from skills.recipes.build import KNOWN_PARAMS, option_problem
from skills.validation import expand_file

RECIPES = Path(__file__).parent / "recipes"
SKILLS = load_skills()  # read once: the front matter names the controllers and the parameter defaults
CONTROLLERS = tuple(sorted(name for name, skill in SKILLS.items() if skill.kind == "controller"))
DEFAULT_CONTROLLER = "colocate"  # a starter's, and generate's round 0: the one every target can run
FIXED = ("controller", "train_devices", "rollout_devices")  # a starter's controller and its device split


def unfit(spec, controller: str) -> str | None:
    """Why ``controller`` cannot run on the target's devices, or None: the controllers that keep
    rollout and training apart need two devices or more (the one-GPU target has one)."""
    if controller != "colocate" and spec.hardware.count < 2:
        return f"{controller} keeps rollout and training on different devices: the target has one device"
    return None


def starter_params(spec, controller: str) -> dict:
    """Default parameters: device split from the target's baseline entry, else half and half."""
    if controller not in CONTROLLERS:
        raise ValueError(f"unknown controller {controller!r}; known: {', '.join(CONTROLLERS)}")
    if (why := unfit(spec, controller)) is not None:
        raise ValueError(why)
    count = spec.hardware.count
    baseline = next((b for b in spec.baselines if b.name == controller and b.label is None), None)
    params: dict = {"controller": controller, "engine": "paged", "threads_per_actor": 1, **defaults(SKILLS)}
    if controller == "static_split":
        params["train_devices"] = baseline.train_devices if baseline and baseline.train_devices else max(1, count // 2)
        params["rollout_devices"] = (
            baseline.rollout_devices if baseline and baseline.rollout_devices else count - params["train_devices"]
        )
    if controller == "time_multiplex":
        params["train_devices"] = baseline.train_devices if baseline and baseline.train_devices else max(1, count // 2)
        if params["train_devices"] >= count:
            raise ValueError(
                f"time_multiplex needs a device that never trains: train_devices {params['train_devices']} of {count}"
            )
    return params


def baseline_params(spec, baseline, engine_devices: int = 1) -> dict:
    """A labelled baseline's starter parameters: its controller's (its own split), then its own ``params``."""
    own = spec.model_copy(update={"baselines": [baseline.model_copy(update={"label": None, "params": {}})]})
    return with_params(own, baseline.name, baseline.params, f"baseline {baseline.label!r}", engine_devices, "params.")


def with_params(spec, controller: str, given: dict, where: str, engine_devices: int = 1, prefix: str = "") -> dict:
    """``controller``'s starter parameters with ``given`` over them: each a parameter the recipes read
    (not the controller or the device split: those come by name and from the target), a skill's a
    number within its range on this target, an engine, trainer or cluster option one of the values
    its recipe takes (``option_problem``), and every technique they turn on allowed beside the rest.
    ``ValueError`` names ``where`` and the parameter."""
    params = {**starter_params(spec, controller), **given}
    for name, value in given.items():
        if name == "controller":
            raise ValueError(
                f"{where}: {prefix}controller is chosen by name (starter --controller, generate --starter, a "
                "baseline's name)"
            )
        if name in FIXED:
            raise ValueError(f"{where}: {prefix}{name} is the device split, the target's (a baseline's own field)")
        if name not in KNOWN_PARAMS:
            close = difflib.get_close_matches(name, [k for k in KNOWN_PARAMS if k not in FIXED], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{where}: {prefix}{name} is no parameter of the skills library{hint}")
        ranges = [skill.params[name] for skill in SKILLS.values() if name in skill.params]
        if not ranges:  # an engine, trainer or cluster option: its values are the recipe's
            if (problem := option_problem(name, value)) is not None:
                raise ValueError(f"{where}: {prefix}{problem}")
            continue
        whole = any(r.type == "int" for r in ranges)
        if type(value) not in ((int,) if whole else (int, float)):
            kind = "a whole number" if whole else "a number"
            raise ValueError(f"{where}: {prefix}{name} must be {kind}, not {json.dumps(value)}")
        if not legal(SKILLS, name, value, spec.hardware.count, engine_devices, spec.workload.declared_limits):
            bounds = [r.bounds(spec.hardware.count, spec.workload.declared_limits) for r in ranges]
            low, high = max(b[0] for b in bounds), min(b[1] for b in bounds)
            engines = next((r.step_engines for r in ranges if r.step_engines), None)
            steps = f", in whole engines of {engines * engine_devices}" if engines else ""
            raise ValueError(
                f"{where}: {prefix}{name} = {value} is outside the range its skill allows on this target "
                f"([{low:g}, {high:g}]{steps})"
            )
    for skill in SKILLS.values():
        if skill.kind == "technique" and skill.is_on(params):
            if (why := not_applicable(SKILLS, skill, params)) is not None:
                raise ValueError(f"{where}: the params turn the {skill.name} technique on, but {why}")
    return params


def parse_params(texts, flag: str) -> dict:
    """``KEY=VALUE`` texts given to ``flag`` (``--param``, ``--starter-param``) as params: each value as
    JSON where it reads as JSON (``false``, ``0.5``, ``null``), else the text itself (``sdpa``)."""
    params = {}
    for text in texts:
        name, sep, value = text.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{flag} {text!r}: expected KEY=VALUE (for example fused_kernels=false)")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        if isinstance(parsed, (list, dict)):
            kind = "a list" if isinstance(parsed, list) else "an object"
            raise ValueError(f"{flag} {text!r}: a value is a number, true, false, null or text, not {kind}")
        if name.strip() in params:  # the last would win unsaid: which one the user meant is theirs to say
            raise ValueError(
                f"{flag} {name.strip()} given twice ({format_param(name.strip(), params[name.strip()])}, {text})"
            )
        params[name.strip()] = parsed
    return params


def format_param(name: str, value) -> str:
    """A param as ``KEY=VALUE``, the text ``parse_params`` reads back to the same value."""
    return f"{name}={json.dumps(value)}"


def write_starter(directory: Path, spec, controller: str, params: dict | None = None, replace: bool = False) -> Path:
    """A starter candidate in ``directory``: never over a stack, DESIGN.md or .gitignore already there,
    unless ``replace`` (a round's own workspace, its starter written afresh on every attempt)."""
    params = params or starter_params(spec, controller)
    stack = directory / "stack"
    there = [path for path in (stack, directory / "DESIGN.md", directory / ".gitignore") if path.exists()]
    if there and not replace:  # a starter never writes over what a user has
        raise FileExistsError(f"{', '.join(str(p) for p in there)} already exist(s): choose a new directory")
    if replace and stack.exists():
        shutil.rmtree(stack)
    stack.mkdir(parents=True)
    for recipe in sorted(RECIPES.glob("*.py")):
        if recipe.name != "__init__.py":
            shutil.copy2(recipe, stack / recipe.name)
            # recipes carry validation annotations (skills/validation/PATTERNS.md)
            expand_file(stack / recipe.name, directory)
    (stack / "__init__.py").write_text(
        '"""A vibetrain candidate stack."""\n\nfrom .build import build\n\n__all__ = ["build"]\n'
    )
    (stack / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    DesignDoc.starter(controller, params).save(directory / "DESIGN.md")
    (directory / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    return directory
