"""The tables the commands print: checks, the benchmark and its mechanism costs, the live view of
``generate``, and a run's rounds. Building them here keeps the ``cli`` package to the commands themselves."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from targets.harness.measure.session import Paired
from targets.printable import printable
from targets.spec import TargetSpec
from targets.spec.target import HEADLINE_METRICS, HeadlineMetric

TOKENS = "trained_tokens_per_s"  # the second figure beside a headline: trained response tokens a second

if TYPE_CHECKING:
    from orchestrator.state import Generalization, GeneralizationRejected, Promotion


def checks_table(results) -> Table:
    table = Table(title="checks")
    for column in ("check", "verdict", "reasons"):
        table.add_column(column, overflow="fold")
    for r in results:
        reasons = Text(printable("\n".join(r.reasons)) or "-")  # a candidate's error text: no markup, no escapes
        table.add_row(Text(r.name), "[green]pass[/green]" if r.passed else "[red]FAIL[/red]", reasons)
    return table


DIFF_LINES = 400  # of a round's diff shown to a person (report, show); the rest by the command printed


def cut_diff(diff: str, run: str, commit: str) -> tuple[list[str], str]:
    """A round's diff as a person is shown it: its first ``DIFF_LINES`` lines, and where it was cut, what
    is said under it (how much, and the command that shows it whole; else ""). Lines end at newlines only
    (``splitlines`` also breaks at a form feed, which Python reads as a space: an added statement's second half
    was shown as unchanged code), each ``printable`` (a file's escape sequences redrew the screen above it)."""
    lines = diff.removesuffix("\n").split("\n") if diff else []
    shown = [printable(line) for line in lines[:DIFF_LINES]]
    if len(lines) <= DIFF_LINES:
        return shown, ""
    return shown, (
        f"The diff is cut at {DIFF_LINES} of its {len(lines)} lines; the whole of it: "
        f"git -C {run} show {commit[:10]} -- . ':(exclude).vibetrain'"
    )


def num(value: float) -> str:
    """Three significant figures without exponents (0.721, 42.5, 2523)."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def bench_table(spec: TargetSpec, runs, repeat: int, simulated: bool) -> Table:
    first = runs[0]
    clock = "simulated seconds" if simulated else "wall seconds"
    headline = spec.headline_metric.name
    title = f"{spec.id}: median of {repeat} (its spread: max - min), {clock}"
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1))
    # on a narrow terminal the schedule's name and the ratio's interval wrap, at their spaces or anywhere in a
    # name: no column is ever cut with "…" (a number cut short reads as another number)
    table.add_column("schedule", overflow="fold")
    for column in (headline, "ratio [95% CI]", "tokens", "traj/s", "step s", "LB", "timeouts", "busy"):
        table.add_column(column, justify="right", no_wrap=column != "ratio [95% CI]", overflow="fold")
    for run in runs:
        m = run.median
        tokens = Paired.ratio_of(*([r[TOKENS] for r in of.repeats] for of in (run, first)))  # None: 0 trained
        if run.paired is None:
            ratio = "1.00x"
        else:
            ratio = f"{run.paired.ratio:.2f}x {interval_of(run.paired)}"
        table.add_row(
            run.name,
            f"{num(m(headline))} ({num(run.spread(headline))})",  # not "±": the spread is the whole range
            ratio,
            "-" if tokens is None else f"{tokens:.2f}x",
            num(m("rollout_throughput")),
            num(m("step_time_s")),
            f"{m('lower_bound_fraction'):.0%}",
            f"{m('timeout_ratio'):.0%}",
            f"{m('mean_device_busy'):.0%}",
        )
    table.caption = (
        f"{headline}: {HEADLINE_METRICS[headline]}; ratio: {headline} over {first.name}'s, paired by seed; tokens: "
        f"the response tokens of the trajectories trained a second over {first.name}'s, paired (below a goodput "
        "ratio: shorter trajectories trained); traj/s: rollout throughput; LB: the step's fluid lower bound over "
        "its step time"
    )
    return table


def phases_table(runs) -> Table:
    """Where a step's time went beside what each phase needs at least (``sim/lower_bound.py``): the
    gap to the bound, phase by phase."""
    table = Table(title="where a step goes (seconds per step, mean over devices; median run)", box=box.SIMPLE_HEAD)
    table.add_column("schedule", overflow="fold")
    for column in ("rollout (work)", "train (work)", "sync", "switch", "idle", "step", "bound"):
        table.add_column(column, justify="right", no_wrap=True)
    for run in runs:
        m = run.median
        path_bound = m("critical_path_bound_s") > m("work_bound_s")
        table.add_row(
            run.name,
            f"{num(m('step_rollout_s'))} ({num(m('rollout_bound_s'))})",
            f"{num(m('step_train_s'))} ({num(m('train_bound_s'))})",
            num(m("step_sync_s")),
            num(m("step_switching_s")),
            num(m("step_idle_s")),
            num(m("step_time_s")),
            f"{num(m('lower_bound_step_s'))} {'path' if path_bound else 'work'}",
        )
    table.caption = (
        "(work): the phase's work spread over every device, its least time; sync, switching and idle need none. "
        "bound: the larger of the work (rollout + train) and the critical path (the longest trajectories alone)"
    )
    return table


def costs_table(runs, simulated: bool) -> Table:
    memory = ("peak KV", "peak_kv_fraction", "{:.0%}") if simulated else ("peak MB", "peak_process_memory_mb", "{:.0f}")
    costs = Table(title=f"mechanism costs (median seconds per event; {memory[0]})", box=box.SIMPLE_HEAD)
    costs.add_column("schedule", overflow="fold")
    gpu = any(run.has("peak_device_memory_mb") for run in runs)
    decoding = ["decode batch", "decoding"] if simulated else []  # the simulator's engines: their batches' fill
    for column in (
        "shrink",
        "expand",
        "sync",
        "train",
        "aborted turns",
        *decoding,
        memory[0],
        *(["peak GPU MB"] if gpu else []),
    ):
        costs.add_column(column, justify="right", no_wrap=True)
    for run in runs:
        m = run.median
        peak = memory[2].format(m(memory[1])) if run.has(memory[1]) else "-"
        device = [f"{m('peak_device_memory_mb'):.0f}" if run.has("peak_device_memory_mb") else "-"] if gpu else []
        fill = [f"{m('decode_batch'):.1f}", f"{m('decode_share'):.0%}"] if run.has("decode_batch") else ["-", "-"]
        fill = fill if simulated else []
        costs.add_row(
            run.name,
            f"{m('shrink_s'):.3f}",
            f"{m('expand_s'):.3f}",
            f"{m('sync_s'):.3f}",
            f"{m('train_s'):.3f}",
            f"{m('aborted_turns'):.0f}",
            *fill,
            peak,
            *device,
        )
    if simulated:
        costs.caption = (
            "decode batch: the sequences an engine decoded at once, its decoding time's mean; "
            "decoding: the share of the devices' time their engines spent decoding"
        )
    return costs


def one_seed(paired) -> bool:
    """A simulated pair on one seed: its ratio is exact there (no measurement noise), and its "interval" a
    point that says nothing of other seeds; shown as such, not as [x, x]."""
    return paired.pairs == 1 and paired.high is not None and paired.low == paired.high


def interval_of(paired, percent: str = "") -> str:
    """A ratio's interval as the tables print it ('[1.06, 1.52]', or with ``percent`` a format such as
    '.1%' the gains '[+6.0%, +52.0%]'), or what it is where it is none: one simulated seed (exact there), a
    headline of zero or infinity, one real pair (no noise measured)."""
    if one_seed(paired):
        return "[1 seed]"
    if paired.high is None:
        finite = math.isfinite(paired.ratio) and paired.ratio > 0
        return "[unbounded: 1 pair]" if finite else "[none: a headline was 0 or infinite]"
    if percent:
        return f"[{paired.low - 1:+{percent}}, {paired.high - 1:+{percent}}]"
    return f"[{paired.low:.2f}, {paired.high:.2f}]"


def paired_cell(paired: Promotion | None) -> str:
    """'+36% [+6%, +76%] of 0.52': the candidate over the best, paired by seed, with its 95% interval and
    the best's headline on those seeds (the best column's figure is from the best's own round's seeds)."""
    if paired is None:
        return "-"
    return f"{paired.ratio - 1:+.0%} {interval_of(paired, '.0%')}{_of_the_best_there(paired)}"


def _of_the_best_there(paired: Promotion) -> str:
    """' of 0.52': the best's headline on the pairs' seeds, where the pair kept it (older records did not)."""
    return f" of {num(paired.baseline_median)}" if paired.baseline_median is not None else ""


def took(seconds: float) -> str:
    """A round's wall time as a person reads it: ``48 s``, ``4 min 12 s``, ``1 h 03 min``."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


class RoundsView:
    """The live display of ``vibetrain generate``: one row per finished round, the current one below."""

    def __init__(self, spec: TargetSpec) -> None:
        self.spec, self.rows, self.status = spec, [], "starting"

    def render(self) -> Table:
        metric = self.spec.headline_metric.name
        table = Table(title=f"vibetrain generate {self.spec.id}", box=box.SIMPLE_HEAD, caption=self.status)
        for column in ("round", "task", "verdict", metric, "vs best, paired [95%]", "best", "took"):
            right = column in ("round", metric, "took")
            table.add_column(column, overflow="fold", justify="right" if right else "left")
        for row in self.rows[-15:]:
            table.add_row(*row)
        return table

    def line(self, kind: str) -> str:
        """What the last event changed, as one line: for a pipe or a file, where nothing redraws."""
        if kind == "round_end":
            return "round " + "  ".join(self.rows[-1])
        return self.status

    def event(self, kind: str, **data) -> None:
        if kind == "setup":
            self.status = f"sandbox: {data['sandbox']}; {'simulated' if data['simulated'] else 'real'} execution"
        elif kind == "round_start":
            parent = "the run's start" if data["parent"] is None else f"round {data['parent']}"
            self.status = f"round {data['round']}: {escape(data['task'].title)} (from {parent})"
        elif kind == "verdict":
            reasons = "; ".join(escape(r) for r in data["reasons"][:2])
            if not data["passed"] and all(r.startswith("twin_prescreen") for r in data["reasons"]):
                said = f"screened out by the twin, not judged: {reasons}"  # the twin ran; it did not fail
            else:
                said = "judge passed" if data["passed"] else f"judge failed: {reasons}"
            self.status = f"round {data['round']} attempt {data['attempt']}: {said}"
        elif kind == "round_end":
            r, best = data["record"], data["best"]
            colour = {"accepted": "green", "rejected": "red", "prescreened": "magenta"}.get(r.verdict, "yellow")
            value = num(r.headline) if r.headline is not None else "-"
            self.rows.append(
                (
                    str(r.round),
                    escape(r.task.title),  # an agent's title may hold brackets
                    f"[{colour}]{r.verdict}[/{colour}]" + (" *" if r.became_best else ""),
                    value,
                    escape(paired_cell(r.paired)),  # rich would take '[unbounded]' for a style
                    f"round {best.round}: {num(best.headline)}" if best else "-",
                    took(r.seconds),
                )
            )
        elif kind == "twin":
            self.status = f"twin calibrated to the traces of rounds {data['rounds']}: {data['path']}"
        elif kind == "prescreen":
            p = data["prediction"]
            verdict = "goes on to the judge" if p.passed else "screened out"
            if p.untrusted is not None:  # a cost only guessed, or the engines' word alone against it
                verdict = f"not trusted, goes on to the judge ({escape(p.untrusted)})"
            predicted = f"the twin predicts {num(p.headline)} against {num(p.best)} for the best (simulated)"
            self.status = f"round {data['round']}: {predicted}: {verdict}"
        elif kind == "generalize":
            doing = f": {data['run']}" if data["run"] else ""
            self.status = (
                f"the best (round {data['round']}) over the starter, where the search never looked: "
                f"run {data['done']} of {data['runs']}{doing}"
            )
        elif kind in ("budget", "recovered"):
            self.status = escape(data.get("reason") or f"recovered round {data['round']} from git")


def promotion(record, threshold: float | None = None) -> str:
    """Why the candidate did or did not become best: the paired ratio against the best, its
    interval, and the rule it had to clear (the spec's noise threshold, stored with the pair; for
    records older than that, ``threshold`` when the caller knows it)."""
    if record.paired is None:
        return "promoted: the first validated candidate" if record.became_best else "not measured against the best"
    threshold = record.paired.threshold if record.paired.threshold is not None else threshold
    paired = record.paired.paired()
    verb = "promoted" if record.became_best else "not promoted"
    look = paired.look_bound
    bound = "the interval's low end" if look is None else f"its bound for the look ({look - 1:+.1%})"
    rule = f"; promotion needs {bound} above +{threshold:.0%}" if threshold is not None else ""
    beside = paired.baseline_median
    best = f" (the best: {num(beside)} on the same seeds)" if beside is not None else ""
    return f"{verb}: {paired.describe()} against the best{best}{rule}"


def promotion_short(record) -> str:
    """The table's form of ``promotion``: 'not promoted: +2.4% [-3.0%, +8.0%] of 0.52, needs low > +5%'
    (0.52: the best's headline on the pairs' seeds)."""
    if record.paired is None:
        return promotion(record)
    p, threshold = record.paired, record.paired.threshold
    look = p.paired().look_bound  # a look of a sequential comparison: its own bound
    needs = "low" if look is None else f"bound {look - 1:+.1%}"
    rule = f", needs {needs} > +{threshold:.0%}" if threshold is not None else ""
    verb = "promoted" if record.became_best else "not promoted"
    return f"{verb}: {p.ratio - 1:+.1%} {interval_of(p, '.1%')}{_of_the_best_there(p)}{rule}"


def _of_the_best(state, measured):
    """``measured`` if it was made of the run's current best (a later best has none of its own)."""
    best = state.best
    return measured if measured is not None and best is not None and measured.best_commit == best.commit else None


def best_generalization(state) -> Generalization | None:
    """The run's generalization measurement, if it measured the current best."""
    return _of_the_best(state, state.generalization)


def best_rejected_unseen(state) -> GeneralizationRejected | None:
    """Why the current best has no figure where the search never looked: a run there failed the judge."""
    return _of_the_best(state, state.generalization_rejected)


def best_over_starter(state, metric: HeadlineMetric) -> str:
    """'1.52x [1.21, 1.90] the starter on held-out seeds (paired); 1.96x on its round's seeds, where it was
    chosen' where the best was measured beside the starter (a generalization: the held-out figure first, as
    the one its selection did not inflate); else the two headlines' ratio, each on its own round's seeds.
    '' without both.
    Beside a headline other than trained tokens, the ratio in trained tokens too: a best that trains
    shorter trajectories than the starter counts more trajectories, not more training. Where a run of
    the best's measurement beyond its seeds failed the judge, that too. Every ratio reads the same way
    whatever the headline's direction: above 1, the best is better (a time to minimize is inverted)."""
    rejected = best_rejected_unseen(state)
    ratio = _best_over_starter(state, metric)
    if rejected is None:
        return ratio
    return f"{ratio}; where the search never looked, {rejected.said()}" if ratio else rejected.said()


def _best_over_starter(state, metric: HeadlineMetric) -> str:
    best, starter, headline = state.best, state.record(0), metric.name
    g = best_generalization(state)
    if g is not None:  # held-out seeds first: its own round's seeds are the ones it was chosen on (winner's curse)
        held_out = g.held_out
        tokens = "" if headline == TOKENS or "held-out" not in g.tokens else f", {g.tokens['held-out']:.2f}x"
        tokens += " in trained tokens" if tokens else ""
        return (
            f"{held_out.ratio:.2f}x {interval_of(held_out)} the starter{tokens} on held-out seeds (paired); "
            f"{g.in_search.ratio:.2f}x on its round's seeds, where it was chosen"
        )
    if best is None or starter is None or not starter.headline:
        return ""
    tokens = ""
    if headline != TOKENS and best.metrics.get(TOKENS) and starter.metrics.get(TOKENS):
        tokens = f", {best.metrics[TOKENS] / starter.metrics[TOKENS]:.2f}x in trained tokens"
    if metric.direction == "maximize":
        return f"{best.headline / starter.headline:.2f}x the starter's{tokens} (each on its own round's seeds)"
    if not best.headline:
        return ""
    inverted = f"{headline} to minimize: the starter's over the best's"
    return f"{starter.headline / best.headline:.2f}x the starter's{tokens} (each on its own round's seeds; {inverted})"


def generalization_table(g: Generalization) -> Table:
    """The best over the starter where the search never looked, beside its in-search figure: a
    candidate tuned to the search's seeds or to this one workload shows up as a gap. Beside each, the
    best's own share of the step's lower bound, which the starter's fortunes on a workload do not move."""
    table = Table(title=f"the best (round {g.best_round}) over the starter, paired by seed", box=box.SIMPLE_HEAD)
    table.add_column(f"best (round {g.best_round}) / starter, measured on", overflow="fold")  # the one that wraps
    for column in ("ratio [95% CI]", "in tokens", "pairs", "of in-search", "of its bound"):
        table.add_column(column, justify="right", no_wrap=True, min_width=len(column))
    perturbed = f"held out, {g.perturbation}" if g.perturbed else f"not perturbed: {g.not_perturbed}"
    rows = [
        (f"round {g.best_round}'s seeds (in search)", "in-search", g.in_search),
        ("held-out seeds", "held-out", g.held_out),
        (perturbed, "perturbed", g.perturbed),
    ]
    for label, name, figure in rows:
        if figure is None:
            table.add_row(escape(label), "-", "-", "-", "-", "-")
            continue
        bound = f"{g.bound[name]:.0%}" if name in g.bound else "-"  # runs recorded before it was kept: none
        tokens = f"{g.tokens[name]:.2f}x" if name in g.tokens else "-"  # likewise
        kept = f"{g.kept(figure):.0%}"
        ratio = f"{figure.ratio:.2f}x {escape(interval_of(figure))}"  # one simulated seed: no interval
        table.add_row(escape(label), ratio, tokens, str(figure.pairs), kept, bound)
    table.caption = (
        "in tokens: the best's trained response tokens per second over the starter's, paired by seed; below the "
        "ratio, the best trained shorter trajectories than the starter on the same seeds. of in-search: the "
        "ratio as a share of the in-search one. of its bound: the step's lower bound as a share of the best's "
        "step (100% would be the bound itself)"
    )
    return table


def rounds_table(run: Path, state) -> Table:
    """A run's rounds: verdict, metric, delta vs parent, commit, and under each task why it ended as
    it did (the judge's reasons, or the promotion rule and hints). Narrow columns hold only short
    tokens, so at 80 columns words wrap whole in the one wide column."""
    metric = state.spec_at_start.get("headline_metric", {}).get("name")  # (a run started before it was kept: none)
    measures = f"headline: {metric}, {HEADLINE_METRICS[metric]}; " if metric in HEADLINE_METRICS else ""
    table = Table(
        title=escape(f"{run}: {state.config.target_id}, {state.config.policy} policy, {state.config.agents} agents"),
        caption=f"{measures}vs parent: each headline on its own round's seeds, + better; (not) promoted: paired with "
        "the best on the round's seeds, 'of' the best's headline there",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("round", justify="right", no_wrap=True)
    for column in ("verdict", "headline", "vs parent", "commit"):
        table.add_column(column, no_wrap=True)
    llm = any(r.llm for r in state.rounds)
    if llm:
        table.add_column("tokens in/out", no_wrap=True)
        table.add_column("cost $", no_wrap=True)
    table.add_column("task / why", overflow="fold")
    lower = state.spec_at_start.get("headline_metric", {}).get("direction") == "minimize"  # + is better, always
    for r in state.rounds:
        both = bool(r.headline and r.parent_headline)
        gain = (r.parent_headline / r.headline if lower else r.headline / r.parent_headline) if both else None
        delta = "-" if gain is None else f"{gain - 1:+.1%}"
        codes = [h.code + (" (LLM)" if h.by == "llm" else "") for h in r.hints]  # an LLM evaluator's, said so
        hints = f"hints: {', '.join(codes)}" if r.hints else ""  # the evaluator's, not a reason
        detail = "; ".join(r.reasons[:2]) if r.verdict != "accepted" else hints
        if r.verdict == "accepted" and r.round > 0:
            detail = "; ".join(part for part in (promotion_short(r), detail) if part)
        usage = (
            [f"{r.llm.get('input_tokens', 0)}/{r.llm.get('output_tokens', 0)}", f"{r.llm.get('cost_usd', 0.0):.4f}"]
            if llm
            else []
        )
        table.add_row(
            str(r.round),
            r.verdict + (" (best)" if r.round == state.best_round else ""),
            num(r.headline) if r.headline is not None else "-",
            delta,
            (r.commit or "-")[:8],
            *usage,
            Text(r.task.title).append(f"\n{detail}" if detail else "", style="dim"),
        )
    return table


def plain(table: Table) -> str:
    """The table as tab-separated lines, header first, for a pipe or a file: no box, no wrapping,
    no markup, so ``grep``, ``cut`` and ``sort`` see one whole row per line."""

    def cell(value) -> str:
        text = value.plain if isinstance(value, Text) else Text.from_markup(str(value)).plain
        return " | ".join(" ".join(line.split()) for line in text.splitlines() if line.strip())  # one row

    header = "\t".join(cell(column.header) for column in table.columns)
    rows = zip(*(list(column.cells) for column in table.columns), strict=True)
    return "\n".join([header, *("\t".join(cell(value) for value in row) for row in rows)]) + "\n"
