"""Builds ``benchmarks/RESULTS.md``, the one file of measured results, from ``benchmarks/results/``.

    python benchmarks/results.py            # write RESULTS.md
    python benchmarks/results.py --check    # exit 1 if RESULTS.md is not what the entries give

Each entry is a YAML file (``Entry``): ``title``, ``section``, the provenance (``command``, ``commit``,
``machine``, ``date``), the figures as a Markdown ``table``, and ``notes``. A figure that a new
measurement supersedes is replaced in its entry, not kept beside it: git keeps the old one.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, StrictStr, ValidationError

HERE = Path(__file__).resolve().parent
ENTRIES = HERE / "results"
RESULTS = HERE / "RESULTS.md"
Section = Literal["judge", "cpu", "simulated", "gpu", "suite"]  # in the order RESULTS.md gives them
SECTIONS: tuple[str, ...] = get_args(Section)


class Entry(BaseModel):
    """One measured result with its provenance: a key it does not know (``tabel:``) is an error, not
    figures dropped; strings are strings (an unquoted all-digit commit is YAML's integer)."""

    model_config = ConfigDict(extra="forbid")
    title: StrictStr
    section: Section
    command: StrictStr
    commit: StrictStr
    machine: StrictStr
    date: datetime.date | StrictStr
    table: StrictStr = ""
    notes: StrictStr = ""


def render_entry(path: Path) -> tuple[str, str]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:  # a command with ': ' in it, say: quote it, or write it as a block (>-)
        raise ValueError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: an entry is a mapping of title, section, command, ...; found {type(data).__name__}")
    try:
        entry = Entry.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" + ("" if e["type"] == "missing" else f" (got {e['input']!r})")
            for e in error.errors()
        )
        raise ValueError(f"{path}: {problems}") from None
    blank = [k for k in ("title", "command", "commit", "machine") if not getattr(entry, k).strip()]
    if blank:
        raise ValueError(f"{path}: no {', '.join(blank)}: a figure without its provenance is not kept")
    lines = [f"### {entry.title}", ""]
    lines.append(f"`{entry.command}` — commit `{entry.commit}`, {entry.machine}, {entry.date}")
    lines += ["", entry.table.strip(), ""] if entry.table else [""]
    if entry.notes:
        lines += [entry.notes.strip(), ""]
    return entry.section, "\n".join(lines)


def render() -> str:
    by_section: dict[str, list[str]] = {s: [] for s in SECTIONS}
    for path in sorted(ENTRIES.glob("*.yaml")):
        section, text = render_entry(path)
        by_section[section].append(text)
    titles = {
        "judge": "The judge",
        "cpu": "Real runs on the CPU target",
        "simulated": "Simulated targets",
        "gpu": "On GPUs",
        "suite": "The test suite",
    }
    out = [
        "# Measured results",
        "",
        "Built by `python benchmarks/results.py` from `benchmarks/results/*.yaml`; each figure names the",
        "command, the commit, the machine and the date it was measured on. Edit the entries, not this file.",
        "",
    ]
    for section in SECTIONS:
        if by_section[section]:
            out += [f"## {titles[section]}", "", *by_section[section]]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    try:
        text = render()
    except ValueError as error:
        sys.exit(f"results.py: {error}")
    if "--check" in sys.argv:
        sys.exit(0 if RESULTS.exists() and RESULTS.read_text() == text else 1)
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}")
