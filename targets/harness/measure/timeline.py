"""The per-device timeline: one row per device, colored by activity, one panel per schedule,
stacked on a shared time axis so the schedules compare at a glance.

Consecutive devices that did exactly the same thing (the devices of one engine, a training pool
that trains in lock-step) share one row labelled with their range, so a 160-device cluster reads
as its pools and engines instead of 160 slivers.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from targets.api import TraceEvent  # noqa: E402
from targets.harness.measure.metrics import ACTIVITIES, device_intervals, exclusive_activity  # noqa: E402

COLORS = {"rollout": "#4caf50", "train": "#1f77b4", "sync": "#ff9800", "switching": "#d62728"}


def _label(devices: list[str]) -> str:
    if len(devices) == 1:
        return devices[0]
    first, last = devices[0], devices[-1]
    prefix = first.rsplit(":", 1)[0] + ":"
    return f"{first}-{last.removeprefix(prefix)} ({len(devices)})"


def _activity_handles() -> list[Patch]:
    """The legend's entries for the device activities, idle last (white, as the bars draw it)."""
    return [Patch(color=COLORS[a], label=a) for a in ("rollout", "train", "sync", "switching")] + [
        Patch(facecolor="white", edgecolor="grey", label="idle")
    ]


def device_rows(events: list[TraceEvent], devices: list[str]) -> list[tuple[str, dict[str, list[tuple[float, float]]]]]:
    """(row label, activity -> intervals), merging runs of consecutive devices with identical activity."""
    intervals = device_intervals(events)
    rows: list[tuple[list[str], dict, tuple]] = []
    for device in devices:
        exclusive = exclusive_activity(intervals.get(device, {}))
        key = tuple((a, tuple((round(x, 6), round(y, 6)) for x, y in exclusive[a])) for a in ACTIVITIES)
        if rows and rows[-1][2] == key:
            rows[-1][0].append(device)
        else:
            rows.append(([device], exclusive, key))
    return [(_label(members), exclusive) for members, exclusive, _ in rows]


def plot_timelines(runs: list[tuple[str, list[TraceEvent], list[str]]], path: Path) -> Path:
    """``runs``: (title, events, device ids) per schedule."""
    panels = [(title, device_rows(events, devices)) for title, events, devices in runs]
    heights = [max(1, len(rows)) * 0.45 + 0.6 for _, rows in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(12, sum(heights) + 0.8),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for ax, (title, rows) in zip(axes[:, 0], panels):
        for row, (_, exclusive) in enumerate(rows):
            for activity in ACTIVITIES:
                spans = [(a, b - a) for a, b in exclusive[activity]]
                ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLORS[activity])
        ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8 if len(rows) > 8 else 10)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10, loc="left", parse_math=False)  # a label may quote a candidate's words
    axes[-1, 0].set_xlabel("seconds since run start")
    fig.legend(
        handles=_activity_handles(),
        loc="upper right",
        ncol=5,
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_step_phases(runs: list[tuple[str, dict]], path: Path) -> Path:
    """Where a step goes, one pair of bars per schedule: above, the measured step split by activity
    (``step_<activity>_s``); below, what rollout and training need at least (their work spread over
    every device), with the step's lower bound marked. ``runs``: (name, median metrics)."""
    fig, ax = plt.subplots(figsize=(10, 0.9 * len(runs) + 1.5))
    for row, (_, m) in enumerate(runs):
        left = 0.0
        for activity in (*ACTIVITIES[::-1], "idle"):  # rollout, sync, train, switching, then idle
            width = m[f"step_{activity}_s"]
            ax.barh(row - 0.18, width, 0.34, left=left, color=COLORS.get(activity, "white"), edgecolor="grey")
            left += width
        left = 0.0
        for activity in ("rollout", "train"):
            width = m[f"{activity}_bound_s"]
            ax.barh(row + 0.2, width, 0.26, left=left, color=COLORS[activity], alpha=0.45, hatch="//")
            left += width
        bound = m["lower_bound_step_s"]
        ax.plot([bound, bound], [row - 0.4, row + 0.38], color="black", linewidth=1.5)
        said = f" bound = {m['lower_bound_fraction']:.0%} of this step"
        ax.text(m["step_time_s"], row - 0.18, said, va="center", fontsize=8)
    longest = max(max(m["step_time_s"], m["lower_bound_step_s"]) for _, m in runs)
    ax.set_xlim(0, longest * 1.2)  # room for the labels
    ax.set_yticks(range(len(runs)), [name for name, _ in runs])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (mean over devices): measured above, the work each phase needs below")
    fig.legend(
        handles=[
            *_activity_handles(),
            Patch(facecolor="white", hatch="//", label="work"),
            plt.Line2D([], [], color="black", label="lower bound"),
        ],
        loc="upper right",
        fontsize=8,
        ncol=7,
    )
    ax.set_title("where a step goes", fontsize=10, loc="left")
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
