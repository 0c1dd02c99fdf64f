"""The best, measured where the search never looked.

Every round measures its candidate on the round's few seeds, so a search can tune to them: a
candidate that wins only on those tasks, or only on this exact workload, looks better than it is.
After the last round the run measures its best over the starter (round 0), paired by seed and in
one session, three ways: on the best round's own seeds (its in-search figure), on seeds no round
used (held out), and on the held-out seeds with the workload perturbed (turn counts, observation and
response lengths and tool latency scaled by ``PERTURBATION``). A gap between the first figure and
the other two is what the search tuned to.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

import yaml

from orchestrator.state import Generalization, GeneralizationRejected, Promotion
from targets.harness.measure.session import MeasurementFailed, Paired, Session
from targets.harness.target import Target
from targets.spec import TargetSpec

PERTURBATION = 1.25  # longer, slower episodes: every length and latency of the workload a quarter more
PERTURBED = "turns, observation and response lengths and tool latency"


def round_seeds(run_seed: int, number: int, count: int) -> list[int]:
    """Round ``number``'s ``count`` workload seeds, drawn from the run's seed and the round."""
    rng = random.Random(f"{run_seed}:{number}")
    return [rng.randrange(2**31) for _ in range(count)]


def attempt_seed(run_seed: int, number: int, attempt: int) -> int:
    """The workload seed round ``number``'s ``attempt`` is judged on: the round's first seed for the first,
    a seed of its own for each later one. Every attempt judged on one workload let an attempt learn it (a
    controller raising with what it saw: the reasons reach the next attempt's prompt) and schedule the next
    with foresight, measured as pair 0 (a review of the judge)."""
    if attempt == 1:
        return round_seeds(run_seed, number, 1)[0]
    return random.Random(f"{run_seed}:{number}:attempt {attempt}").randrange(2**31)


def held_out_seeds(run_seed: int, used: Iterable[int], count: int) -> list[int]:
    """``count`` workload seeds no round of the run drew (``round_seeds``), from a stream of their own."""
    rng, used, seeds = random.Random(f"{run_seed}:held-out"), set(used), []
    while len(seeds) < count:
        seed = rng.randrange(2**31)
        if seed not in used and seed not in seeds:
            seeds.append(seed)
    return seeds


def _scaled(distribution: dict, scale: float) -> dict:
    if distribution["kind"] == "empirical":
        return {**distribution, "values": [v * scale for v in distribution["values"]]}  # counts as they were
    key = {"fixed": "value", "geometric": "mean", "lognormal": "median"}[distribution["kind"]]
    return {**distribution, key: distribution[key] * scale}


def perturbed_workload(spec: TargetSpec, scale: float = PERTURBATION) -> tuple[dict | None, str]:
    """The spec's workload with its lengths and latencies scaled (as YAML data), and what was scaled;
    or None and why not. Budgets stay within the model's sequence; the trajectory timeout, batch and
    training are unchanged, so a longer episode may now time out as it would on such a workload."""
    workload = spec.workload
    if workload.environment.entry is not None:
        return None, f"{workload.environment.entry} is the user's environment: its turns and lengths are its own"
    data = workload.model_dump(mode="json", exclude_none=True)
    turns, tokens = data["turns"], data["tokens"]
    turns["max"] = max(1, math.ceil(turns["max"] * scale))
    if "dist" in turns:
        turns["dist"] = _scaled(turns["dist"], scale)
    tokens["observation"] = max(1, round(tokens["observation"] * scale))
    tokens["response"] = min(round(tokens["response"] * scale), tokens["max_sequence"] - tokens["prompt"])
    if "response_length" in tokens:
        lengths = tokens["response_length"]
        spread = lengths.get("task_sigma", 0) > 0 or lengths.get("turn_sigma", 0) > 0
        lengths["mean"] = min(lengths["mean"] * scale, tokens["response"] - (1 if spread else 0))
    data["env_latency_s"] = _scaled(data["env_latency_s"], scale)
    data["env_latency_max_s"] *= scale
    return data, f"{PERTURBED} x{scale:g}"


def perturbed_session(session: Session, path: Path) -> tuple[Session | None, str]:
    """A session on the perturbed workload (its spec written to ``path``), sharing the run's sandbox,
    limits and workload secret; or None and why not."""
    workload, what = perturbed_workload(session.target.spec)
    if workload is None:
        return None, what
    raw = session.target.spec.model_dump(mode="json", exclude_none=True)
    raw["workload"] = workload
    raw["id"] = f"{raw['id']}-perturbed"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    target = Target.load(path, simulate=session.target.simulated)
    return Session(target, session.sandbox, session.limits, session.task_key), what


def measure_generalization(
    session: Session,
    best: tuple[int, str, Path],
    starter: Path,
    in_search_seeds: list[int],
    held_out: list[int],
    out: Path,
    on_run: Callable[[str, int], None] = lambda name, i: None,
) -> Generalization | GeneralizationRejected:
    """``best``: its round, commit and exported directory; ``starter``: round 0's. A run that fails
    its checks ends the measurement: its figures cannot count, and what is returned says which run
    failed, on which seed, and why (a best the judge rejects where the search never looked is a
    finding of the search too: it tuned to its seeds, or to what the judge allows)."""
    round_, commit, best_dir = best
    out.mkdir(parents=True, exist_ok=True)
    perturbed_on, what = perturbed_session(session, out / "perturbed.yaml")
    plan = [("in-search", session, in_search_seeds), ("held-out", session, held_out)]
    if perturbed_on is not None:
        plan.append(("perturbed", perturbed_on, held_out))
    figures: dict[str, Promotion] = {}
    bound: dict[str, float] = {}
    tokens: dict[str, float] = {}
    for name, measuring, seeds in plan:
        try:
            ours, theirs, paired = measuring.compare(
                best_dir,
                starter,
                out / name,
                seeds,
                "round 0",
                on_run=lambda who, i, figure=name: on_run(f"{figure} {who}", i),
            )
        except MeasurementFailed as failed:
            return GeneralizationRejected(
                best_round=round_,
                best_commit=commit,
                held_out_seeds=held_out,
                figure=name,
                run="the best" if failed.name == "candidate" else "the starter",
                seed=seeds[failed.repeat],
                reasons=failed.reasons,
            )
        figures[name] = Promotion(**paired.as_dict())
        bound[name] = statistics.median(m.metrics["lower_bound_fraction"] for m in ours)
        ratio = Paired.ratio_of(*([m.metrics["trained_tokens_per_s"] for m in runs] for runs in (ours, theirs)))
        if ratio is not None:  # a starter that trained nothing: no ratio (the tables show '-'), not 0.00x
            tokens[name] = ratio
    return Generalization(
        best_round=round_,
        best_commit=commit,
        in_search=figures["in-search"],
        held_out=figures["held-out"],
        held_out_seeds=held_out,
        perturbed=figures.get("perturbed"),
        perturbation=what if perturbed_on is not None else "",
        not_perturbed=None if perturbed_on is not None else what,
        bound=bound,
        tokens=tokens,
    )
