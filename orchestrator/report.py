"""``vibetrain report RUN``: one static HTML page a reviewer can open offline — the headline metric
per round, the search tree (each candidate drawn from its parent, at its measured metric), the
per-device timeline of the best candidate against the baselines the run measured (round 0's
starter and the best candidate of each other controller), and the table of rounds."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import jinja2
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from orchestrator.history import History  # noqa: E402
from orchestrator.run_dir import RunDir  # noqa: E402
from orchestrator.state import RunState  # noqa: E402
from targets.harness.timeline import plot_timelines  # noqa: E402
from targets.harness.trace import Trace  # noqa: E402
from targets.spec import load_target  # noqa: E402

TEMPLATE = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=True).from_string("""<!doctype html>
<html><head><meta charset="utf-8"><title>vibetrain run {{ name }}</title>
<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto;color:#222}
table{border-collapse:collapse;font-size:14px}td,th{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left}
.accepted{color:#2e7d32}.rejected{color:#c62828}.error{color:#ef6c00}img{max-width:100%}</style></head>
<body><h1>vibetrain run {{ name }}</h1>
<p>target <b>{{ target }}</b>; {{ policy }} policy, {{ agents }} agents, seed {{ seed }}; {{ rounds|length }} rounds,
{{ accepted }} validated; best: round {{ best_round }} with {{ metric }} {{ best_value }} ({{ ratio }} the starter).</p>
<h2>{{ metric }} per round</h2><img src="data:image/png;base64,{{ per_round }}">
<h2>Search tree</h2><p>Each candidate is drawn from the candidate it was derived from; rejected attempts are red crosses.</p>
<img src="data:image/png;base64,{{ tree }}">
{% if timeline %}<h2>Per-device timeline: best vs baselines</h2><img src="data:image/png;base64,{{ timeline }}">{% endif %}
<h2>Rounds</h2><table><tr><th>round</th><th>task</th><th>verdict</th><th>{{ metric }}</th><th>parent</th><th>commit</th><th>reasons / hints</th></tr>
{% for r in rounds %}<tr><td>{{ r.round }}</td><td>{{ r.task.title }}</td><td class="{{ r.verdict }}">{{ r.verdict }}{% if r.round == best_round %} (best){% endif %}</td>
<td>{{ r.headline_text }}</td><td>{{ r.parent_round if r.parent_round is not none else "-" }}</td><td><code>{{ (r.commit or "-")[:10] }}</code></td><td>{{ r.detail }}</td></tr>
{% endfor %}</table></body></html>
""")


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def _per_round(state: RunState, metric: str) -> str:
    fig, ax = plt.subplots(figsize=(9, 3.5))
    accepted = [r for r in state.rounds if r.headline is not None]
    ax.plot([r.round for r in accepted], [r.headline for r in accepted], "o", color="#2e7d32", label="validated")
    best, line = None, []
    for r in state.rounds:
        if r.became_best:
            best = r.headline
        line.append(best)
    ax.step([r.round for r in state.rounds], line, where="post", color="#1f77b4", label="best so far")
    for r in state.rounds:
        if r.verdict != "accepted" and r.parent_headline is not None:
            ax.plot(r.round, r.parent_headline, "x", color="#c62828", markersize=9)
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.legend(loc="best", fontsize=8)
    return _png(fig)


def _tree(state: RunState, metric: str) -> str:
    fig, ax = plt.subplots(figsize=(9, 4))
    by_round = {r.round: r for r in state.rounds}
    for r in state.rounds:
        y = r.headline if r.headline is not None else r.parent_headline
        parent = by_round.get(r.parent_round) if r.parent_round is not None else None
        if parent is not None and parent.headline is not None and y is not None:
            ax.plot([parent.round, r.round], [parent.headline, y], "-", color="#999", linewidth=1)
        if y is None:
            continue
        if r.verdict == "accepted":
            ax.plot(
                r.round,
                y,
                "o",
                color="#1f77b4" if r.round == state.best_round else "#2e7d32",
                markersize=9 if r.round == state.best_round else 6,
            )
            ax.annotate(r.task.id, (r.round, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        else:
            ax.plot(r.round, y, "x", color="#c62828", markersize=9)
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    return _png(fig)


def _timeline(run_dir: Path, state: RunState, devices: list[str], history: History) -> str | None:
    run = RunDir(run_dir)
    chosen: dict[int, str] = {}
    if state.best_round is not None:
        chosen[state.best_round] = "best"
    controllers: dict[str, tuple[float, int]] = {}
    for r in state.accepted():
        controller = history.params(r.commit)["controller"]
        if r.round == 0:
            chosen.setdefault(0, f"starter ({controller})")
        elif controller not in controllers or r.headline > controllers[controller][0]:
            controllers[controller] = (r.headline, r.round)
    for controller, (_, number) in controllers.items():
        chosen.setdefault(number, f"best {controller}")
    panels = []
    for number, label in sorted(chosen.items()):
        path = run.trace(number)
        if path.exists():
            record = state.record(number)
            panels.append((f"round {number}, {label}: {record.headline:.3g}", Trace.load_events(path), devices))
    if not panels:
        return None
    png = RunDir(run_dir).timeline_png
    plot_timelines(panels, png)
    return base64.b64encode(png.read_bytes()).decode()


def write_report(run_dir: Path, path: Path) -> Path:
    state, history = RunState.load(run_dir), History.open(run_dir)
    spec = load_target(state.config.target)
    metric = spec.headline_metric.name
    devices = [f"{spec.hardware.kind}:{i}" for i in range(spec.hardware.count)]
    best, starter = state.best, state.record(0)
    rows = []
    for r in state.rounds:
        detail = "; ".join(r.reasons[:2]) if r.verdict != "accepted" else "; ".join(h["message"] for h in r.hints)
        rows.append(
            {
                **r.model_dump(),
                "task": r.task,
                "headline_text": f"{r.headline:.4g}" if r.headline is not None else "-",
                "detail": detail or "-",
            }
        )
    html = TEMPLATE.render(
        name=run_dir.name,
        target=spec.id,
        policy=state.config.policy,
        agents=state.config.agents,
        seed=state.config.seed,
        rounds=rows,
        accepted=len(state.accepted()),
        best_round=state.best_round,
        metric=metric,
        best_value=f"{best.headline:.4g}" if best else "-",
        ratio=f"{best.headline / starter.headline:.2f}x" if best and starter and starter.headline else "n/a",
        per_round=_per_round(state, metric),
        tree=_tree(state, metric),
        timeline=_timeline(run_dir, state, devices, history),
    )
    path.write_text(html)
    return path
