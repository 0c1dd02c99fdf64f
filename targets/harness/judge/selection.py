"""The audit's rules for work that is dropped, deferred, cancelled or resumed: each is a way to choose
which samples train, so each has its rule (a drop's reason must hold when it is made, a deferral only of
a group that waited a whole step, a partial is what the request decoded), and the selection net
(``selection_net.py``) nets the drops, deferrals and cancellations: the tasks and members trained against
every episode launched. Interruptions, how a stack restarts, have theirs in ``interruptions.py``
(docs/judge.md)."""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict

from targets.api import TraceEvent
from targets.harness.judge.interruptions import interruptions
from targets.harness.judge.trace_index import ABORT_SLACK_S, Reasons, TraceIndex
from targets.harness.trace import token_count
from targets.spec import TargetSpec


def check_drop_reasons(ix: TraceIndex, r: Reasons, spec: TargetSpec) -> None:
    """Each drop's reason must hold when it was made. Staleness is judged per group, as a buffer
    that trains whole groups must: a group with one member beyond the bound goes whole."""
    workload, bound = spec.workload, spec.workload.staleness_bound(ix.declared)
    last_train_end = max((t.t for t in ix.trains), default=None)
    redundant = Counter()
    for episode, e in ix.dropped.items():
        reason = e.data["reason"]
        if reason == "end_of_run":
            if last_train_end is not None and e.t < last_train_end:
                r.add(
                    "unjustified drop",
                    f"episode {episode} dropped as end_of_run at {e.t:.2f}s, before the last training step",
                )
        elif reason == "stale":
            policy = ix.policy_at(e.t)
            group = ix.group_of.get(episode)
            # a stack that resumes interrupted turns trains what their segments decoded: those count too
            resumed = ix.partials if ix.declared.partial_rollout else {}
            versions = [
                v
                for m in ix.members.get(group, [])
                for g in [*ix.generated.get(m, []), *resumed.get(m, [])]
                if g.t <= e.t
                for v in ix.response(g).versions
            ]
            if not versions or policy - min(versions) <= bound:
                r.add(
                    "unjustified drop",
                    f"episode {episode} dropped as stale but every turn of its group is within "
                    f"async_ratio {bound} of policy {policy}",
                )
            elif trained := [m for m in ix.members.get(group, []) if m in ix.trained_in]:
                # A group goes stale whole: dropping some members as stale and training the others would
                # let a stack keep one member old on purpose and drop, with it, the siblings it dislikes.
                r.add(
                    "unjustified drop",
                    f"episode {episode} dropped as stale while {trained[0]} of its group {group} trained: "
                    "a group with a stale turn goes whole",
                )
        elif reason == "max_sequence":
            if episode not in ix.resets:
                r.add("unjustified drop", f"episode {episode} dropped for max_sequence before it was reset")
                continue
            finished = ix.finished_at(episode)
            if finished is not None and finished <= e.t:  # it ended: nothing more was to be generated
                r.add(
                    "unjustified drop",
                    f"episode {episode} dropped for max_sequence at {e.t:.2f}s, after it had finished "
                    f"({finished:.2f}s)",
                )
                continue
            length = token_count(ix.context_tokens(episode, len(ix.env_steps.get(episode, []))))
            if length + workload.tokens.response <= workload.tokens.max_sequence:
                r.add(
                    "unjustified drop",
                    f"episode {episode} dropped for max_sequence at {length} tokens, which still fits",
                )
        elif reason == "redundant":
            group = ix.group_of.get(episode)
            redundant[group] += 1
            finished_before = sum(
                1 for m in ix.members.get(group, []) if m != episode and (ix.finished_at(m) or math.inf) <= e.t
            )
            if ix.declared.redundant_per_group == 0:
                r.add(
                    "unjustified drop", f"episode {episode} dropped as redundant, but the stack declares no redundancy"
                )
            elif finished_before < workload.group_size:
                r.add(
                    "unjustified drop",
                    f"episode {episode} dropped as redundant at {e.t:.2f}s, when only {finished_before} of its "
                    f"group {group} had finished (a group needs {workload.group_size})",
                )
            else:
                # A spare is a member the group did not need: one still running when ``group_size`` of
                # the others had finished, or finishing with the last of them. Dropping an earlier finisher
                # instead (the first, or the last of the first ``group_size``) picks, after the fact, which
                # members train (the lowest rewards, say).
                others = sorted(
                    t for m in ix.members.get(group, []) if m != episode and (t := ix.finished_at(m)) is not None
                )
                own, complete = ix.finished_at(episode), others[workload.group_size - 1]
                if own is not None and own < complete:
                    r.add(
                        "unjustified drop",
                        f"episode {episode} finished at {own:.2f}s, before {workload.group_size} other members of "
                        f"its group {group} had ({complete:.2f}s), and was dropped as redundant: a spare is a member "
                        "the group did not need, not one picked once all had finished",
                    )
        elif reason == "deferred":
            group = ix.group_of.get(episode)
            finished = sum(1 for m in ix.members.get(group, []) if (ix.finished_at(m) or math.inf) <= e.t)
            if not ix.declared.tail_round:
                r.add(
                    "unjustified drop", f"episode {episode} dropped as deferred, but the stack declares no tail_round"
                )
            elif group in ix.relaunch_of:
                r.add("deferral", f"episode {episode} dropped as deferred, but its group {group} was itself a relaunch")
            elif finished >= workload.group_size:
                r.add(
                    "unjustified drop",
                    f"episode {episode} dropped as deferred at {e.t:.2f}s, when its group {group} had "
                    f"{finished} finished members: only an unfinished group may be deferred",
                )
            elif not any(
                ix.created_at.get(group, math.inf) <= ix.taken_from(t) and t.data["start"] < e.t for t in ix.trains
            ):
                # Deferring a group that has not waited through a whole step picks which episodes train:
                # on a real run the relaunch redraws them, so deferring early is resampling the long ones.
                # A group launched the instant a batch was taken waited through that step: under virtual time
                # the last group's finish refills and takes the batch at one instant (the static split's).
                r.add(  # a kind of its own: the examples of other unjustified drops never hide it
                    "early deferral",
                    f"episode {episode} dropped as deferred at {e.t:.2f}s, but its group {group} was launched at "
                    f"{ix.created_at.get(group, math.nan):.2f}s and no batch was taken between: only a group that "
                    "waited through a whole step may be deferred",
                )
    for group, count in redundant.items():
        if ix.declared.redundant_per_group and count > ix.declared.redundant_per_group:
            r.add(
                "redundancy",
                f"group {group} dropped {count} episodes as redundant, over the declared "
                f"{ix.declared.redundant_per_group} per group",
            )


def check_deferrals(ix: TraceIndex, r: Reasons) -> None:
    """A deferred group goes whole, and its task runs again once: deferral may postpone a task the
    stack finds long, never discard it (at most ``tail_round - 1`` wait unrelaunched at the end). A
    stale group's task may run again too; a relaunch is never relaunched."""
    deferred = {ix.group_of.get(episode) for episode, e in ix.dropped.items() if e.data["reason"] == "deferred"}
    for group in sorted(deferred, key=lambda g: ix.group_order.get(g, 0)):
        kept = [
            m
            for m in ix.members.get(group, [])
            if ix.dropped.get(m) is None or ix.dropped[m].data["reason"] != "deferred"
        ]
        if kept:
            r.add("deferral", f"group {group} was deferred in part: {kept[0]} was not dropped as deferred")
    # A stale drop may postpone its task as a deferral does (the long tasks are the ones that go stale):
    # either kind of group may run again, once, and only after it was handed back whole (a relaunch
    # while a member still ran would be two draws of one task at once, the stack free to keep either).
    postponing = ("deferred", "stale")
    postponed = {  # a drop of an episode never created is a reason of its own (conservation), not a group's
        ix.group_of[episode]
        for episode, e in ix.dropped.items()
        if e.data["reason"] in postponing and episode in ix.group_of
    }
    # when each was handed back: its last member's drop, whatever the reason (a member still running, dropped
    # later as end_of_run or redundant, was not handed back)
    postponed_at: dict[str, float] = {}
    for group in postponed:
        members = ix.members.get(group, [])
        undropped = [m for m in members if m not in ix.dropped]
        postponed_at[group] = math.inf if undropped else max(ix.dropped[m].t for m in members)
    relaunches = Counter(ix.relaunch_of.values())
    for group, count in relaunches.items():
        if group not in postponed_at:
            r.add("deferral", f"a group relaunched {group}, which was never deferred or dropped as stale")
        elif group in ix.relaunch_of:
            r.add("deferral", f"a group relaunched {group}, which was itself a relaunch")
        elif count > 1:
            r.add("deferral", f"postponed group {group}'s task was relaunched {count} times")
    for again, group in ix.relaunch_of.items():
        if group in postponed_at and ix.created_at[again] < postponed_at[group]:
            back = f"{postponed_at[group]:.2f}s" if postponed_at[group] < math.inf else "a member was never dropped"
            r.add(
                "deferral",
                f"group {again} relaunched {group}'s task at {ix.created_at[again]:.2f}s, before {group} was handed "
                f"back whole ({back})",
            )
    # Deferred in the last step with nothing launched after it: no relaunch could have been trained,
    # so these go uncounted, as end_of_run drops would.
    last_step_from = ix.trains[-2].t if len(ix.trains) >= 2 else math.inf
    last_created = max((e.t for e in ix.by_kind["episode_created"]), default=-math.inf)

    def too_late(group: str) -> bool:
        at = min(ix.dropped[m].t for m in ix.members.get(group, []) if m in ix.dropped)
        return at >= last_step_from and at >= last_created

    # A relaunch made once the last training step has ended runs nothing that could be trained: its
    # task waits as much as one never relaunched (else a stack could defer every slow group and, at
    # the end, relaunch each and drop it at once as end_of_run).
    last_train_end = max((t.t for t in ix.trains), default=math.inf)
    ran_again = {task for group, task in ix.relaunch_of.items() if ix.created_at[group] < last_train_end}
    waiting = [g for g in deferred if g not in ran_again and not too_late(g)]
    if len(waiting) > max(0, ix.declared.tail_round - 1):
        r.add(
            "deferral",
            f"{len(waiting)} deferred groups' tasks never ran again (e.g. {sorted(waiting)[0]}); a stack with "
            f"tail_round {ix.declared.tail_round} may leave at most {max(0, ix.declared.tail_round - 1)}",
        )


def check_partial_rollout(ix: TraceIndex, r: Reasons) -> None:
    """Resuming is declared, and then total: every turn's segments form one chain, its last segment's
    (the finished one, else the last to end). A stack that resumed some interrupted turns and restarted
    others could keep the partial responses it likes and resample the rest; one that resumed a partial
    twice could plant a junk branch before each real token (a dropped spare's, in a red team's copy) for
    the independence test to guess. Every episode's turns, trained or not."""
    for episode in sorted(set(ix.generated) | set(ix.partials)):
        turns: dict[int, list[TraceEvent]] = defaultdict(list)
        for g in [*ix.generated.get(episode, []), *ix.partials.get(episode, [])]:
            turns[g.data["turn"]].append(g)
        for turn, segments in sorted(turns.items()):
            if not ix.declared.partial_rollout:
                if any(g.data.get("continues", 0) for g in segments):
                    r.add(
                        "undeclared continuation",
                        f"episode {episode} turn {turn} resumed an interrupted response, but the stack does not "
                        "declare partial_rollout",
                    )
                continue
            finished = [g for g in segments if not g.data["aborted"]]
            last = finished[0] if finished else max(segments, key=lambda g: g.t)
            chain = {id(s) for s in ix.response(last).segments}
            for a in segments:
                if a.data["aborted"] and token_count(a.data["tokens"]) and id(a) not in chain:
                    r.add(
                        "discarded partial",
                        f"episode {episode} turn {turn}: {token_count(a.data['tokens'])} interrupted tokens "
                        "were discarded or resumed twice (partial_rollout resumes every one, once)",
                    )


# An engine receives a cluster's requests a little after the harness stamps them (the cluster process
# serves calls concurrently). Order slack for the partial-progress rule: a request stamped this much
# later than another reached the engine after it. Over the 95 honest runs of
# benchmarks/judge_false_alarms.py (1,270 interrupted requests, 217 of them with nothing decoded) no
# request the same engine received later had decoded a token before an empty one was interrupted, at
# any slack (the harness forwards calls in the order it stamps them; a cluster and its actors keep
# it); the interrupted requests of the CPU target run 10-30 ms, so the slack must be small.
ORDER_SLACK_S = 0.0005


def check_partial_progress(ix: TraceIndex, r: Reasons) -> None:
    """With ``partial_rollout`` an interrupted request's partial is what it decoded, and the turn
    resumes from it: a cluster that reports an empty partial for a request it had decoded restarts
    the turn from scratch, choosing which responses it keeps. Engines admit requests in the order they
    arrive and preempt the youngest first (``targets.api.Aborted``), so once a request the same engine
    received later has produced a token, an earlier one has too: an empty partial after that is a
    reason. Real runs only (a simulated engine is the harness's). An engine that prefills a long prompt
    in chunks across steps while admitting later short ones could decode those first: with long
    prompts, such an engine should report its partials honestly or not declare ``partial_rollout``."""
    if not ix.declared.partial_rollout or not ix.tokens_recorded:
        return
    by_engine: dict[str, list[TraceEvent]] = defaultdict(list)
    for gs in [*ix.generated.values(), *ix.partials.values()]:
        for g in gs:
            by_engine[ix.engine(g.data["device"])].append(g)
    for g in ix.by_kind["generate"]:
        if g.data["aborted"] and "tokens" not in g.data and g.data.get("device"):
            by_engine[ix.engine(g.data["device"])].append(g)
    causes = interruptions(ix, ABORT_SLACK_S)
    for engine, requests in by_engine.items():
        requests.sort(key=lambda g: g.data["start"])
        starts = [g.data["start"] for g in requests]
        # From index i on: the earliest completion of one that decoded (its token came before it)
        completed_by = [math.inf] * (len(requests) + 1)
        for i in range(len(requests) - 1, -1, -1):
            b = requests[i]
            done = not b.data["aborted"] and token_count(b.data.get("tokens", [])) > 0
            completed_by[i] = min(completed_by[i + 1], b.t if done else math.inf)
        # Per interruption, the latest-received request it cut short that had decoded a token (the
        # interruption cut every request on its engine at once: their replies come in any order)
        latest_decoding: dict[int, float] = {}
        for b in requests:
            cause = causes.get(id(b))
            if b.data["aborted"] and cause is not None and token_count(b.data.get("tokens", [])) > 0:
                latest_decoding[cause] = max(latest_decoding.get(cause, -math.inf), b.data["start"])
        for a in requests:
            if not a.data["aborted"] or token_count(a.data.get("tokens", [])) > 0:
                continue
            later = bisect.bisect_right(starts, a.data["start"] + ORDER_SLACK_S)
            cause = causes.get(id(a))
            interrupted_later = (
                cause is not None and latest_decoding.get(cause, -math.inf) > a.data["start"] + ORDER_SLACK_S
            )
            if completed_by[later] <= a.t or interrupted_later:
                r.add(
                    "empty partial",
                    f"episode {a.data['episode']} turn {a.data['turn']} was interrupted on {engine} at {a.t:.2f}s "
                    f"with no token decoded, after a request that engine received later had decoded one "
                    f"(engines serve in arrival order): the partial was discarded, and the turn resampled",
                )
