"""Builds ``benchmarks/RESULTS.md``, the one file of measured results, from ``benchmarks/results/``.

    python benchmarks/results.py            # write RESULTS.md
    python benchmarks/results.py --check    # exit 1 if RESULTS.md is not what the entries give

Each entry is a YAML file: ``title``, ``section``, the provenance (``command``, ``commit``, ``machine``,
``date``) and the figures, either a ``table`` (Markdown) or ``bench:`` the JSON a ``vibetrain bench
--json`` wrote (its provenance and medians are read from it), and ``notes``. A figure that a new
measurement supersedes is replaced in its entry, not kept beside it: git keeps the old one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ENTRIES = HERE / "results"
RESULTS = HERE / "RESULTS.md"
SECTIONS = ("judge", "cpu", "simulated", "gpu", "suite")
PROVENANCE = ("command", "commit", "machine", "date")
COLUMNS = ("goodput", "rollout_throughput", "step_time_s", "timeouts")


def bench_table(path: Path) -> tuple[str, dict]:
    """The medians of a ``vibetrain bench --json`` file, and its provenance."""
    data = json.loads(path.read_text())
    runs = data["runs"]
    first = runs[0]["metrics"].get("goodput") or 1.0
    lines = ["| schedule | " + " | ".join(COLUMNS) + " | x first |", "|---" * (len(COLUMNS) + 2) + "|"]
    for run in runs:
        metrics = run["metrics"]
        cells = [f"{metrics[c]:.4g}" if isinstance(metrics.get(c), (int, float)) else "-" for c in COLUMNS]
        ratio = metrics.get("goodput", 0.0) / first if first else 0.0
        lines.append(f"| {run['name']} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    source = data.get("provenance", {})
    return "\n".join(lines), {
        "commit": source.get("commit", "?")[:12],
        "machine": f"{source.get('host', '?')} ({source.get('cpus', '?')} CPUs, {source.get('execution', '?')})",
        "date": source.get("timestamp", "?")[:10],
    }


def render_entry(path: Path) -> tuple[str, str]:
    try:
        entry = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:  # a command with ': ' in it, say: quote it, or write it as a block (>-)
        raise ValueError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: an entry is a mapping of title, section, command, ...; found {type(entry).__name__}")
    missing = [k for k in ("title", "section", "command") if k not in entry]
    if missing or entry.get("section") not in SECTIONS:
        raise ValueError(f"{path}: needs title, section (one of {SECTIONS}) and command; missing {missing}")
    table = entry.get("table", "")
    provenance = {k: entry.get(k) for k in PROVENANCE}
    if "bench" in entry:
        table, recorded = bench_table(path.parent / entry["bench"])
        provenance = {**recorded, **{k: v for k, v in provenance.items() if v}}
    unknown = [k for k in PROVENANCE if not provenance.get(k)]
    if unknown:
        raise ValueError(f"{path}: no {', '.join(unknown)}: a figure without its provenance is not kept")
    lines = [f"### {entry['title']}", ""]
    lines.append(
        f"`{provenance['command']}` — commit `{provenance['commit']}`, {provenance['machine']}, {provenance['date']}"
    )
    lines += ["", table.strip(), ""] if table else [""]
    if entry.get("notes"):
        lines += [entry["notes"].strip(), ""]
    return entry["section"], "\n".join(lines)


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
