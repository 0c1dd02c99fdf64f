"""The per-device timeline: one row per device, colored by activity, one panel per schedule,
stacked on a shared time axis so the schedules compare at a glance."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from targets.api import TraceEvent  # noqa: E402
from targets.harness.metrics import ACTIVITIES, device_intervals, exclusive_activity  # noqa: E402

COLORS = {"rollout": "#4caf50", "train": "#1f77b4", "sync": "#ff9800", "switching": "#d62728"}


def plot_timelines(runs: list[tuple[str, list[TraceEvent], list[str]]], path: Path) -> Path:
    """``runs``: (title, events, device ids) per schedule."""
    heights = [max(1, len(devices)) * 0.45 + 0.6 for _, _, devices in runs]
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, sum(heights) + 0.8), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (title, events, devices) in zip(axes[:, 0], runs):
        intervals = device_intervals(events)
        for row, device in enumerate(devices):
            exclusive = exclusive_activity(intervals.get(device, {}))
            for activity in ACTIVITIES:
                spans = [(a, b - a) for a, b in exclusive[activity]]
                ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLORS[activity])
        ax.set_yticks(range(len(devices)), devices)
        ax.set_ylim(-0.6, len(devices) - 0.4)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("seconds since run start")
    fig.legend(handles=[Patch(color=COLORS[a], label=a) for a in ("rollout", "train", "sync", "switching")] +
               [Patch(facecolor="white", edgecolor="grey", label="idle")], loc="upper right", ncol=5, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
