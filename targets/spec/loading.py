"""Loading a target: a catalog id or a YAML path, validated, every problem named by its field path."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from targets.spec.base import SpecError
from targets.spec.hardware import HARDWARE_FORMS
from targets.spec.target import TargetSpec
from targets.workload_profile import MEASURED, MEASURED_TOKENS
from targets.yaml_text import load_yaml

CATALOG_DIR = Path(__file__).parent.parent / "catalog"


def _from_profile(data: dict, loc: tuple) -> str | None:
    """The profile file a bad value came from, where the spec took it from its profile, not its own text."""
    workload = data.get("workload")
    if not isinstance(workload, dict) or workload.get("profile") is None or loc[:1] != ("workload",):
        return None
    key = loc[1:3] if loc[1:2] == ("tokens",) else loc[1:2]
    measured = key[-1:] and key[-1] in (MEASURED_TOKENS if key[:1] == ("tokens",) and len(key) == 2 else MEASURED)
    own = workload if len(key) == 1 else workload.get("tokens") or {}
    return str(workload["profile"]) if measured and key[-1] not in own else None


def _models_in(annotation) -> list[type[BaseModel]]:
    """The spec models a field's annotation holds (through Optional, lists, mappings, unions)."""
    # list[X] is an instance of type on Python 3.10, and issubclass of it raises: only plain classes
    if isinstance(annotation, type) and get_origin(annotation) is None and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for argument in get_args(annotation) for model in _models_in(argument)]


def _close_field(loc: tuple, data: dict) -> str | None:
    """The field a misspelt one at ``loc`` most likely meant, among those of the models there that ``data``
    (the spec as written) does not already give there."""
    models: list[type[BaseModel]] = [TargetSpec]
    written: Any = data
    for part in loc[:-1]:  # an index, a mapping's key or a form's tag names no field: the models stay
        inner = [_models_in(m.model_fields[part].annotation) for m in models if part in m.model_fields]
        models = [model for found in inner for model in found] or models
        if isinstance(written, dict) and part in written:  # a form's tag is in loc, not in what was written
            written = written[part]
        elif isinstance(written, list) and isinstance(part, int) and part < len(written):
            written = written[part]
    given = set(written) if isinstance(written, dict) else set()
    known = sorted({name for model in models for name in model.model_fields} - given)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    return close[0] if close else None


def _format_errors(source: str, error: ValidationError, data: dict) -> str:
    lines = [f"invalid target spec {source}:"]
    errors = error.errors()
    # lists with an item that failed, by path: pydantic counts their length without it
    inner = {item["loc"][:i] for item in errors for i, part in enumerate(item["loc"]) if isinstance(part, int)}
    for item in errors:
        loc = item["loc"]
        written, least = item.get("input"), (item.get("ctx") or {}).get("min_length", 0)
        enough = isinstance(written, (list, tuple)) and len(written) >= least  # as the user wrote it
        if item["type"] == "too_short" and loc in inner and enough:  # counted without the item that failed
            continue
        if loc[:1] == ("hardware",) and len(loc) > 1 and loc[1] in HARDWARE_FORMS:
            loc = loc[:1] + loc[2:]  # the form's tag: not a field anyone wrote
        field = f"`{'.'.join(str(p) for p in loc) or '<top level>'}`"
        if (profile := _from_profile(data, loc)) is not None:
            field += f" (from the profile {profile})"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            close = _close_field(item["loc"], data)
            message = f"unknown field (did you mean `{close}`?)" if close else "unknown field (check its spelling)"
        shown = item.get("input")
        if item["type"] == "missing" or isinstance(shown, (dict, list)):  # the mapping around it: nothing to show
            lines.append(f"  field {field}: {message}")
        else:
            lines.append(f"  field {field}: {message} (got {shown!r})")
    return "\n".join(lines)


def parse_target(data: Any, source: str = "<dict>", base_dir: Path | None = None) -> TargetSpec:
    """Validate an already-parsed spec; raises SpecError naming every bad field."""
    if not isinstance(data, dict):
        raise SpecError(f"invalid target spec {source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return TargetSpec.model_validate(data, context={"base_dir": base_dir or Path.cwd()})
    except ValidationError as error:
        raise SpecError(_format_errors(source, error, data)) from None


def load_target_file(path: Path) -> TargetSpec:
    try:
        text = path.read_text()
    except OSError as error:
        raise SpecError(f"cannot read target spec {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise SpecError(f"target spec {path} is not UTF-8 text (byte {error.start}): is it the YAML file?") from None
    try:
        data = load_yaml(text, str(path))
    except yaml.YAMLError as error:
        raise SpecError(f"target spec {path} is not valid YAML: {error}") from None
    return parse_target(data, source=str(path), base_dir=path.parent)


def catalog_ids() -> list[str]:
    return sorted(p.stem for p in CATALOG_DIR.glob("*.yaml"))


def resolve_target_path(ref: str | Path) -> Path:
    """The YAML file behind a catalog id (``tiny-qwen3-cpu``) or a path."""
    path = Path(ref)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.exists():
            raise SpecError(f"target spec file not found: {path}")
        return path
    catalog_path = CATALOG_DIR / f"{ref}.yaml"
    if not catalog_path.exists():  # a folder of the same name (a run, a starter) never hides a catalog id
        what = "a directory, not a spec's YAML file" if path.is_dir() else "no such file"
        close = difflib.get_close_matches(str(ref), catalog_ids(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SpecError(
            f"unknown target {str(ref)!r}{hint}: not a catalog id (known: {', '.join(catalog_ids())}) and {what}"
        )
    return catalog_path


def load_target(ref: str | Path) -> TargetSpec:
    """A catalog id (``tiny-qwen3-cpu``) or a path to a YAML file."""
    return load_target_file(resolve_target_path(ref))
