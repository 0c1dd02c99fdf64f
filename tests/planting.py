"""Planting cheats into starter stacks: write a starter, replace exact snippets (each must be found,
so a recipe change cannot silently un-plant a test), add files."""

from __future__ import annotations

from pathlib import Path

import yaml

from skills.starter import write_starter
from targets.spec import parse_target


def planted(
    directory: Path,
    target: Path,
    controller: str,
    edits: dict[str, tuple[str, str]] | None = None,
    extra: dict[str, str] | None = None,
) -> Path:
    spec = parse_target(yaml.safe_load(Path(target).read_text()))
    candidate = write_starter(directory, spec, controller)
    for name, (old, new) in (edits or {}).items():
        path = candidate / "stack" / name
        text = path.read_text()
        assert old in text, f"planting failed: {old!r} not in {name}"
        path.write_text(text.replace(old, new))
    for name, text in (extra or {}).items():
        (candidate / "stack" / name).write_text(text)
    return candidate
