"""The system-run audit (docs/judge.md), from the harness's own trace and weight snapshots only:
one function per invariant, each over ``TraceIndex`` (the trace, indexed once).

* exactly once: no episode is trained on twice, none the harness never created;
* conservation: every created episode is trained once or dropped with a reason the trace confirms
  (``stale``: a member of its group is beyond the bound; ``end_of_run``: after the last step;
  ``max_sequence``: the next turn cannot fit; ``redundant``: a spare, once ``group_size`` of its group had
  finished, within the declared redundancy; ``deferred``: see deferral);
* deferral (tail batching): only a stack that declares ``tail_round`` defers, only a group still
  unfinished, always whole, never a relaunched one; each deferred task runs again once
  (``new_group(relaunch=...)``), and at most ``tail_round - 1`` still wait for that when the run ends;
  a stale group's task may run again too, once, after it was handed back; a relaunch is never relaunched;
* fidelity: a trained trajectory is exactly what the environment saw, every action any environment
  received came from ``cluster.generate``, and the behaviour logprobs are the engine's;
* batches: each holds exactly ``batch_size`` trajectories of whole groups, with the group-relative
  advantages of their rewards, taken oldest group first among those finished before the previous
  step ended;
* in flight: never more episodes outstanding than the staleness bound (plus declared redundancy) needs;
* staleness: no trained turn is more than ``async_ratio`` versions behind the policy (the stack's
  declared bound, within the target's ``max_async_ratio``, else the workload's);
* engine honesty: finish reasons match the tokens, each prompt is the episode's whole context so far,
  and requests ask for the spec's temperature and response budget and stop on the runtime's stop
  tokens (more of them would cut every turn short);
* partial rollout: a turn resumed from an interrupted segment (``continues``) resumes exactly what
  that segment produced, its segments together keep to the response budget and each to the staleness
  bound, and only a stack that declares ``partial_rollout`` resumes, and then every partial it trains;
* order of service (real runs): a request answered (or interrupted) after later ones its engine served
  one after another decoded at least the steps they prove it sat through (``service_order.py``), and
  every request names a device that held an engine while it ran;
* version timing (real runs): a request forwarded before the version it claims existed was answered
  late enough after that to have decoded its tokens (``version_timing.py``);
* aborts (``interruptions.py``): every interrupted request was cut short by a shrink, a suspend or an
  interrupting sync in progress, which cut everything its engine had started (a cluster that aborts on
  its own, or only some turns, could resample those it dislikes); an interrupting sync brings a newer
  version, and every sync one a step returned;
* mechanism: no request served by a shrunk engine, none completed well after its engine's shrink
  returned (a shrink aborts what it holds), never zero active engines, the requested steps
  ran, each training step returned the next version, an engine and a trainer never held one device
  at once (the cluster's residency, recorded after every switch), and the weights changed;
* serving SLOs (a target with a serving pool): the traffic the harness served beside the run kept
  its p99 TTFT and TPOT within the pool's SLOs, and a rollout engine on a serving device served only
  between that device's expand and shrink (lending is an expand);
* verdicts (a target with a reward model): every trajectory trained on that ended well was judged by
  the reward model once, on its whole context, before the training step (or its part) took it;
* replayable (``replayable.py``): every token prompted, generated or trained on is in the model's
  vocabulary, and no sequence is longer than the target allows (else nothing is replayed);
* replay (``targets/harness/judge/replay.py``): logprobs under the claimed weights, sampling at the spec's
  temperature, and every training step recomputed by the reference from the previous weights.

A simulated run's trace keeps token counts, not tokens (``run_start.tokens_recorded``), and has no
weights: there fidelity and prompts compare counts, and the replays are skipped (the details say so).
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from targets.api import StateDict, TraceEvent
from targets.harness.environments.seeds import RunSeed
from targets.harness.judge.check_result import CheckResult
from targets.harness.judge.delivery import check_delivered_versions
from targets.harness.judge.draws import WorkloadDraws
from targets.harness.judge.interruptions import check_aborts
from targets.harness.judge.mechanism import check_mechanism
from targets.harness.judge.replayable import check_replayable
from targets.harness.judge.selection import (
    check_deferrals,
    check_drop_reasons,
    check_partial_progress,
    check_partial_rollout,
)
from targets.harness.judge.selection_net import check_selection
from targets.harness.judge.service_order import check_service_order
from targets.harness.judge.trace_index import Reasons, TraceIndex
from targets.harness.judge.version_timing import check_version_timing, decode_step_floor
from targets.harness.reference.grpo import group_advantages_of
from targets.harness.trace import Trace, consumed_at, token_count
from targets.spec import TargetSpec

log = logging.getLogger("vibetrain.audit")

if TYPE_CHECKING:
    import torch

    from targets.harness.target import Target

ADVANTAGE_ATOL = 1e-4


def check_exactly_once(ix: TraceIndex, r: Reasons) -> None:
    created = set(ix.created)
    for episode, trains in ix.trained_in.items():
        if episode not in created:
            r.add("fabricated episode", f"trained on {episode}, which the harness never created")
        elif len(trains) > 1:
            r.add("used twice", f"episode {episode} is in {len(trains)} training batches")


def check_conservation(ix: TraceIndex, r: Reasons) -> None:
    for episode in ix.created:
        if episode in ix.trained_in and episode in ix.dropped:
            r.add("trained and dropped", f"episode {episode} was trained on and also dropped")
        elif episode not in ix.trained_in and episode not in ix.dropped:
            state = "finished" if ix.finished(episode) else "unfinished"
            r.add("unaccounted", f"episode {episode} ({state}) was neither trained on nor dropped")
    created = set(ix.created)
    for episode in ix.dropped:
        if episode not in created:
            r.add("fabricated episode", f"dropped {episode}, which the harness never created")
    # the index keeps an episode's first drop, whose reason the audit checks: a later one goes unchecked
    drops = Counter(e.data["episode"] for e in ix.by_kind["sample_dropped"])
    for episode, times in drops.items():
        if times > 1:
            r.add("dropped twice", f"episode {episode} was dropped {times} times")


def check_in_flight(ix: TraceIndex, r: Reasons, spec: TargetSpec) -> dict:
    """Episodes and groups outstanding (created, neither trained nor dropped; a group while any member is)
    never exceed what the staleness bound needs: ``groups_per_step x (1 + async_ratio)`` groups, and a
    step's more with a declared ``env_prestart``; in episodes, each group of ``group_size`` plus the
    declared spares. Counted in groups too, whatever spares are declared: a red team's stack declared a
    group's worth, launched none, and kept twice the groups in flight with the episode bound met exactly."""
    w = spec.workload
    bounds = {"episodes": w.in_flight_bound(ix.declared), "groups": w.groups_in_flight_bound(ix.declared)}
    rule = "groups_per_step x (1 + async_ratio + declared env_prestart)"
    why = {"episodes": f"{rule} x (group_size + declared redundancy)", "groups": f"{rule}, whatever spares"}
    changes = [(e.t, 1, 1, e.data["episode"]) for e in ix.by_kind["episode_created"]]
    changes += [(consumed_at(train, t), 0, -1, t["episode"]) for train in ix.trains for t in train.data["trajectories"]]
    changes += [(e.t, 0, -1, episode) for episode, e in ix.dropped.items()]
    now, peaks = dict.fromkeys(bounds, 0), dict.fromkeys(bounds, 0)
    in_group: Counter = Counter()  # a group's members outstanding
    for when, _, delta, episode in sorted(changes):
        now["episodes"] += delta
        if (group := ix.group_of.get(episode)) is not None:
            before = in_group[group]
            in_group[group] += delta
            now["groups"] += (before <= 0 < in_group[group]) - (in_group[group] <= 0 < before)
        for kind, count in now.items():
            if count > peaks[kind]:
                peaks[kind] = count
                if count == bounds[kind] + 1:
                    r.add(
                        f"too many {kind}",
                        f"{count} {kind} in flight at {when:.2f}s, over the bound of {bounds[kind]} ({why[kind]})",
                    )
    return {
        "peak_in_flight": peaks["episodes"],
        "in_flight_bound": bounds["episodes"],
        "peak_groups_in_flight": peaks["groups"],
        "groups_in_flight_bound": bounds["groups"],
    }


def check_batches(ix: TraceIndex, r: Reasons, spec: TargetSpec) -> None:
    """Whole groups, the batch size, advantages from the rewards, and oldest first: a group that had
    finished before the previous step ended (so it waited in the buffer when this batch was taken)
    may not be passed over for a younger one, nor left there until it goes stale."""
    w = spec.workload
    group_taken: dict[str, float] = {}  # group -> when a step (or its part) took it, or it was dropped
    for train in ix.trains:
        for t in train.data["trajectories"]:
            group_taken.setdefault(ix.group_of.get(t["episode"], t["group"]), consumed_at(train, t))
    for e in ix.dropped.values():
        if e.data["reason"] != "redundant":  # a spare handed back as its group completed: the group is not taken
            group_taken.setdefault(ix.group_of.get(e.data["episode"], ""), e.t)
    finished_groups: dict[str, list[float]] = defaultdict(list)
    for episode in ix.created:
        if (at := ix.finished_at(episode)) is not None:
            finished_groups[ix.group_of[episode]].append(at)
    group_done = {g: sorted(ts)[w.group_size - 1] for g, ts in finished_groups.items() if len(ts) >= w.group_size}
    for k, train in enumerate(ix.trains):
        trajectories = train.data["trajectories"]
        if len(trajectories) != w.batch_size:
            r.add(
                "batch size",
                f"training step {k + 1} has {len(trajectories)} trajectories, the batch size is {w.batch_size}",
            )
        members = Counter(ix.group_of.get(t["episode"], t["group"]) for t in trajectories)
        for group, count in members.items():
            if count != w.group_size:
                r.add(
                    "partial group",
                    f"training step {k + 1} holds {count} of group {group}'s episodes, not {w.group_size}",
                )
        for t in trajectories:
            if ix.group_of.get(t["episode"], t["group"]) != t["group"]:
                r.add("partial group", f"training step {k + 1} files episode {t['episode']} under group {t['group']}")
        expected = group_advantages_of([(t["group"], t["reward"]) for t in trajectories])
        given = train.data.get("advantages", [])
        if len(given) != len(expected) or any(not abs(a - b) <= ADVANTAGE_ATOL for a, b in zip(given, expected)):
            r.add(
                "altered advantages",
                f"training step {k + 1}: the advantages are not the group-relative ones of the rewards",
            )
        if k == 0:
            continue
        previous_end, start = ix.trains[k - 1].t, ix.taken_from(train)
        passed_over = [
            g
            for g, done in group_done.items()
            if done < previous_end and group_taken.get(g, float("inf")) >= start and g not in members
        ]
        youngest = max((ix.group_order.get(g, -1) for g in members), default=-1)
        for group in sorted(passed_over, key=lambda g: ix.group_order.get(g, 0)):
            if ix.group_order.get(group, 0) < youngest:
                r.add(
                    "out of order",
                    f"training step {k + 1} took younger groups over group {group}, finished before "
                    "the previous step ended (groups are trained oldest first)",
                )
                break


def check_fidelity(ix: TraceIndex, r: Reasons) -> None:
    """Every action any environment got came from ``cluster.generate``; a trained trajectory is
    exactly the environment's record, with its reward and the engine's logprobs."""
    for episode, gens_in_order in ix.generated.items():
        for turn, count in Counter(g.data["turn"] for g in gens_in_order).items():
            if count > 1:
                r.add(
                    "resampled turn",
                    f"episode {episode} turn {turn} was generated {count} times: a turn is sampled once",
                )
    for episode, steps in ix.env_steps.items():
        gens = {}
        for g in ix.generated.get(episode, []):
            gens.setdefault(g.data["turn"], g)
        for turn, s in enumerate(steps):
            g = gens.get(turn)
            if g is not None and not ix.response(g).chained:
                break  # named "bad continuation" with every request (``_request_fault``)
            same = g is not None and (
                ix.response(g).tokens == s.data["action"]
                if ix.tokens_recorded
                else ix.response(g).tokens == token_count(s.data["action"])
            )
            if not same or g.t > s.t:
                r.add(
                    "fabricated rollout",
                    f"episode {episode} turn {turn}: the action was not produced by cluster.generate",
                )
                break
    for train in ix.trains:
        for t in train.data["trajectories"]:
            episode = t["episode"]
            if episode not in ix.group_of:
                continue
            if (at := ix.finished_at(episode)) is None or at > consumed_at(train, t):
                r.add(
                    "skipped environment steps",
                    f"episode {episode} was trained on before its environment finished"
                    + (" and the reward model judged it" if ix.judged else ""),
                )
                continue
            steps = ix.env_steps[episode]
            expected = ix.context_tokens(episode, len(steps))
            if ix.tokens_recorded:
                mask = [0] * token_count(ix.resets[episode].data["observation"])
                for s in steps:
                    mask += [1] * len(s.data["action"]) + [0] * len(s.data["observation"])
                altered = t["tokens"] != expected or t["loss_mask"] != mask
            else:
                altered = t["tokens"] != expected
            if altered:
                r.add("altered trajectory", f"episode {episode}: trained tokens differ from what the environment saw")
            reward = ix.paid(episode)
            if not abs(t["reward"] - reward) <= 1e-6:  # a NaN is no match
                r.add(
                    "altered reward",
                    f"episode {episode}: trained reward {t['reward']:.4f}, "
                    + ("environment and reward model" if ix.verdicts.get(episode) else "environment")
                    + f" paid {reward:.4f}",
                )
            if ix.tokens_recorded:
                by_turn = {}
                for g in ix.generated.get(episode, []):
                    by_turn.setdefault(g.data["turn"], g)
                engine = [
                    lp for turn in range(len(steps)) if turn in by_turn for lp in ix.response(by_turn[turn]).logprobs
                ]
                behaviour = [lp for lp, m in zip(t["logprobs"], t["loss_mask"]) if m]
                if len(engine) != len(behaviour) or any(not abs(a - b) <= 1e-6 for a, b in zip(engine, behaviour)):
                    r.add("altered logprobs", f"episode {episode}: behaviour logprobs differ from the engine's")


def check_staleness(ix: TraceIndex, r: Reasons, spec: TargetSpec) -> None:
    """Per turn, and per segment of a resumed turn: the oldest segment is the one the bound binds."""
    ratio = spec.workload.staleness_bound(ix.declared)
    for k, train in enumerate(ix.trains):
        policy = k  # the step trains the policy of version k (its k predecessors)
        for t in train.data["trajectories"]:
            for g in ix.generated.get(t["episode"], []):
                versions, turn = ix.response(g).versions, g.data["turn"]
                if policy - min(versions) > ratio:
                    r.add(
                        "stale sample",
                        f"episode {t['episode']} turn {turn}: generated at version {min(versions)}, trained at "
                        f"policy {policy} (async_ratio {ratio})",
                    )
                if max(versions) > policy:
                    r.add(
                        "future version",
                        f"episode {t['episode']} turn {turn}: claims version {max(versions)} before policy "
                        f"{policy} existed",
                    )


def check_engine_honesty(ix: TraceIndex, r: Reasons, spec: TargetSpec) -> None:
    """Finish reasons agree with the tokens, a prompt is the episode's whole context so far (plus,
    for a resumed turn, its response so far), and a request asks for the spec's sampling
    temperature, the runtime's stop tokens and what is left of the response budget. Interrupted
    segments are held to the same, and every request, finished or not, to a turn its episode was at
    (``_request_fault``)."""
    w = spec.workload
    for episode in sorted(set(ix.generated) | set(ix.partials)):
        for g in [*ix.generated.get(episode, []), *ix.partials.get(episode, [])]:
            d = g.data
            where = f"episode {episode} turn {d['turn']}"
            continues = d.get("continues", 0)
            fault = _request_fault(ix, g)
            if fault is not None:
                r.add(*fault)
            if (
                d.get("temperature") != w.training.temperature
                or d.get("max_new_tokens") != w.tokens.response - continues
            ):
                r.add(
                    "sampling parameters",
                    f"{where}: asked for temperature {d.get('temperature')} and {d.get('max_new_tokens')} "
                    f"tokens; the spec says {w.training.temperature} and {w.tokens.response}"
                    + (f" less the {continues} already generated" if continues else ""),
                )
            if sorted(d.get("stop", [])) != sorted(ix.stop_token_ids):  # stopping early shortens every turn
                r.add(
                    "sampling parameters",
                    f"{where}: asked to stop on tokens {d.get('stop', [])[:8]}; the runtime's stop tokens are "
                    f"{list(ix.stop_token_ids)}",
                )
            n = token_count(d["tokens"])
            if d["aborted"]:
                stopped = ix.tokens_recorded and any(tok in set(d.get("stop", [])) for tok in d["tokens"])
                if stopped or n >= d["max_new_tokens"]:
                    r.add("finish reason", f"{where}: an interrupted segment went on past a stop token or its budget")
            elif d["finish"] == "abort":
                r.add("finish reason", f"{where}: an aborted completion was handed back as a result")
            elif not ix.tokens_recorded:
                if n > d["max_new_tokens"] or (d["finish"] == "length" and n != d["max_new_tokens"]):
                    r.add("finish reason", f"{where}: finish {d['finish']} with {n} of {d['max_new_tokens']} tokens")
            else:
                tokens, stop = d["tokens"], set(d.get("stop", []))
                if any(tok in stop for tok in tokens[:-1]):
                    r.add("finish reason", f"{where}: generation went on past a stop token")
                elif d["finish"] == "stop" and not (tokens and tokens[-1] in stop):
                    r.add(
                        "finish reason",
                        f"{where}: finish 'stop' but the last token {tokens[-1:] or 'none'} is no stop token",
                    )
                elif d["finish"] == "length" and (n != d["max_new_tokens"] or tokens[-1] in stop):
                    r.add(
                        "finish reason",
                        f"{where}: finish 'length' after {n} of {d['max_new_tokens']} tokens"
                        + (" ending on a stop token" if n and tokens[-1] in stop else ""),
                    )
            if episode in ix.resets and d["turn"] <= len(ix.env_steps.get(episode, [])):
                expected = ix.context_tokens(episode, d["turn"])
                prompt = d["prompt"][: len(d["prompt"]) - continues] if ix.tokens_recorded else d["prompt"] - continues
                if prompt != expected:
                    r.add(
                        "incomplete prompt",
                        f"{where}: the engine was asked with {token_count(prompt)} tokens of context, "
                        f"not the episode's whole context of {token_count(expected)}",
                    )


def _request_fault(ix: TraceIndex, g: TraceEvent) -> tuple[str, str] | None:
    """What is wrong with a request's episode and turn: the harness never created the episode; it was not
    in play when the request was forwarded (not reset yet, or dropped); the turn is not the one the episode
    was at then (its steps answered by then), or the episode had ended; its seed is not its turn's earlier
    segments'; it resumes tokens no interrupted segment of its turn produced. Checked for every request,
    not only the turns an environment stepped: a request in another episode's name, cut at once, could
    otherwise plant contexts for the independence test to guess from (a red team's decoys and orphans)."""
    d = g.data
    where = f"episode {d['episode']} turn {d['turn']}"
    if d["episode"] not in ix.group_of:
        return "unknown episode", f"{where}: a request for an episode the harness never created"
    reset, dropped = ix.resets.get(d["episode"]), ix.dropped.get(d["episode"])
    # strict both ways: a simulated run stamps a drop and a request its controller made at one instant alike
    if reset is None or reset.t > d["start"] or (dropped is not None and dropped.t < d["start"]):
        at = "had not been reset" if reset is None or reset.t > d["start"] else f"was dropped at {dropped.t:.2f}s"
        return "turn out of place", f"{where}: forwarded at {d['start']:.2f}s, when the episode {at}"
    steps = [s for s in ix.env_steps.get(d["episode"], []) if s.t <= d["start"]]
    if (steps and steps[-1].data["done"]) or d["turn"] != len(steps):
        at = "had ended" if steps and steps[-1].data["done"] else f"was at turn {len(steps)}"
        return "turn out of place", f"{where}: forwarded at {d['start']:.2f}s, when the episode {at}"
    seeds = ix.earlier_seeds(g) - {d.get("seed")}
    if seeds:
        return (
            "reseeded turn",
            f"{where}: asked with seed {d.get('seed')} after its interrupted segments' {sorted(map(str, seeds))} "
            "(a turn's segments draw from one seed: a new one for the attempts it dislikes would choose its samples)",
        )
    if d.get("continues", 0) and not ix.response(g).chained:
        return (
            "bad continuation",
            f"{where}: resumed from {d['continues']} tokens that no interrupted generate of this turn produced",
        )
    return None


def check_serving(ix: TraceIndex, r: Reasons, spec: TargetSpec) -> dict:
    """The serving traffic the run displaced kept its SLOs (the harness measured every request)."""
    record = ix.by_kind["serving"]
    if not spec.hardware.serving_pools:
        return {}
    if not record:
        r.add("serving SLO", "the run has no record of its serving pool's traffic")
        return {}
    s = record[-1].data
    for what in ("ttft", "tpot"):
        if not s[f"{what}_p99_s"] <= s[f"{what}_slo_s"]:
            r.add(
                "serving SLO",
                f"the serving traffic's p99 {what.upper()} was {s[f'{what}_p99_s'] * 1e3:.0f} ms, over its SLO "
                f"of {s[f'{what}_slo_s'] * 1e3:.0f} ms ({s['requests']} requests; serving devices lent to "
                f"rollout for {s['lent_device_s']:.0f} device-seconds)",
            )
    return {"serving_ttft_p99_s": s["ttft_p99_s"], "serving_tpot_p99_s": s["tpot_p99_s"]}


def check_verdicts(ix: TraceIndex, r: Reasons) -> dict:
    """With a reward model, a reward is the judge's: each trained trajectory that ended well (not timed
    out, not lost) has one verdict, asked when its last step ended, on its whole context, and in before
    the training step (or its part) took it (a stack that guessed the reward could train sooner)."""
    if not ix.judged:
        return {}
    taken: dict[str, float] = {}  # episode -> when its first training step (or part) took it
    for train in ix.trains:
        for t in train.data["trajectories"]:
            taken.setdefault(t["episode"], consumed_at(train, t))
    for episode, steps_in in ix.trained_in.items():
        if not ix.finished(episode):
            continue  # not an environment's episode: exactly-once and fidelity say so
        end = ix.env_steps[episode][-1]
        if end.data["timed_out"] or end.data["lost"]:
            continue  # nothing to judge: the harness pays no reward for it
        judged = ix.verdicts.get(episode, [])
        if len(judged) != 1:
            r.add("reward verdict", f"episode {episode} was trained on with {len(judged)} verdicts of the reward model")
            continue
        (verdict,) = judged
        context = token_count(ix.context_tokens(episode, len(ix.env_steps[episode])))
        if verdict.data["tokens"] != context or abs(verdict.data["start"] - end.t) > 1e-6:
            r.add(
                "reward verdict",
                f"episode {episode}: the verdict read {verdict.data['tokens']} tokens asked at "
                f"{verdict.data['start']:.3f} s, not its whole context of {context} as its last step ended "
                f"at {end.t:.3f} s",
            )
        if verdict.t > taken[episode]:
            r.add(
                "reward verdict",
                f"episode {episode} was trained on by step {steps_in[0] + 1} at {taken[episode]:.3f} s, "
                f"before the reward model's verdict at {verdict.t:.3f} s",
            )
    check_reward_devices(ix, r)
    return {"verdicts": len(ix.by_kind["reward"])}


def check_reward_devices(ix: TraceIndex, r: Reasons) -> None:
    """The devices a stack set aside for a dedicated judge (its hello's ``reward_devices``) never roll
    out, train, sync or take an engine: the harness refuses the placement at hello, and a real
    cluster's calls are held to it here (a simulated one refuses them as they come)."""
    start = ix.by_kind["run_start"]
    reserved = set((start[0].data.get("engine") or {}).get("reward_devices", ())) if start else set()
    if not reserved:
        return
    for e in ix.events:
        if e.kind == "generate" and e.data.get("device") in reserved:
            used = [e.data["device"]]
        elif e.kind in ("train", "train_part", "sync", "expand", "shrink"):
            used = sorted(reserved & set(e.data["devices"]))
        else:
            continue
        if used:
            r.add(
                "reward device used",
                f"{e.kind} at {e.t:.3f} s on {used}, set aside for the reward model (reward_devices)",
            )
            return


def audit_run(
    spec: TargetSpec,
    events: list[TraceEvent],
    load_weights: Callable[[int], StateDict | None],
    make_model: Callable[[StateDict], torch.nn.Module],
    steps: int,
    seed: int = 0,
    workload: RunSeed | None = None,
) -> CheckResult:
    """``seed`` picks the turns the replay samples; ``workload``: what the run's episodes were drawn from
    (its seed and secret key), so the selection net can compare them by their own draws."""
    started = time.monotonic()
    ix = TraceIndex.of(events, judged=spec.workload.reward_model is not None)
    r = Reasons()
    log.info("auditing %d events: %d turns, %d train steps", len(events), len(ix.by_kind["generate"]), len(ix.trains))
    check_exactly_once(ix, r)
    check_conservation(ix, r)
    check_drop_reasons(ix, r, spec)
    check_deferrals(ix, r)
    details = check_in_flight(ix, r, spec)
    check_batches(ix, r, spec)
    check_fidelity(ix, r)
    check_staleness(ix, r, spec)
    check_engine_honesty(ix, r, spec)
    check_partial_rollout(ix, r)
    check_partial_progress(ix, r)
    details.update(check_service_order(ix, r))
    details.update(check_version_timing(ix, r, decode_step_floor(spec)))
    draws = None if workload is None else WorkloadDraws(spec, workload, ix.relaunch_of, not ix.tokens_recorded)
    details.update(check_selection(ix, r, spec, draws))
    check_aborts(ix, r, spec)
    check_mechanism(ix, r, steps, spec)
    check_delivered_versions(ix, r)
    details.update(check_serving(ix, r, spec))
    details.update(check_verdicts(ix, r))
    replayable = check_replayable(ix, r, spec)
    details.update(
        episodes_created=len(ix.created),
        trained=len(ix.trained_in),
        dropped=dict(Counter(e.data["reason"] for e in ix.dropped.values())),
    )
    if not replayable:
        details["skipped"] = "tokens outside the vocabulary or sequences over the target's: no replay reads them"
    elif ix.tokens_recorded:
        from targets.harness.judge.replay import replay_training, replay_turns

        seconds = {"invariants": time.monotonic() - started}
        replayed = time.monotonic()
        details.update(replay_turns(ix, r, spec, load_weights, make_model, seed))
        seconds["turn_replay"] = time.monotonic() - replayed
        replayed = time.monotonic()
        details.update(replay_training(ix, r, spec, load_weights, make_model))
        seconds["training_replay"] = time.monotonic() - replayed
        details["audit_seconds"] = seconds  # where a slow audit spends its time (a GPU check ran out of it)
    else:
        details["skipped"] = "simulated run: no tokens or weights recorded, so no replay"
    return CheckResult("system_audit", not r.lines(), r.lines(), details)


def audit_directory(
    target: Target, out: Path, steps: int, seed: int | None = None, workload: RunSeed | None = None
) -> CheckResult:
    """The audit of a run the harness child wrote to ``out`` (trace and weight snapshots). Where the
    replay samples turns, ``seed`` (default: drawn now, once the run can no longer act) picks them, so
    no candidate can know in advance which turns are checked; the details name it for a re-audit.
    ``workload``: the run's own seed and key (``audit_run``)."""
    from targets.harness.ipc.weight_export import load_snapshot

    events = Trace.load_events(out / "trace.jsonl")
    base: list = []  # loaded on the first replay only (a simulated run replays nothing)

    def load_weights(version: int):
        path = out / "weights" / f"v{version}.safetensors"
        return load_snapshot(path) if path.exists() else None

    def make_model(state):
        if not base:
            base.append(target.reference_model())
        model = copy.deepcopy(base[0])
        model.load_state_dict(state)
        return model

    return audit_run(
        target.spec, events, load_weights, make_model, steps, secrets.randbits(63) if seed is None else seed, workload
    )
