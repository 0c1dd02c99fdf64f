"""System-run audit (design check 4), from the harness's own trace and weight snapshots only.

* exactly once: no episode is trained on twice, none that the harness never created;
* conservation: every created episode is trained exactly once or dropped with a reason that the
  trace confirms (stale beyond the bound, end of run after the last step, sequence really full);
  anything else is lost;
* fidelity: a trained trajectory is exactly what the environment saw (reset, actions, observations,
  reward), every action was produced by ``cluster.generate``, and its behaviour logprobs are the
  engine's;
* staleness: no trained turn is more than ``async_ratio`` versions behind the policy;
* replay: sampled turns' logprobs recomputed with the reference model under the weights of the
  version the engine claimed (proves the model really ran with those weights);
* mechanism: no request served by a shrunk engine, never zero active engines, the weights changed,
  the requested number of steps ran.

A simulated run's trace keeps token counts, not tokens (``run_start.tokens_recorded``), and has no
weights: there, fidelity compares counts, and replay and the weights check are skipped (the
details say so); accounting, staleness and the mechanism invariants are checked in full.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Callable

import torch

from targets.api import StateDict, TraceEvent
from targets.harness.accuracy import CheckResult
from targets.harness.trace import token_count
from targets.spec import TargetSpec

MAX_REASONS_PER_KIND = 3


@torch.no_grad()
def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """Logprob of each generated token given everything before it: one causal forward per turn."""
    if not tokens:
        return []
    sequence = torch.tensor([list(prompt) + list(tokens)])
    logits = model(input_ids=sequence).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1).tolist()


class _Reasons:
    """Collects reasons, keeping a few examples per kind and counting the rest."""

    def __init__(self) -> None:
        self.examples: dict[str, list[str]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, kind: str, message: str) -> None:
        self.counts[kind] += 1
        if len(self.examples[kind]) < MAX_REASONS_PER_KIND:
            self.examples[kind].append(message)

    def lines(self) -> list[str]:
        out = []
        for kind, examples in self.examples.items():
            more = self.counts[kind] - len(examples)
            out += [f"{kind}: {m}" for m in examples] + ([f"{kind}: ... and {more} more"] if more else [])
        return out


def audit_run(
    spec: TargetSpec,
    events: list[TraceEvent],
    load_weights: Callable[[int], StateDict | None],
    make_model: Callable[[StateDict], torch.nn.Module],
    steps: int,
    replay_turns: int = 12,
    seed: int = 0,
) -> CheckResult:
    r = _Reasons()
    workload = spec.workload
    by_kind: dict[str, list[TraceEvent]] = defaultdict(list)
    for e in events:
        by_kind[e.kind].append(e)
    end_t = by_kind["run_end"][0].t if by_kind["run_end"] else (events[-1].t if events else 0.0)
    tokens_recorded = by_kind["run_start"][0].data.get("tokens_recorded", True) if by_kind["run_start"] else True

    created = {e.data["episode"] for e in by_kind["episode_created"]}
    resets = {e.data["episode"]: e for e in by_kind["env_reset"]}
    env_steps: dict[str, list[TraceEvent]] = defaultdict(list)
    for e in by_kind["env_step"]:
        env_steps[e.data["episode"]].append(e)
    finished = {ep for ep, s in env_steps.items() if s and s[-1].data["done"]}
    dropped = {e.data["episode"]: e.data["reason"] for e in by_kind["sample_dropped"]}
    generated: dict[str, list[TraceEvent]] = defaultdict(list)  # non-aborted, in completion order
    for e in by_kind["generate"]:
        if not e.data["aborted"]:
            generated[e.data["episode"]].append(e)

    # -- exactly once, and only real episodes --------------------------------------------------------
    trained: dict[str, int] = defaultdict(int)
    for train in by_kind["train"]:
        for t in train.data["trajectories"]:
            trained[t["episode"]] += 1
    for episode, count in trained.items():
        if episode not in created:
            r.add("fabricated episode", f"trained on {episode}, which the harness never created")
        elif count > 1:
            r.add("used twice", f"episode {episode} is in {count} training batches")

    # -- conservation: trained exactly once, or dropped for a reason that holds ------------------------
    train_ends = sorted(e.t for e in by_kind["train"])
    for episode in sorted(created):
        if episode in trained and episode in dropped:
            r.add("trained and dropped", f"episode {episode} was trained on and also dropped")
        elif episode not in trained and episode not in dropped:
            state = "finished" if episode in finished else "unfinished"
            r.add("lost", f"episode {episode} ({state}) was neither trained on nor dropped")
    for e in by_kind["sample_dropped"]:
        episode, reason = e.data["episode"], e.data["reason"]
        policy = sum(1 for t in train_ends if t <= e.t)
        if reason == "end_of_run" and train_ends and e.t < train_ends[-1]:
            r.add("unjustified drop", f"episode {episode} dropped as end_of_run at {e.t:.2f}s, before the last training step")
        elif reason == "stale":
            versions = [g.data["version"] for g in generated.get(episode, [])]
            if not versions or policy - min(versions) <= workload.async_ratio:
                r.add("unjustified drop", f"episode {episode} dropped as stale but its turns are within async_ratio of policy {policy}")
        elif reason == "max_sequence":
            length = token_count(resets[episode].data["observation"]) if episode in resets else 0
            length += sum(token_count(s.data["action"]) + token_count(s.data["observation"]) for s in env_steps.get(episode, []))
            if length + workload.tokens.response <= workload.tokens.max_sequence:
                r.add("unjustified drop", f"episode {episode} dropped for max_sequence at {length} tokens, which still fits")

    # -- fidelity and staleness -----------------------------------------------------------------------
    replayable: list[TraceEvent] = []
    for train in by_kind["train"]:
        policy = train.data["policy_version"]
        for t in train.data["trajectories"]:
            episode = t["episode"]
            if episode not in created:
                continue
            if episode not in finished:
                r.add("skipped environment steps", f"episode {episode} was trained on before its environment finished")
                continue
            steps_seen = env_steps[episode]
            if tokens_recorded:
                expected_tokens, expected_mask = list(resets[episode].data["observation"]), [0] * len(resets[episode].data["observation"])
                for s in steps_seen:
                    expected_tokens += s.data["action"] + s.data["observation"]
                    expected_mask += [1] * len(s.data["action"]) + [0] * len(s.data["observation"])
                altered = t["tokens"] != expected_tokens or t["loss_mask"] != expected_mask
            else:
                expected = token_count(resets[episode].data["observation"]) + sum(
                    token_count(s.data["action"]) + token_count(s.data["observation"]) for s in steps_seen)
                altered = t["tokens"] != expected
            if altered:
                r.add("altered trajectory", f"episode {episode}: trained tokens differ from what the environment saw")
            reward = sum(s.data["reward"] for s in steps_seen)
            if abs(t["reward"] - reward) > 1e-6:
                r.add("altered reward", f"episode {episode}: trained reward {t['reward']:.4f}, environment paid {reward:.4f}")
            gens = generated.get(episode, [])
            by_turn = {g.data["turn"]: g for g in gens}
            behaviour = [lp for lp, m in zip(t["logprobs"], t["loss_mask"]) if m] if tokens_recorded else []
            recorded: list[float] = []
            for turn, s in enumerate(steps_seen):
                g = by_turn.get(turn)
                if g is None or (g.data["tokens"] != s.data["action"] if tokens_recorded else token_count(g.data["tokens"]) != token_count(s.data["action"])):
                    r.add("fabricated rollout", f"episode {episode} turn {turn}: the action was not produced by cluster.generate")
                    break
                recorded += g.data["logprobs"] if tokens_recorded else []
                if policy - g.data["version"] > workload.async_ratio:
                    r.add("stale sample", f"episode {episode} turn {turn}: generated at version {g.data['version']}, trained at policy {policy} (async_ratio {workload.async_ratio})")
                if g.data["version"] > policy:
                    r.add("future version", f"episode {episode} turn {turn}: claims version {g.data['version']} before policy {policy} existed")
                replayable.append(g)
            else:
                if len(recorded) != len(behaviour) or any(abs(a - b) > 1e-6 for a, b in zip(recorded, behaviour)):
                    r.add("altered logprobs", f"episode {episode}: behaviour logprobs differ from the engine's")

    # -- replay sampled turns under the claimed weights -------------------------------------------------
    rng = random.Random(seed)
    by_version: dict[int, list[TraceEvent]] = defaultdict(list)
    for g in replayable:
        by_version[g.data["version"]].append(g)
    per_version = -(-replay_turns // max(1, len(by_version)))  # every claimed version gets replayed
    sample = [g for gs in by_version.values() for g in rng.sample(gs, min(per_version, len(gs)))] if tokens_recorded else []
    models: dict[int, torch.nn.Module] = {}
    worst = 0.0
    for g in sorted(sample, key=lambda g: g.data["version"]):
        version = g.data["version"]
        if version not in models:
            state = load_weights(version)
            if state is None:
                r.add("replay", f"no weights recorded for version {version}")
                continue
            models[version] = make_model(state)
        actual_logprobs = teacher_forced_logprobs(models[version], g.data["prompt"], g.data["tokens"])
        for actual, claimed in zip(actual_logprobs, g.data["logprobs"]):
            worst = max(worst, abs(actual - claimed))
            if abs(actual - claimed) > spec.accuracy.logprob_atol:
                r.add("replay", f"episode {g.data['episode']} turn {g.data['turn']}: logprob {claimed:.4f} but the model under version {version} gives {actual:.4f}: it did not run with those weights")
                break

    # -- mechanism invariants -----------------------------------------------------------------------------
    serving = {g.data["device"] for gs in generated.values() for g in gs}
    inactive_since: dict[str, float] = {}
    windows: list[tuple[str, float, float]] = []  # device, shrunk at, expanded at
    for e in sorted(by_kind["shrink"] + by_kind["expand"], key=lambda e: e.t):
        for device in e.data["devices"]:
            if e.kind == "shrink":
                inactive_since[device] = e.t
            elif device in inactive_since:
                windows.append((device, inactive_since.pop(device), e.data["start"]))
        if e.kind == "shrink" and serving and serving <= set(inactive_since):
            r.add("no active engine", f"after the shrink at {e.t:.2f}s no rollout engine was active")
    windows += [(d, t, end_t) for d, t in inactive_since.items()]
    for gs in generated.values():
        for g in gs:
            for device, since, until in windows:
                if g.data["device"] == device and g.data["start"] > since and g.t < until:
                    r.add("served while shrunk", f"{device} served episode {g.data['episode']} turn {g.data['turn']} while shrunk")

    versions = sorted({e.data["version"] for e in by_kind["train"]})
    if len(by_kind["train"]) != steps:
        r.add("steps", f"the controller ran {len(by_kind['train'])} training steps, {steps} were requested")
    if versions and tokens_recorded:
        first, last = load_weights(0), load_weights(versions[-1])
        if first is not None and last is not None and all(torch.equal(first[k], last[k]) for k in first):
            r.add("weights unchanged", f"training did not change the weights (version {versions[-1]} equals version 0)")

    details = {
        "episodes_created": len(created), "trained": len(trained), "dropped": len(dropped),
        "replayed_turns": len(sample), "max_replay_logprob_diff": worst,
    }
    if not tokens_recorded:
        details["skipped"] = "simulated run: no tokens or weights recorded, so no replay and no weights-changed check"
    reasons = r.lines()
    return CheckResult("system_audit", not reasons, reasons, details)
