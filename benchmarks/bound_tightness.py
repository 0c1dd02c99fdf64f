"""Is the fluid lower bound loose because a fast critical path costs the engines their batch?

The fluid bound (``targets/harness/sim/lower_bound.py``) is the larger of two limits that no schedule
can both meet at once: the work at the batch the KV cache holds, and the longest trajectories decoded
alone (batch 1). On a mixture of experts the gap between the two batches is large (a token at
batch ~25 reads nearly every expert), so the question is whether the engines could afford to decode the
longest trajectories alone while doing the rest of the work. This script answers it for the trajectories
a run trained, with a bound that charges both at once (a Lagrangian relaxation; each step below only
lowers it, so it is a lower bound on the run's mean step time whatever the schedule):

* A decode iteration of ``b`` sequences on an engine of ``d`` devices and KV capacity ``K`` takes at least
  ``I(b, C_i)`` seconds (``CostModel.decode_iteration_s`` with draft length ``k``; a token of progress takes
  ``I / E_k``), ``C_i`` any one sequence's context (the others' keys and values counted as nothing), and at
  least its memory time ``R(b) + beta sum_j C_j`` (``R``: weights and step overhead; ``beta``: one context
  token's reads). Its ``d I`` device-seconds are shared out by a rule fixed in advance, on the batch alone:
  below a ``split`` batch equally (``I / b`` each), from it on in proportion to the contexts, which sum to
  at most ``K`` (at least ``R C_i / K + beta C_i`` each). ``I`` does not fall as ``b`` grows, so over a range
  ``lo <= b <= hi`` of batches a token is charged at least ``I(lo, C) / hi`` or ``R(lo) C / K + beta C``,
  over ``E_k``; ranges run to ``K - C + 1`` (each co-runner holds a token); ``C`` the turn's context when it
  starts, floored onto a grid (nothing falls as ``C`` grows). The choices (range, ``k``, engine option) are
  the schedule's, so each token takes the least charge.
* A trajectory trained at step ``k`` ran within steps ``k - a .. k`` (``lower_bound.py``), so its decode
  took at most ``W_k - F_i`` seconds, ``W_k`` those steps' time and ``F_i`` its prefills, requests and
  tool calls at their least. For any ``lambda >= 0`` the least device-seconds its decode can cost under
  that deadline is at least ``L_i(lambda) - lambda (W_k - F_i)``, with
  ``L_i(lambda) = sum over its tokens of min over batch ranges of (charge + lambda t)`` (weak duality).
* Give ``lambda`` to the ``m`` trajectories of each step with the longest alone-path, 0 to the rest;
  the engines' device-seconds (``D`` devices over the run's ``T``, training included; prefills not, since
  chunked they may take the compute a decode step leaves idle) must hold all of it, and
  ``sum_k W_k <= (1 + a) T``, so
  ``T >= (sum_top [L_i(lambda) + lambda F_i] + sum_rest L_i(0) + train) / (D + (1 + a) m lambda)``.
  The bound is the largest over ``split``, ``m`` and ``lambda`` (finite grids: each point is a bound),
  divided by the steps. Targets with a serving pool are refused (rollout may borrow devices beyond ``D``).

Where it comes out at the fluid bound, this relaxation sees no obstruction from the engines' capacity (a
fluid one: it does not see that engines are whole, nor that many long trajectories run at once). The
script also reports, for the 32 longest-lived trajectories of each step (creation to last turn), how much
longer they spent in generate than their prefills and decode alone, and how well the task's first turns
predict them.

    python benchmarks/bound_tightness.py [--target qwen3-235b-a22b-h800x160] [--params JSON] [--seeds 0,1,2]

``--params`` sets the time_multiplex starter's parameters (the techniques' knobs, as a stack's
``params.json`` holds them).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from skills.starter import write_starter
from targets.api import TraceEvent
from targets.harness.isolation.launch import Limits, run_harness
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.measure.metrics import compute_metrics
from targets.harness.sim.cost_model import MAX_DRAFT_TOKENS, ClusterCosts
from targets.harness.sim.lower_bound import TurnCosts, engine_options, step_lower_bound, trace_turns
from targets.harness.target import Target
from targets.harness.trace import Trace, token_count
from targets.spec import TargetSpec, load_target, resolve_target_path

BATCH_EDGES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 4096, 2**14, 2**16, 2**18)
LAMBDAS = np.concatenate([[0.0], np.geomspace(0.01, 1e4, 200)])  # device-seconds per second of a path
SPLITS = (*BATCH_EDGES, BATCH_EDGES[-1] + 1)  # below this batch an iteration is shared per sequence, else by context
TOPS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
INFEASIBLE = 1e30  # a batch range the KV cache cannot hold at that context


def token_charges(pools: list, contexts: np.ndarray, split: int) -> tuple[np.ndarray, np.ndarray]:
    """(seconds, device-seconds) of a token decoded at each context (rows) in each batch range, draft length
    and engine option (columns), at their least (module docstring); INFEASIBLE where the cache cannot hold it."""
    columns = [(cost, j, k) for cost in pools for j in range(len(BATCH_EDGES)) for k in range(MAX_DRAFT_TOKENS + 1)]
    seconds = np.full((len(contexts), len(columns)), INFEASIBLE)
    device_seconds = np.full_like(seconds, INFEASIBLE)
    for row, context in enumerate(contexts):
        for column, (cost, j, k) in enumerate(columns):
            most = cost.kv_capacity_tokens - int(context) + 1  # the largest batch beside a context this long
            low = BATCH_EDGES[j]
            if low > most or (k and cost.draft_acceptance <= 0):
                continue
            high = min(BATCH_EDGES[j + 1] - 1, most) if j + 1 < len(BATCH_EDGES) else most
            gained = cost.tokens_per_step(k)
            iteration = cost.decode_iteration_s(low, context, k + 1)  # the others' keys and values left out
            # the iteration's memory time alone, split by context: its weights, plus each context's own reads
            reads = cost.decode_bytes(low * (k + 1), 0) / cost.read_bytes_per_s + cost.decode_step_overhead_s
            by_context = (reads + cost.tensor_parallel_s(low * (k + 1))) * context / cost.kv_capacity_tokens
            by_context += context * cost.kv_bytes_per_token / cost.read_bytes_per_s
            share = iteration / high if low < split else by_context
            seconds[row, column] = iteration / gained
            device_seconds[row, column] = cost.engine_devices * share / gained
    return seconds, device_seconds


def dual_bound(spec: TargetSpec, costs: ClusterCosts, events: list[TraceEvent]) -> tuple[float, int, float, int]:
    """(the bound on the mean step in seconds, its ``m``, ``lambda`` and split batch) as the module's docstring
    derives it; zeros for a run that trained nothing."""
    if spec.hardware.serving_device_ids():
        raise ValueError(
            f"{spec.id} has a serving pool, whose devices rollout may borrow: the bound counts {spec.id}'s own"
        )
    turns = trace_turns(events)
    trains = [e for e in events if e.kind == "train"]
    if not trains:
        return 0.0, 0, 0.0, 0
    devices = len(next(e for e in events if e.kind == "run_start").data["devices"])
    stretch = 1 + spec.workload.staleness_limit
    pools = engine_options(spec, costs)
    grid = np.unique(np.concatenate([[0], np.floor(np.geomspace(1, 2**20, 160))]))  # contexts, floored onto it
    # training device-seconds (prefills left out: chunked, they may run in the compute decode leaves idle);
    # per step, its turns' tokens by context and their fixed seconds
    other, steps = 0.0, []
    for train in trains:
        episodes = [t["episode"] for t in train.data["trajectories"]]
        lengths = [token_count(t["tokens"]) for t in train.data["trajectories"]]
        other += min(c.train_s(lengths, 1, overhead=False) for c in pools)
        tokens_at = np.zeros((len(episodes), len(grid)))  # response tokens by context bucket
        fixed = np.zeros(len(episodes))
        for i, episode in enumerate(episodes):
            for context, new, response, latency in turns.get(episode, []):
                tokens_at[i, np.searchsorted(grid, context, side="right") - 1] += response
                fixed[i] += min(c.prefill_s(new, context - new) for c in pools)
                fixed[i] += costs.shared.request_overhead_s + latency
        steps.append((tokens_at, fixed))
    best = (0.0, 0, 0.0, 0)
    for split in SPLITS:
        seconds, device_seconds = token_charges(pools, grid, split)
        if any((tokens_at[:, seconds.min(axis=1) >= INFEASIBLE] > 0).any() for tokens_at, _ in steps):
            raise ValueError(
                "a turn's context leaves no room for a batch of one: the trace and the cost model disagree"
            )
        per_token = np.min(device_seconds[:, :, None] + LAMBDAS[None, None, :] * seconds[:, :, None], axis=1)
        ranked = []
        for tokens_at, fixed in steps:
            order = np.argsort(-(tokens_at @ seconds.min(axis=1) + fixed))  # longest alone-path first
            lagrangian = tokens_at @ per_token + LAMBDAS[None, :] * fixed[:, None]
            ranked.append((lagrangian[order], (tokens_at @ per_token[:, 0])[order]))
        for top in (m for m in TOPS if m <= min(len(free) for _, free in ranked)):
            held = other + sum(lag[:top].sum(axis=0) + free[top:].sum() for lag, free in ranked)
            bound = held / (devices + stretch * top * LAMBDAS) / len(steps)
            j = int(np.argmax(bound))
            if bound[j] > best[0]:
                best = (float(bound[j]), top, float(LAMBDAS[j]), split)
    return best


def longest_lived(spec: TargetSpec, costs: ClusterCosts, events: list[TraceEvent], count: int = 32) -> dict:
    """For the ``count`` trajectories of each step that lived longest (creation to last turn): their time in
    generate over their prefills and decode alone (median), the share of their alone-path (tool calls and
    requests included) that those take, and the share of them among the ``4 count`` whose tasks answered
    longest in their first three turns (what a scheduler could know early; by chance ``4 count`` over the
    batch)."""
    created, ended, group, answers, generating = {}, {}, {}, {}, {}
    for e in events:
        d = e.data
        if e.kind == "episode_created":
            created[d["episode"]], group[d["episode"]] = e.t, d["group"]
        elif e.kind == "env_step":
            ended[d["episode"]] = e.t
            answers.setdefault(d["episode"], []).append(token_count(d["action"]))
        elif e.kind == "generate":
            generating[d["episode"]] = generating.get(d["episode"], 0.0) + e.t - d["start"]
    turns = trace_turns(events)
    pools = engine_options(spec, costs)

    def alone(episode: str) -> tuple[float, float]:
        """(its prefills and decode at batch 1, its whole alone-path), as lower_bound.py's critical path."""
        engine = float(TurnCosts.of(pools, np.array([turn[:3] for turn in turns[episode]], dtype=float)).alone_s.sum())
        waits = sum(costs.shared.request_overhead_s + latency for *_, latency in turns[episode])
        return engine, engine + waits

    slowdown, engine_share, foreseen, chance = [], [], [], []
    for train in (e for e in events if e.kind == "train"):
        episodes = [t["episode"] for t in train.data["trajectories"]]
        oldest = sorted(episodes, key=lambda e: ended[e] - created[e])[-count:]
        early: dict[str, list[float]] = {}
        for e in episodes:
            early.setdefault(group[e], []).extend(answers[e][:3])
        ranked = sorted(episodes, key=lambda e: statistics.fmean(early[group[e]]))[-4 * count :]
        foreseen.append(len(set(oldest) & set(ranked)) / len(oldest))
        chance.append(min(1.0, 4 * count / len(episodes)))
        for e in oldest:
            engine, path = alone(e)
            if engine > 0:
                slowdown.append(generating.get(e, 0.0) / engine)
                engine_share.append(engine / path)
    return {
        "slowdown": statistics.median(slowdown),
        "engine_share": statistics.median(engine_share),
        "foreseen": statistics.fmean(foreseen),
        "chance": statistics.fmean(chance),
    }


def main(
    target: str = "qwen3-235b-a22b-h800x160",
    params: str = typer.Option("{}", help="the starter's parameters as JSON, e.g. '{\"redundant_envs\": 4}'"),
    seeds: str = typer.Option("0", help="workload seeds, comma-separated: one run each"),
    sandbox: str = "auto",
) -> None:
    try:
        chosen, numbers = json.loads(params), [int(s) for s in seeds.split(",")]
    except ValueError as error:
        raise SystemExit(f"--params must be a JSON object and --seeds whole numbers with commas: {error}") from None
    spec = load_target(target)
    costs = ClusterCosts.from_spec(spec)
    work = Path(tempfile.mkdtemp(prefix="bound-tightness-"))
    stack = write_starter(work / "stack", spec, "time_multiplex")
    params_path = stack / "stack" / "params.json"
    params_path.write_text(json.dumps({**json.loads(params_path.read_text()), **chosen}))
    table = Table(title=f"the fluid bound beside a bound that charges the engines for a fast path ({spec.id})")
    for column in (
        "seed",
        "step (s)",
        "fluid bound (s)",
        "fluid / step",
        "dual bound (s)",
        "its m, lambda, split",
        "longest-lived 32: in generate / alone",
        "engine share alone",
        "foreseen (chance)",
    ):
        table.add_column(column, justify="right")
    for seed in numbers:
        run = run_harness(
            Target.load(resolve_target_path(target), simulate=True),
            stack,
            work / f"out{seed}",
            "measure",
            Limits(time_s=1800, memory_mb=20_000),
            Sandbox.detect(sandbox),
            seed=seed,
        )
        if not run.ok:
            raise SystemExit(f"seed {seed}: {run.cause}")
        events = Trace.load_events(run.out / "trace.jsonl")
        devices = next(e for e in events if e.kind == "run_start").data["devices"]
        step = compute_metrics(events, devices)["step_time_s"]
        fluid = step_lower_bound(spec, costs, events)["lower_bound_step_s"]
        dual, top, weight, split = dual_bound(spec, costs, events)
        oldest = longest_lived(spec, costs, events)
        table.add_row(
            str(seed),
            f"{step:.0f}",
            f"{fluid:.0f}",
            f"{fluid / step:.0%}",
            f"{dual:.0f}",
            f"{top}, {weight:.3g}, {split}",
            f"{oldest['slowdown']:.1f}x",
            f"{oldest['engine_share']:.0%}",
            f"{oldest['foreseen']:.0%} ({oldest['chance']:.0%})",
        )
    Console(width=max(Console().width, 160)).print(table)
    Console().print(
        "dual bound: the mean step no schedule training these trajectories can beat when each must finish in its "
        "steps and the engines pay for the batch it decodes at (module docstring). longest-lived 32: each step's 32 "
        "trajectories that took longest from creation to their last turn; in generate / alone: their time in "
        "generate over their prefills and decode at batch 1; engine share alone: what those take of their "
        "alone-path (the rest: tool calls, requests); foreseen: the share of them among the 128 whose tasks "
        "answered longest in their first three turns (chance: 128 over the batch)"
    )


if __name__ == "__main__":
    typer.run(main)
