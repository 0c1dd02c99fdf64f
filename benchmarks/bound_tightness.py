"""Is the fluid lower bound loose because a fast critical path costs the engines their batch?

The fluid bound (``targets/harness/sim/lower_bound.py``) is the larger of two limits that no schedule
can both meet at once: the work at the largest batch the KV cache admits, and the longest trajectories
decoded alone (batch 1). On a mixture of experts the gap between the two batches is large (a token at
batch ~25 reads nearly every expert), so the question is whether the engines could afford to decode the
longest trajectories alone while doing the rest of the work. This script answers it for the trajectories
a run trained, with a bound that charges both at once (a Lagrangian relaxation; every step below only
lowers it, so it is a lower bound on the run's mean step time whatever the schedule):

* A token decoded at batch ``b`` on an engine of ``d`` devices takes ``t(b, C)`` seconds of its
  trajectory's time (``CostModel.fastest_token_s``: the cheapest draft length; co-runners' keys and
  values counted as nothing, ``C`` the turn's context before it, ``b <= KV capacity - C + 1``) and
  ``d * t / b`` device-seconds of the engines' (the iteration shared by its ``b`` sequences).
* A trajectory trained at step ``k`` ran within steps ``k - a .. k`` (``lower_bound.py``), so its decode
  took at most ``W_k - F_i`` seconds, ``W_k`` those steps' time and ``F_i`` its prefills, requests and
  tool calls at their least. For any ``lambda >= 0`` the least device-seconds its decode can cost under
  that deadline is at least ``L_i(lambda) - lambda (W_k - F_i)``, with
  ``L_i(lambda) = sum over its tokens of min_b (d t / b + lambda t)`` (weak duality).
* Give ``lambda`` to the ``m`` trajectories of each step with the longest alone-path, 0 to the rest;
  the engines' device-seconds (``D`` devices over the run's ``T``, prefills and training included) must
  hold all of it, and ``sum_k W_k <= (1 + a) T``, so
  ``T >= (sum_top [L_i(lambda) + lambda F_i] + sum_rest L_i(0) + prefill + train) / (D + (1 + a) m lambda)``.
  The bound is the largest over ``m`` and ``lambda``, divided by the steps.

Where it comes out at the fluid bound, the engines' capacity does not stand between a schedule and the
fluid bound: one that knew early which trajectories will be long could decode them nearly alone. The
script also reports, for the 32 trajectories of each step that finished last, how much slower their
decode ran than alone and how well the task's first turns predict them.

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
from targets.harness.sim.cost_model import ClusterCosts
from targets.harness.sim.lower_bound import _turns, engine_options, step_lower_bound
from targets.harness.target import Target
from targets.harness.trace import Trace, token_count
from targets.spec import TargetSpec, load_target, resolve_target_path

BATCHES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
LAMBDAS = np.concatenate([[0.0], np.geomspace(0.01, 1e4, 200)])  # device-seconds per second of a path
TOPS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
INFEASIBLE = 1e30  # a batch the KV cache cannot hold at that context


def dual_bound(spec: TargetSpec, costs: ClusterCosts, events: list[TraceEvent]) -> tuple[float, int, float]:
    """(the bound on the mean step in seconds, its ``m``, its ``lambda``) as the module's docstring derives it."""
    turns = _turns(events)
    trains = [e for e in events if e.kind == "train"]
    devices = len(next(e for e in events if e.kind == "run_start").data["devices"])
    stretch = 1 + spec.workload.staleness_limit
    pools = engine_options(spec, costs)
    grid = np.unique(np.concatenate([[0], np.floor(np.geomspace(1, 2**20, 160))])).astype(int)  # contexts, floored
    seconds = np.full((len(grid), len(pools) * len(BATCHES)), INFEASIBLE)
    device_seconds = np.full_like(seconds, INFEASIBLE)
    for row, context in enumerate(grid):
        for column, (cost, batch) in enumerate((c, b) for c in pools for b in BATCHES):
            if context + batch - 1 <= cost.kv_capacity_tokens:  # co-runners hold a token each at least
                t = cost.fastest_token_s(batch, context)
                seconds[row, column], device_seconds[row, column] = t, t * cost.engine_devices / batch
    per_token = np.min(device_seconds[:, :, None] + LAMBDAS[None, None, :] * seconds[:, :, None], axis=1)
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
                other += min(c.prefill_s(new, context - new) * c.engine_devices for c in pools)
        lagrangian = tokens_at @ per_token + LAMBDAS[None, :] * fixed[:, None]
        alone = tokens_at @ seconds.min(axis=1) + fixed
        order = np.argsort(-alone)
        steps.append((lagrangian[order], (tokens_at @ per_token[:, 0])[order]))
    best = (0.0, 0, 0.0)
    for top in (m for m in TOPS if m <= min(len(s[1]) for s in steps)):
        held = other + sum(lag[:top].sum(axis=0) + free[top:].sum() for lag, free in steps)
        bound = held / (devices + stretch * top * LAMBDAS) / len(steps)
        j = int(np.argmax(bound))
        if bound[j] > best[0]:
            best = (float(bound[j]), top, float(LAMBDAS[j]))
    return best


def last_to_finish(spec: TargetSpec, costs: ClusterCosts, events: list[TraceEvent], count: int = 32) -> dict:
    """For the ``count`` trajectories of each step that finished last: their decode's time in the run over
    its time alone (median), the share of their alone-path that is decode, and the share of them among the
    ``4 count`` whose tasks answered longest in their first three turns (what a scheduler could know early)."""
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
    turns = _turns(events)
    pools = engine_options(spec, costs)

    def alone(episode: str) -> tuple[float, float]:
        decode = sum(
            min(c.prefill_s(n, x - n) + r * c.fastest_token_s(1, x + r / 2) for c in pools)
            for x, n, r, _ in turns[episode]
        )
        return decode, decode + sum(latency for *_, latency in turns[episode])

    slowdown, decode_share, foreseen = [], [], []
    for train in (e for e in events if e.kind == "train"):
        episodes = [t["episode"] for t in train.data["trajectories"]]
        last = sorted(episodes, key=lambda e: ended[e] - created[e])[-count:]
        early: dict[str, list[float]] = {}
        for e in episodes:
            early.setdefault(group[e], []).extend(answers[e][:3])
        ranked = sorted(episodes, key=lambda e: statistics.fmean(early[group[e]]))[-4 * count :]
        foreseen.append(len(set(last) & set(ranked)) / count)
        for e in last:
            decode, path = alone(e)
            slowdown.append(generating[e] / decode)
            decode_share.append(decode / path)
    return {
        "slowdown": statistics.median(slowdown),
        "decode_share": statistics.median(decode_share),
        "foreseen": statistics.fmean(foreseen),
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
        "of it",
        "dual bound (s)",
        "its m, lambda",
        "last 32: decode slowdown",
        "decode share alone",
        "foreseen",
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
        trains = [e for e in events if e.kind == "train"]
        step = next(e.t for e in events if e.kind == "run_end") / len(trains)  # as metrics.py: the run over its steps
        fluid = step_lower_bound(spec, costs, events)["lower_bound_step_s"]
        dual, top, weight = dual_bound(spec, costs, events)
        last = last_to_finish(spec, costs, events)
        table.add_row(
            str(seed),
            f"{step:.0f}",
            f"{fluid:.0f}",
            f"{fluid / step:.0%}",
            f"{dual:.0f}",
            f"{top}, {weight:.3g}",
            f"{last['slowdown']:.1f}x",
            f"{last['decode_share']:.0%}",
            f"{last['foreseen']:.0%}",
        )
    Console(width=max(Console().width, 160)).print(table)
    Console().print(
        "dual bound: the mean step no schedule training these trajectories can beat when each must finish in its "
        "steps and the engines pay for the batch it decodes at (module docstring). last 32: each step's 32 "
        "trajectories that took longest from creation to their last turn; decode slowdown: their time in generate "
        "over their prefills and decode alone; decode share alone: of their alone-path; foreseen: the share of them "
        "among the 128 whose tasks answered longest in the first three turns"
    )


if __name__ == "__main__":
    typer.run(main)
