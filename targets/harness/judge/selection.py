"""The audit's rules for work that is dropped, deferred, cancelled or restarted: each is a way to
choose which samples train, so each has its rule (a drop's reason must hold when it is made, a
deferral only of a group that waited a whole step, a partial is what the request decoded, an abort
has its cause), and ``check_selection`` nets them all: the tasks and members trained against every
episode launched (docs/judge.md)."""

from __future__ import annotations

import bisect
import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Protocol

from targets.api import Declared, TraceEvent
from targets.harness.judge.trace_index import ABORT_SLACK_S, Reasons, TraceIndex, staleness_bound
from targets.harness.trace import token_count
from targets.spec import TargetSpec


def check_drop_reasons(ix: TraceIndex, r: Reasons, spec: TargetSpec) -> None:
    """Each drop's reason must hold when it was made. Staleness is judged per group, as a buffer
    that trains whole groups must: a group with one member beyond the bound goes whole."""
    workload, bound = spec.workload, staleness_bound(ix, spec)
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
            versions = [
                v
                for m in ix.members.get(group, [])
                for g in ix.generated.get(m, [])
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
                # A spare is a member the group did not need: one still running when the group had
                # ``group_size`` finished, or finishing with the last of them. Dropping an earlier
                # finisher instead picks, after the fact, which members train (the lowest rewards, say).
                finishes = sorted(t for m in ix.members.get(group, []) if (t := ix.finished_at(m)) is not None)
                own, complete = ix.finished_at(episode), finishes[workload.group_size - 1]
                if own is not None and own < complete:
                    r.add(
                        "unjustified drop",
                        f"episode {episode} finished at {own:.2f}s, before its group {group} had "
                        f"{workload.group_size} finished ({complete:.2f}s), and was dropped as redundant: a spare "
                        "is a member the group did not need, not one picked once all had finished",
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
                ix.created_at.get(group, math.inf) < ix.taken_from(t) and t.data["start"] < e.t for t in ix.trains
            ):
                # Deferring a group that has not waited through a whole step picks which episodes train:
                # on a real run the relaunch redraws them, so deferring early is resampling the long ones.
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
    postponed = {ix.group_of.get(episode) for episode, e in ix.dropped.items() if e.data["reason"] in postponing}
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
    """Resuming is declared, and then total: a stack that resumed some interrupted turns and
    restarted others could keep the partial responses it likes and resample the rest."""
    for episode in ix.trained_in:
        for g in ix.generated.get(episode, []):
            response, turn = ix.response(g), g.data["turn"]
            if len(response.segments) > 1 and not ix.declared.partial_rollout:
                r.add(
                    "undeclared continuation",
                    f"episode {episode} turn {turn} resumed an interrupted response, but the stack does not "
                    "declare partial_rollout",
                )
            if ix.declared.partial_rollout:
                for a in ix.partials.get(episode, []):
                    if a.data["turn"] == turn and token_count(a.data["tokens"]) and a not in response.segments:
                        r.add(
                            "discarded partial",
                            f"episode {episode} turn {turn}: {token_count(a.data['tokens'])} interrupted tokens "
                            "were discarded and the turn generated anew (partial_rollout resumes every one)",
                        )


# The selection audit's allowances (docs/judge.md). Lengths are long-tailed (on the paper-scale target a
# standard deviation of response tokens exceeds their mean, so an allowance counted in them allowed any
# shortfall at all): they are judged as a fraction of the mean launched. Two choices are told apart.
# Which *tasks* train: no technique chooses them by design (tail batching relaunches the tasks it
# defers; a spare changes which members train, not which tasks), but at paper scale the long tasks are
# the ones that go stale: the time_multiplex starter alone favoured the short tasks by 1.6-13.5% in
# response tokens over 11 seeds when a stale drop discarded its task (at most 4% on the CPU target, 30
# runs of the starters and techniques), spares alone 7-12%, tail batching alone 5-7%. The kit's stacks
# now run a stale task again, once: over ten steps that halves the starter's shortfall (6.1-8.2% ->
# 2.6-4.3%), but a measured run of three steps ends before most relaunched long tasks finish (1.4-9.6%
# -> 3.1-10.7%), so the bound stays above the starter's; what composing techniques did (the goodput
# search's best: 19-27%) is mostly over it. Which *members* of a trained group train: only spares choose
# (the first ``group_size`` to finish), 10-14% for two and 18% for four at their progress (CPU and
# paper-scale targets); by every turn the harness drew for each member (a simulated target), which a
# cancelled spare is judged by, 29-31% for two and 44-45% for four at paper scale over ten steps: there
# the bound rejects keeping the first finishers as the selection it is.
# Reward is bounded: its bias is counted in standard deviations of the finished episodes' rewards (an
# unfinished episode's reward is unknown, not 0); honest stacks, spares and tail batching included,
# stayed within -0.03 and 0.05 of them (a spare may not be chosen by its reward: the rule for
# ``redundant`` above). A deferred task whose relaunch had not finished when the run ended counts as
# launched and untrained: a measured run that pushes its long tasks past its end favours the short ones
# as one that drops them. Measurements: benchmarks/results/judge-selection.yaml. A target may set each
# bound (``accuracy.selection_*``).
TASK_SHORTFALL = 0.20


# A relaunch's members are judged with those of the group it ran again, whose draw went stale or was
# deferred for running long: its second draw trains shorter. Measured over ten steps at paper scale: the
# starter (stale tasks run again) 1.0-2.6% in response tokens, tail_round 8 1.7-5.7%, two spares
# 15.3-17.1% (against 13-14% before relaunches counted).
MEMBER_SHORTFALL_BASE = 0.07


# A member a relaunch stands in for counts at most this many times the mean of the relaunch's trained
# members: the draw that went stale is the long one by the very rule that dropped it, so on a small run
# one honest relaunch among 16 groups read 7-8% (its four first members 2.4x its trained ones), while a
# stack that redraws the groups it dislikes still shows their excess up to the cap (planted).
RELAUNCHED_MEMBER_CAP = 1.5


MEMBER_SHORTFALL_PER_SPARE = 0.06


MEMBER_SHORTFALL_TAIL = 0.05


REWARD_BIAS_BASE = 0.25


REWARD_BIAS_PER_SPARE = 0.05


REWARD_BIAS_TAIL = 0.05


@dataclass(frozen=True)
class SelectionBounds:
    """How much the trained may be favoured: shorter tasks and shorter members (fractions of the
    launched mean), better rewarded (standard deviations)."""

    tasks: float
    members: float
    reward: float

    @classmethod
    def of(cls, declared: Declared, spec: TargetSpec) -> SelectionBounds:
        accuracy, spares = spec.accuracy, declared.redundant_per_group

        def given(value: float | None, default: float) -> float:
            return default if value is None else value

        return cls(
            tasks=given(accuracy.selection_task_shortfall, TASK_SHORTFALL),
            members=given(
                accuracy.selection_member_shortfall,
                MEMBER_SHORTFALL_BASE
                + MEMBER_SHORTFALL_PER_SPARE * spares
                + (MEMBER_SHORTFALL_TAIL if declared.tail_round else 0.0),
            ),
            reward=given(
                accuracy.selection_bias,
                REWARD_BIAS_BASE + REWARD_BIAS_PER_SPARE * spares + (REWARD_BIAS_TAIL if declared.tail_round else 0.0),
            ),
        )


# A shortfall is rejected only beyond chance too: a run of a few tasks (a small simulated target's ten)
# leaves one long task out by luck as often as not. How far a random choice of the trained subset
# strays, in standard errors of its mean (sampling without replacement).
SELECTION_CHANCE_SE = 3.0


def shortfall_of(kept: list[float], every: list[float], bound: float) -> tuple[float, float]:
    """How much shorter ``kept`` (a subset of ``every``) is, as a fraction of ``every``'s mean, and the
    shortfall allowed: the bound, or what a random subset of that size reaches by chance if more."""
    mean = statistics.fmean(every)
    if not mean:
        return 0.0, bound
    n, k = len(every), len(kept)
    chance = statistics.pstdev(every) / mean * math.sqrt((n - k) / (k * (n - 1))) if 0 < k < n else 0.0
    return 1 - statistics.fmean(kept) / mean, max(bound, SELECTION_CHANCE_SE * chance)


class Draws(Protocol):
    """What the harness drew for a run's episodes before any ran (``draws.WorkloadDraws``)."""

    def task_tokens_a_turn(self, task: str) -> float | None: ...

    def turns(self, episode: str) -> float | None: ...

    def response_tokens(self, episode: str) -> float | None: ...


# What a member handed back at the run's end, untrained with its whole group, was: nothing could train it
# (a spare dropped as its group completed, or a member still running).
RUN_END_REASONS = ("end_of_run", "redundant")


def check_selection(ix: TraceIndex, r: Reasons, spec: TargetSpec, draws: Draws | None = None) -> dict:
    """Every way to drop, defer, cancel or restart work is a way to choose which samples train. Each
    has its rule above; this is the net over all of them, against every episode launched (an
    unfinished one at its progress, which it was at least; a group the run's end alone left untrained
    aside, since nothing could train it): the
    tasks trained against the tasks launched (a deferred task and its
    relaunch are one), the members trained against every member of the groups trained, in turns and
    response tokens, and the rewards trained against every finished episode's. ``draws``: what the
    harness drew, so the members and the tasks (by their members' mean) are compared by the turns they
    drew and, in a simulated run, by their tokens over those turns, and the tasks by their mean tokens a
    turn: by what they are, not by how far the stack let them run (a spare cancelled early, or a task held
    back until it went stale, would look short)."""
    bounds = SelectionBounds.of(ix.declared, spec)
    details: dict = {
        "selection_task_bound": bounds.tasks,
        "selection_member_bound": bounds.members,
        "selection_reward_bound": bounds.reward,
    }
    # A group goes whole: one of its members trained, or handed back for another reason than the run's end
    # (stale, deferred, too long), and every member counts; one held to the end beside them was passed over,
    # not cut off (else a stack could train or drop one member of a task and hold the others to the end).
    left_by_the_end = {
        group
        for group, members in ix.members.items()
        if all(m in ix.dropped and ix.dropped[m].data["reason"] in RUN_END_REASONS for m in members)
    }
    judged = [e for e in ix.created if ix.group_of[e] not in left_by_the_end]
    trained = [e for e in judged if e in ix.trained_in]
    trained_groups = {ix.group_of[e] for e in trained}
    if len(trained) == len(judged) or len(trained) < 2:
        return details
    lengths = {
        "turns": {e: float(len(ix.env_steps.get(e, []))) for e in judged},
        "response tokens": {
            e: float(sum(token_count(x.data["action"]) for x in ix.env_steps.get(e, []))) for e in judged
        },
    }
    tasks: dict[str, list[str]] = defaultdict(list)
    groups: dict[str, list[str]] = defaultdict(list)
    for e in judged:
        group = ix.group_of[e]
        tasks[ix.relaunch_of.get(group, group)].append(e)
        groups[group].append(e)
    trained_tasks = [t for t, members in tasks.items() if any(m in ix.trained_in for m in members)]

    def judge_tasks(name: str, task_length: dict[str, float], how: str) -> None:
        trained_lengths = [task_length[t] for t in trained_tasks]
        shortfall, allowed = shortfall_of(trained_lengths, list(task_length.values()), bounds.tasks)
        details[f"selection_tasks_{name.replace(' ', '_')}"] = shortfall
        if shortfall > allowed:
            r.add(
                "selection",
                f"the {len(trained_tasks)} tasks trained are {shortfall:.0%} shorter in {name} than the {len(tasks)} "
                f"launched (mean {statistics.fmean(trained_lengths):.1f} against "
                f"{statistics.fmean(task_length.values()):.1f}, {how}), over the {allowed:.0%} allowed (any stack "
                f"may favour the short tasks by {bounds.tasks:.0%}; chance, {SELECTION_CHANCE_SE:g} standard errors)",
            )

    def of_tasks(length: dict[str, float]) -> dict[str, float]:
        """Each task's mean over the members it launched (a deferred task's and its relaunch's)."""
        return {t: statistics.fmean(length[m] for m in members) for t, members in tasks.items()}

    task_draw = {t: draws.task_tokens_a_turn(t) for t in tasks} if draws is not None else {}
    if task_draw and None not in task_draw.values():
        judge_tasks("drawn tokens a turn", task_draw, "a turn's mean by the harness's own draw")

    def judged_lengths(length: dict[str, float], group: str) -> list[float]:
        """A trained group's members' lengths. A relaunch draws its task's episodes anew: those of the
        group it ran again (stale or deferred) are members it stands in for, else a stack could hand back
        a group whose finished members it dislikes and train the second draw (each counted at most
        ``RELAUNCHED_MEMBER_CAP`` times the relaunch's trained mean)."""
        own = [length[m] for m in groups[group]]
        if group not in ix.relaunch_of:
            return own
        cap = RELAUNCHED_MEMBER_CAP * statistics.fmean(length[m] for m in groups[group] if m in ix.trained_in)
        return own + [min(length[m], cap) for m in groups.get(ix.relaunch_of[group], [])]

    spares = ix.declared.redundant_per_group

    def judge_members(name: str, length: dict[str, float], how: str) -> None:
        members = [x for g in trained_groups for x in judged_lengths(length, g)]
        kept = [length[m] for g in trained_groups for m in groups[g] if m in ix.trained_in]
        shortfall, allowed = shortfall_of(kept, members, bounds.members)
        details[f"selection_members_{name.replace(' ', '_')}"] = shortfall
        if shortfall > allowed:
            r.add(
                "selection",
                f"the {len(trained)} episodes trained are {shortfall:.0%} shorter in {name} than the {len(members)} "
                f"members of their groups and of those they ran again (mean {statistics.fmean(kept):.1f} against "
                f"{statistics.fmean(members):.1f}, {how}), "
                f"over the {allowed:.0%} allowed ({bounds.members:.0%} for {spares} spare{'' if spares == 1 else 's'} "
                f"a group; chance, {SELECTION_CHANCE_SE:g} standard errors)",
            )

    for name, length in lengths.items():
        judge_tasks(name, of_tasks(length), "an unfinished episode at its progress")
        judge_members(name, length, "an unfinished episode at its progress")
    drawn_by = (
        ()
        if draws is None
        else (
            ("drawn turns", draws.turns, "each at the turns the harness drew for it"),
            ("drawn response tokens", draws.response_tokens, "each over those turns"),
        )
    )
    for name, drawn, how in drawn_by:
        episode_draw = {e: drawn(e) for e in judged}
        if all(x is None for x in episode_draw.values()):
            continue  # not drawn in this run (the environment ends episodes by play; a real run's tokens)
        if None in episode_draw.values():
            raise ValueError(f"the harness's draws give {name} for some episodes and not others")
        judge_tasks(name, of_tasks(episode_draw), f"{how}, a task by its members' mean")
        judge_members(name, episode_draw, how)
    # finished: what the stack could know had ended (with a reward model, once its verdict came)
    finished = [ix.paid(e) for e in judged if ix.finished_at(e) is not None]
    spread = statistics.pstdev(finished) if len(finished) > 1 else 0.0
    if spread:
        kept_reward, finished_reward = statistics.fmean(ix.paid(e) for e in trained), statistics.fmean(finished)
        details["selection_reward"] = shift = (kept_reward - finished_reward) / spread
        if shift > bounds.reward:
            r.add(
                "selection",
                f"the {len(trained)} trained episodes are better rewarded than the {len(finished)} that finished by "
                f"{shift:.2f} standard deviations (mean {kept_reward:.2f} against {finished_reward:.2f}), over the "
                f"bound of {bounds.reward:.2f} for what the stack declares",
            )
    return details


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


def interruptions(ix: TraceIndex, slack: float) -> dict[int, int]:
    """Which call (a shrink, a suspend or an interrupting sync, by index) cut each interrupted request
    short: the first in progress on its engine when its reply came (``id`` of the event -> index)."""
    calls = ix.by_kind["shrink"] + ix.by_kind["suspend"] + [e for e in ix.by_kind["sync"] if e.data.get("interrupt")]
    spans = [({ix.engine(d) for d in e.data["devices"]}, e.data["start"], e.t) for e in calls]
    found: dict[int, int] = {}
    for g in ix.by_kind["generate"]:
        device = g.data.get("device")
        if not g.data["aborted"] or not device:
            continue
        for k, (engines, start, end) in enumerate(spans):
            if ix.engine(device) in engines and g.data["start"] <= end and start <= g.t <= end + slack:
                found[id(g)] = k
                break
    return found


def check_aborts(ix: TraceIndex, r: Reasons, spec: TargetSpec) -> None:
    """An interrupted request is one a shrink, a suspend or an interrupting sync cut short on the
    engine it ran on, while it was in flight: a cluster that aborts on its own could resample the turns
    it dislikes (the long ones, or those that missed the reward) and hand the controller only the ones
    it likes. So every abort names its engine (``Aborted.partial``, possibly empty), and a call in
    progress must cover that engine."""
    slack = ix.reply_slack(spec)
    calls = ix.by_kind["shrink"] + ix.by_kind["suspend"] + [e for e in ix.by_kind["sync"] if e.data.get("interrupt")]
    causes = [({ix.engine(d) for d in e.data["devices"]}, e.data["start"], e.t) for e in calls]
    for g in ix.by_kind["generate"]:
        if not g.data["aborted"]:
            continue
        where = f"episode {g.data['episode']} turn {g.data['turn']} was aborted at {g.t:.2f}s"
        device = g.data.get("device")
        if not device:
            r.add(
                "unexplained abort",
                f"{where} without naming the engine that served it (an Aborted carries its partial: what "
                "the engine decoded, possibly nothing, and where)",
            )
        elif not any(
            ix.engine(device) in engines and g.data["start"] <= end and start <= g.t <= end + slack
            for engines, start, end in causes
        ):
            r.add(
                "unexplained abort",
                f"{where} on {device} with no shrink, suspend or interrupting sync of it in progress",
            )
