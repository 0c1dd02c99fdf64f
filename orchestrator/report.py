"""``vibetrain report RUN``: one static HTML page a reviewer can open offline and trust without the
terminal: where the run and the page came from (provenance), the headline metric per round with its
unit, the repeats' spread and the noise band, the search tree, the best candidate's per-device
timeline against the baselines, and every round expandable to its change, the judge's evidence and
its own timeline. Reading a run never writes to it: figures are rendered in a temporary directory."""

from __future__ import annotations

import base64
import datetime
import io
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jinja2
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from orchestrator.history import History  # noqa: E402
from orchestrator.prescreen import clears, twin_said  # noqa: E402
from orchestrator.provenance import run_spec, source_commit, spec_hash, versions  # noqa: E402
from orchestrator.run_dir import RunDir  # noqa: E402
from orchestrator.state import RoundRecord, RunState  # noqa: E402
from orchestrator.tables import (  # noqa: E402
    best_generalization,
    best_over_starter,
    cut_diff,
    interval_of,
    paired_cell,
    promotion,
)
from targets.harness.judge.check_result import detail  # noqa: E402
from targets.harness.measure.timeline import plot_timelines  # noqa: E402
from targets.harness.trace import Trace  # noqa: E402
from targets.printable import one_line, printable  # noqa: E402
from targets.spec import TargetSpec  # noqa: E402

# The harness's metrics (targets/harness/measure/metrics.py, the evaluator's additions) and their units: by
# name where the name does not say, else by suffix; the spec names the headline metric only.
UNITS = {
    "goodput": "trajectories/s",
    "rollout_throughput": "trajectories/s",  # finished, trained or not (goodput: trained)
    "tokens_per_s": "tokens/s",
    "trained_tokens_per_s": "trained response tokens/s",
    "mean_device_busy": "fraction",
    "trajectories": "count",
    "aborted_turns": "count",
    "kv_preemptions": "count",
    "decode_batch": "sequences",
    "decode_share": "fraction",
}
UNIT_SUFFIXES = (
    ("_s", "s"),
    ("_mb", "MB"),
    ("_gb", "GB"),
    ("_fraction", "fraction"),
    ("_ratio", "fraction"),
)
VERDICT_STYLE = {  # (colour, legend label) per node kind of the tree and the per-round plot
    "promoted": ("#2e7d32", "accepted, promoted to best"),
    "accepted": ("#9ccc65", "accepted, not promoted"),
    "rejected": ("#c62828", "rejected by the judge"),
    "prescreened": ("#8e24aa", "screened out by the twin"),
    "error": ("#ef6c00", "error: the round failed"),
}
BEST_RING = "#f9a825"

TEMPLATE = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent), undefined=jinja2.StrictUndefined, autoescape=True
).get_template("report.html.j2")


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def _kind(r: RoundRecord) -> str:
    """The node kind: the verdict, with accepted split by whether it became the best."""
    if r.verdict == "accepted":
        return "promoted" if r.became_best else "accepted"
    if r.verdict not in VERDICT_STYLE:
        raise ValueError(f"round {r.round} has an unknown verdict {r.verdict!r}")
    return r.verdict


def _unit(metric: str) -> str:
    if metric in UNITS:
        return UNITS[metric]
    if metric.endswith("_per_s"):  # tokens_per_s: tokens/s
        return metric.removesuffix("_per_s") + "/s"
    suffix = next((unit for end, unit in UNIT_SUFFIXES if metric.endswith(end)), None)
    return suffix or "unit unknown to the report"


def _num(value: float | int | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.4g}"


def _pct(x: float) -> str:
    return f"{(x - 1) * 100:+.1f}%"


# -- figures ---------------------------------------------------------------------------------------
def _per_round(state: RunState, metric: str, threshold: float, maximize: bool) -> str:
    """Headline per round with the repeats' spread, the best-so-far line and its noise band."""
    rounds = [r.round for r in state.rounds]
    fig, ax = plt.subplots(figsize=(max(10, 0.42 * len(rounds)), 4))
    best_line, best = [], None
    for r in state.rounds:
        if r.became_best and r.headline is not None:
            best = r.headline
        best_line.append(best)
    known = [(x, b) for x, b in zip(rounds, best_line) if b is not None]
    if known:
        xs = [x for x, _ in known] + [known[-1][0] + 0.5]
        ys = [b for _, b in known] + [known[-1][1]]
        ax.fill_between(
            xs,
            [y * (1 - threshold) for y in ys],
            [y * (1 + threshold) for y in ys],
            step="post",
            color="#1f77b4",
            alpha=0.13,
            label=f"noise band: best \u00d7 (1 \u00b1 {threshold:.0%})",
        )
        ax.step(xs, ys, where="post", color="#1f77b4", linewidth=1.5, label="best so far")
    for kind in ("promoted", "accepted"):
        chosen = [r for r in state.accepted() if _kind(r) == kind and r.headline is not None]
        if not chosen:
            continue
        colour, label = VERDICT_STYLE[kind]
        ax.errorbar(
            [r.round for r in chosen],
            [r.headline for r in chosen],
            yerr=[r.spread.get(metric, 0.0) / 2 for r in chosen],
            fmt="o",
            markersize=8,
            capsize=4,
            color="#2e7d32",
            markerfacecolor=colour if kind == "promoted" else "white",
            markeredgewidth=1.6,
            label=label,
            zorder=3,
        )
    for r, best_before in zip(state.rounds, [None, *best_line]):
        # the paired ratio decided promotion: shown where the dot alone would mislead (inside or above the band)
        near = (
            best_before is not None and r.headline is not None and clears(r.headline, best_before, threshold, maximize)
        )
        if r.paired is not None and (r.became_best or near):
            ax.annotate(
                _pct(r.paired.ratio),
                (r.round, r.headline + r.spread.get(metric, 0.0) / 2),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                va="bottom",
                fontsize=7.5,
                color="#555",
            )
    unmeasured = [r for r in state.rounds if r.headline is None]
    for kind in ("rejected", "prescreened", "error"):
        chosen = [r for r in unmeasured if _kind(r) == kind]
        if chosen:
            colour, label = VERDICT_STYLE[kind]
            ax.plot(
                [r.round for r in chosen],
                [0.04] * len(chosen),
                "x",
                color=colour,
                markersize=9,
                markeredgewidth=2,
                transform=ax.get_xaxis_transform(),
                label=f"{label} (not measured)",
                clip_on=False,
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(min(rounds) - 0.5, max(rounds) + 0.5)
    ax.margins(y=0.12)  # room for the percentages over the top dots
    ax.set_xlabel("round")
    ax.set_ylabel(f"{metric} ({_unit(metric)})")
    ax.grid(axis="y", color="#eee")
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: "not measured" in labels[i])  # measured first
    ax.legend(
        [handles[i] for i in order],
        [labels[i] for i in order],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=9,
        frameon=False,
    )
    return _png(fig)


@dataclass
class _Node:
    record: RoundRecord
    depth: int = 0
    y: float = 0.0


def _layout(state: RunState) -> dict[int, _Node]:
    """A tidy tree: depth left to right, leaves one slot apart top to bottom, each parent centred on
    its children (a round whose parent is not in the run, round 0, is a root)."""
    nodes = {r.round: _Node(r) for r in state.rounds}
    children: dict[int | None, list[int]] = {}
    for r in state.rounds:
        parent = r.parent_round if r.parent_round in nodes else None
        children.setdefault(parent, []).append(r.round)
    next_slot = 0.0

    def place(number: int, depth: int) -> float:
        nonlocal next_slot
        node = nodes[number]
        node.depth = depth
        kids = sorted(children.get(number, []))
        if not kids:
            node.y, next_slot = next_slot, next_slot + 1
        else:
            ys = [place(k, depth + 1) for k in kids]
            node.y = (ys[0] + ys[-1]) / 2
        return node.y

    for root in sorted(children.get(None, [])):
        place(root, 0)
    return nodes


def _lineage(state: RunState) -> set[int]:
    """The rounds from the best back to its root."""
    chain, r = set(), state.best
    while r is not None:
        chain.add(r.round)
        r = state.record(r.parent_round) if r.parent_round is not None else None
    return chain


def _tree(state: RunState, metric: str) -> str:
    """Nodes are candidates, edges parent to child (elbow), colour the verdict, area the headline."""
    nodes = _layout(state)
    lineage = _lineage(state)
    depth = max(n.depth for n in nodes.values())
    leaves = max(n.y for n in nodes.values()) + 1
    column = max(1.4, min(2.6, 22 / (depth + 1)))  # inches per depth: a deep tree still fits a page
    fig, ax = plt.subplots(figsize=(column * (depth + 1) + 1.5, max(2.8, 0.85 * leaves + 0.8)))
    label_chars = int(column * 72 / 5.2) - 4  # what fits in a column at 8.5 pt, less the "rN  " prefix
    measured = [r.headline for r in state.rounds if r.headline is not None]
    top = max(measured) if measured else 1.0

    def area(value: float) -> float:
        return max(40.0, 900.0 * value / top)

    for node in nodes.values():
        r = node.record
        parent = nodes.get(r.parent_round) if r.parent_round is not None else None
        if parent is None:
            continue
        on_lineage = r.round in lineage and parent.record.round in lineage
        mid = parent.depth + 0.5
        ax.plot(
            [parent.depth, mid, mid, node.depth],
            [parent.y, parent.y, node.y, node.y],
            "-",
            color="#1f77b4" if on_lineage else "#aaa",
            linewidth=2.6 if on_lineage else 1.2,
            zorder=2 if on_lineage else 1,  # over the grey spine it shares with its siblings
        )
    for node in nodes.values():
        r = node.record
        colour = VERDICT_STYLE[_kind(r)][0]
        best = r.round == state.best_round
        if r.headline is not None:
            size = area(r.headline)
            ax.scatter(
                node.depth,
                node.y,
                s=size,
                color=colour,
                edgecolors=BEST_RING if best else "#333",
                linewidths=3.5 if best else 0.8,
                zorder=3,
            )
            value = f"{r.headline:.3g}"
        else:
            size = 140.0
            ax.scatter(node.depth, node.y, s=size, marker="X", color=colour, edgecolors="white", zorder=3)
            value = "not measured"
        radius = (size**0.5) / 2 + 3  # points: clear of the marker
        task = r.task.id if len(r.task.id) <= label_chars else r.task.id[: label_chars - 1] + "\u2026"
        ax.annotate(
            f"r{r.round}  {task}",
            (node.depth, node.y),
            textcoords="offset points",
            xytext=(0, radius),
            ha="center",
            va="bottom",
            fontsize=8.5,
            fontweight="bold" if best else "normal",
            zorder=4,
        )
        ax.annotate(
            value,
            (node.depth, node.y),
            textcoords="offset points",
            xytext=(0, -radius),
            ha="center",
            va="top",
            fontsize=8,
            color="#444",
            zorder=4,
        )
    present = {_kind(r) for r in state.rounds}
    handles = [
        Line2D(
            [],
            [],
            marker="o" if kind in ("promoted", "accepted") else "X",
            linestyle="",
            markersize=9,
            color=colour,
            label=label,
        )
        for kind, (colour, label) in VERDICT_STYLE.items()
        if kind in present
    ]
    if state.best_round is not None:
        handles.append(
            Line2D([], [], marker="o", linestyle="", markersize=10, color="white", markeredgecolor=BEST_RING,
                   markeredgewidth=3, label="current best (its lineage: thick line)")
        )  # fmt: skip
    if measured:
        handles += [
            Line2D([], [], marker="o", linestyle="", color="#bbb", markersize=area(top * f) ** 0.5,
                   label=f"area: {metric} {top * f:.3g} {_unit(metric)}")
            for f in (1.0, 0.25)
        ]  # fmt: skip
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=9, frameon=False,
              labelspacing=1.6, borderpad=0.8, handletextpad=1.2)  # fmt: skip
    ax.set_xlim(-0.6, depth + 0.6)
    ax.set_ylim(leaves - 0.4, -0.6)
    ax.set_xticks(range(depth + 1), [f"depth {d}" for d in range(depth + 1)], fontsize=8, color="#888")
    ax.set_yticks([])
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="x", length=0)
    return _png(fig)


def _timeline_png(panels: list, scratch: Path, name: str) -> str:
    path = plot_timelines(panels, scratch / f"{name}.png")
    return base64.b64encode(path.read_bytes()).decode()


CONTROLLER_CHARS = 60  # of a candidate's controller name in a timeline's label


def _baselines(state: RunState, history: History, maximize: bool) -> dict[int, str]:
    """round -> label: the best, round 0's starter and the best-scoring candidate of each other controller
    (its headline highest, or lowest for a metric to minimize)."""
    chosen: dict[int, str] = {}
    if state.best_round is not None:
        chosen[state.best_round] = "the best"
    controllers: dict[str, RoundRecord] = {}
    for r in state.accepted():  # the starter competes for its controller too: a later one it beats is no best
        # the candidate's own word (its params.json): one short printable line, never markup or math to a plot
        controller = one_line(str(history.params(r.commit).get("controller", "unnamed controller")))[:CONTROLLER_CHARS]
        if r.round == 0:
            chosen.setdefault(0, f"the starter ({controller})")
        if controller not in controllers or _better(r.headline, controllers[controller].headline, maximize):
            controllers[controller] = r
    for controller, r in controllers.items():
        chosen.setdefault(r.round, f"best-scoring {controller} candidate")
    return chosen


def _better(headline: float, than: float, maximize: bool) -> bool:
    """Strictly better in the metric's direction (a tie keeps the earlier round)."""
    return headline > than if maximize else headline < than


# -- per round -------------------------------------------------------------------------------------
def _diff_lines(diff: str, run_path: str, commit: str) -> tuple[list[tuple[str, str]], str]:
    lines, cut = cut_diff(diff, run_path, commit)
    styled, header = [], False  # a file's header runs from its "diff --git" to its first hunk
    for line in lines:
        header = line.startswith("diff --git") or (header and not line.startswith("@@"))
        if header:  # an added line that reads "++x" is "+++x": styled as the code it is, not a file's name
            cls = "d-file"
        elif line.startswith("+"):
            cls = "d-add"
        elif line.startswith("-"):
            cls = "d-del"
        elif line.startswith("@@"):
            cls = "d-hunk"
        else:
            cls = ""
        styled.append((cls, line))
    return styled, cut


def _checks(history: History, r: RoundRecord) -> tuple[list[dict] | None, str]:
    """The judge's checks stored with the commit, or why there are none."""
    if r.commit is None:
        return None, "no judge evidence: the round failed before anything was committed"
    judge = history.judge_report(r.commit)
    if judge is None:
        if r.verdict == "accepted":
            return None, (
                "no judge evidence recorded: this run was made before accepted rounds kept the judge's "
                "report (.vibetrain/judge.json) with their commit"
            )
        return None, f"no judge evidence recorded in commit {r.commit[:10]}"
    checks = [
        {
            "name": c["name"],
            "passed": c["passed"],
            # a run recorded before reasons were escaped as they were made still shows them safe
            "reasons": printable("; ".join(c.get("reasons", []))) or "-",
            "details": printable(", ".join(f"{k}={detail(v)}" for k, v in c.get("details", {}).items())) or "-",
        }
        for c in judge["checks"]
    ]
    return checks, "the judge recorded no checks" if not checks else ""


def _row(
    r: RoundRecord,
    state: RunState,
    history: History,
    spec: TargetSpec,
    run_path: str,
    timeline: str | None,
    no_timeline: str,
) -> dict:
    metric = spec.headline_metric.name
    kind = _kind(r)
    verdict_text = {
        "promoted": "accepted, promoted",
        "accepted": "accepted, not promoted",
        "rejected": "rejected by the judge",
        "prescreened": "screened out by the twin",
        "error": "error",
    }[kind]
    if r.round == state.best_round:
        verdict_text += " (current best)"
    checks, no_checks = _checks(history, r)
    diff, diff_stat, diff_cut = None, "", ""
    if r.commit is not None:
        diff_stat = history.stack_diff(r.commit, stat=True)
        diff, diff_cut = _diff_lines(history.stack_diff(r.commit), run_path, r.commit)
    spread = r.spread.get(metric)
    return {
        "round": r.round,
        "title": r.task.title,
        "task_id": r.task.id,
        "source": r.task.source,
        "rationale": r.task.rationale,
        "kind": kind,
        "verdict_text": verdict_text,
        "headline": _num(r.headline),
        "spread": _num(spread) if r.headline is not None else "-",
        "paired": paired_cell(r.paired),
        "parent": r.parent_round if r.parent_round is not None else "-",
        "parent_commit": r.parent_commit[:10],
        "commit": r.commit,
        "short": (r.commit or "-")[:10],
        "account": r.account,
        "attempts": r.attempts,
        "promotion": promotion(r, spec.noise_threshold) if r.verdict == "accepted" else "",
        "prediction": twin_said(r) if r.prediction else "",
        "reasons": r.reasons,
        "hints": [h.said for h in r.hints],
        "metrics": [
            {"name": k, "value": _num(v), "spread": _num(r.spread.get(k)), "unit": _unit(k)}
            for k, v in r.metrics.items()
        ],
        "checks": checks,
        "no_checks": no_checks,
        "diff": diff,
        "diff_stat": diff_stat,
        "diff_cut": diff_cut,
        "timeline": timeline,
        "no_timeline": no_timeline,
        "profile": r.profile,
        "open": r.round == state.best_round,
    }


def _when(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def _unseen(state) -> list[tuple[str, str, str]] | None:
    """The best over the starter where the search never looked (held-out seeds, a perturbed workload)
    beside its in-search figure, as ``log`` shows it: (where, ratio with its interval, pairs)."""
    g = best_generalization(state)
    if g is None:
        return None
    perturbed = f"held-out seeds, {g.perturbation}" if g.perturbed else f"perturbed: not run ({g.not_perturbed})"
    rows = []
    for label, figure in (
        (f"round {g.best_round}'s seeds (in search)", g.in_search),
        ("held-out seeds", g.held_out),
        (perturbed, g.perturbed),
    ):
        if figure is None:
            rows.append((label, "-", "-"))
            continue
        rows.append((label, f"{figure.ratio:.2f}x {interval_of(figure)}", str(figure.pairs)))
    return rows


def write_report(run_dir: Path, path: Path) -> Path:
    state, history = RunState.load(run_dir), History.open(run_dir)
    spec, spec_said = run_spec(run_dir, state)
    metric, unit, threshold = spec.headline_metric.name, _unit(spec.headline_metric.name), spec.noise_threshold
    devices = spec.hardware.device_ids()
    maximize = spec.headline_metric.direction == "maximize"
    run, run_path = RunDir(run_dir), str(run_dir.resolve())
    best = state.best
    config = state.config
    with tempfile.TemporaryDirectory(prefix="vibetrain-report-") as scratch:
        rows, panels, baselines = [], [], _baselines(state, history, maximize)
        for r in state.rounds:  # one trace in memory at a time, bar the baselines' few
            timeline, no_timeline = None, ""
            if r.verdict == "accepted" and run.trace(r.round).exists():
                events = Trace.load_events(run.trace(r.round))
                title = f"round {r.round}: {metric} {r.headline:.3g} {unit}"
                timeline = _timeline_png([(title, events, devices)], Path(scratch), f"round-{r.round}")
                if r.round in baselines:
                    title = f"round {r.round}, {baselines[r.round]}: {metric} {r.headline:.3g} {unit}"
                    panels.append((title, events, devices))
            elif r.verdict == "accepted":
                no_timeline = f"no trace kept for this round ({run.trace(r.round)} is missing)"
            else:
                no_timeline = "no timeline: only accepted rounds are measured and keep a trace"
            rows.append(_row(r, state, history, spec, run_path, timeline, no_timeline))
        timeline = _timeline_png(panels, Path(scratch), "baselines") if panels else None
    run_facts = [
        ("directory", run_path),
        ("target", f"{spec.id} ({config.target})"),
        ("spec sha256", f"{spec_hash(spec)[:16]}\u2026 ({spec_said})"),
        ("execution", "simulated (cluster simulator)" if config.simulated else "real"),
        ("sandbox", config.sandbox),
        ("search", f"{config.policy} policy, {config.agents} agents, seed {config.seed}"),
        ("repeats", f"{config.repeat} measured pair(s) per candidate, up to {config.max_attempts} attempt(s)"),
        ("noise threshold", f"{threshold:.0%} ({spec.headline_metric.direction} {metric})"),
        ("started", _when(state.created_at) if state.created_at else "not recorded"),
        ("time used", f"{state.seconds_used / 60:.1f} min"),
        ("best", f"round {best.round}, commit {best.commit}" if best else "none yet"),
    ]
    if state.llm_used:
        run_facts.append(("LLM use", ", ".join(f"{k} {_num(v)}" for k, v in state.llm_used.items())))
    found = versions()
    page_facts = [
        ("generated", _when(datetime.datetime.now().timestamp())),
        ("host", platform.node()),
        ("vibetrain commit", source_commit()),
        *((name, version) for name, version in found.items()),
    ]
    html = TEMPLATE.render(
        name=run_dir.resolve().name,
        run_path=run_path,
        target=spec.id,
        rows=rows,
        rounds=state.rounds,
        accepted=len(state.accepted()),
        best={"round": best.round, "value": _num(best.headline)} if best else None,
        ratio=best_over_starter(state, spec.headline_metric),
        unseen=_unseen(state),
        metric=metric,
        unit=unit,
        threshold=f"{threshold:.0%}",
        repeat=config.repeat,
        simulated=config.simulated,
        run_facts=run_facts,
        page_facts=page_facts,
        per_round=_per_round(state, metric, threshold, maximize) if state.rounds else None,
        tree=_tree(state, metric) if state.rounds else None,
        no_spread=[r.round for r in state.accepted() if metric not in r.spread],
        timeline=timeline,
    )
    path.write_text(html)
    return path
