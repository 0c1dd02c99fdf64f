"""The selection net: what a stack trained against everything it launched, whichever rule let it drop,
defer or cancel the rest (``selection.py`` has those rules, and those for restarts, which it does not see:
it reads the actions the environments got). Tasks, members and rewards, each by
its own bound; lengths at each episode's progress and by what the harness drew for it (``draws.py``)
(docs/judge.md)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

from targets.api import Declared
from targets.harness.judge.mechanism import wakes
from targets.harness.judge.trace_index import Reasons, TraceIndex
from targets.harness.trace import token_count
from targets.spec import TargetSpec

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
    def of(cls, declared: Declared, spec: TargetSpec, ix: TraceIndex | None = None) -> SelectionBounds:
        """The allowances ``declared`` pays for; with the run's index ``ix``, only as far as the run used
        them: the spares its groups launched (their mean, at most the declared), the tail's only where a
        group was deferred. A declaration alone bought room for a choice the run never had to make (a
        red team's stack declared a group's worth of spares and launched none)."""
        accuracy, spares, tail = spec.accuracy, declared.redundant_per_group, bool(declared.tail_round)
        if ix is not None:
            size = spec.workload.group_size
            launched = [max(0, len(members) - size) for members in ix.members.values()]
            spares = min(spares, statistics.fmean(launched)) if launched else 0
            tail = tail and any(e.data["reason"] == "deferred" for e in ix.dropped.values())

        def given(value: float | None, default: float) -> float:
            return default if value is None else value

        return cls(
            tasks=given(accuracy.selection_task_shortfall, TASK_SHORTFALL),
            members=given(
                accuracy.selection_member_shortfall,
                MEMBER_SHORTFALL_BASE + MEMBER_SHORTFALL_PER_SPARE * spares + (MEMBER_SHORTFALL_TAIL if tail else 0.0),
            ),
            reward=given(
                accuracy.selection_bias,
                REWARD_BIAS_BASE + REWARD_BIAS_PER_SPARE * spares + (REWARD_BIAS_TAIL if tail else 0.0),
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


def passed_over(ix: TraceIndex, untrained: set[str], group_size: int) -> set[str]:
    """Of the ``untrained`` groups, those that had ``group_size`` members finished before the last batch
    was taken (a step's first part, with stream training): ready, and passed over."""
    last_take = max((ix.taken_from(train) for train in ix.trains), default=-math.inf)

    def complete_before(group: str) -> bool:
        finishes = sorted(t for m in ix.members[group] if (t := ix.finished_at(m)) is not None)
        return len(finishes) >= group_size and finishes[group_size - 1] < last_take

    return {group for group in untrained if complete_before(group)}


# A member a stack stopped stepping and held until the run ended is dropped as ``end_of_run`` like one the end
# cut off mid-turn. The controller link counts the time each unfinished episode sat with nothing under way (no
# generate request, no environment call) while some other episode's request was (``held_s``: a pause of the
# whole rollout, a stack not sampling while it trains, holds no one), and the time over its life any request
# was (``serving_s``). The kit's stacks: 0 on the simulator (a reply's next request comes at once in virtual
# time), at most 0.09 s on the real CPU target (the controller's turnaround), unless they queue turns in the
# controller (KV admission, ``route_admit``). Held over 5% of the time the engines served during its life (and
# a second, for a loaded machine), its group was left by the stack, not by the end: it counts whole, and the
# net judges whether what the stack held favoured the short (the kit's admission, longest first, did not).
# A request under way is no proof of work in a real run, whose cluster is the candidate's: one it accepts and
# never serves keeps its episode under way. A member whose request had been under way at its drop over twice
# as long as any request the run answered took was held the same way (a request forwarded to an engine asleep
# took the time from the engine's wake: one parked on an engine kept shrunk would otherwise set the bar).
HELD_SHARE = 0.05
HELD_MIN_S = 1.0
WAITING_FACTOR = 2.0


def held_back(ix: TraceIndex, untrained: set[str], group_size: int) -> set[str]:
    """Of the ``untrained`` groups, those a member of which the stack held: it sat unfinished with nothing
    under way while others generated for over ``HELD_SHARE`` of the time they did in its life, or its request
    had been under way over ``WAITING_FACTOR`` times the longest any answered request took. A member never
    started counts where a sibling was and the group had fewer than ``group_size`` started (a stack that
    starts one member of each task, and never the others of those its first turn shows long, holds them)."""
    woke = wakes(ix)  # a request forwarded to an engine asleep took its time from the wake
    answered = (
        g.t - max(g.data["start"], woke(g.data.get("device"), g.data["start"]))
        for served in ix.generated.values()
        for g in served
    )
    waited_too_long = max(HELD_MIN_S, WAITING_FACTOR * max(answered, default=0.0))

    def held(episode: str) -> bool:
        drop = ix.dropped.get(episode)
        if drop is None or "held_s" not in drop.data:  # a trace recorded before the harness counted it
            return False
        if episode not in ix.resets:
            started = sum(m in ix.resets for m in ix.members[ix.group_of[episode]])
            if started == 0 or started >= group_size:  # a task never begun, or a spare left unneeded: not held
                return False
        return (
            drop.data["held_s"] > max(HELD_MIN_S, HELD_SHARE * drop.data["serving_s"])
            or drop.data.get("waiting_s", 0.0) > waited_too_long
        )

    return {group for group in untrained if any(held(m) for m in ix.members[group])}


def check_selection(ix: TraceIndex, r: Reasons, spec: TargetSpec, draws: Draws | None = None) -> dict:
    """Every way to drop, defer or cancel work is a way to choose which samples train. Each has its rule
    (``selection.py``); this is the net over all of them, against every episode launched (an
    unfinished one at its progress, which it was at least; a group the run's end alone left untrained
    aside, since nothing could train it): the
    tasks trained against the tasks launched (a deferred task and its
    relaunch are one), the members trained against every member of the groups trained, in turns and
    response tokens, and the rewards trained against every finished episode's. ``draws``: what the
    harness drew, so the members and the tasks (by their members' mean) are compared by the turns they
    drew and, in a simulated run, by their tokens over those turns, and the tasks by their mean tokens a
    turn: by what they are, not by how far the stack let them run (a spare cancelled early, or a task held
    back until it went stale, would look short)."""
    bounds = SelectionBounds.of(ix.declared, spec, ix)
    details: dict = {
        "selection_task_bound": bounds.tasks,
        "selection_member_bound": bounds.members,
        "selection_reward_bound": bounds.reward,
    }
    # A group goes whole: one of its members trained, or handed back for another reason than the run's end
    # (stale, deferred, too long), and every member counts; one held to the end beside them was passed over,
    # not cut off (else a stack could train or drop one member of a task and hold the others to the end).
    # So does a group complete when a batch was taken without it, or one a member of which the stack stopped
    # stepping: the stack, not the end, left it untrained.
    handed_back_at_the_end = {
        group
        for group, members in ix.members.items()
        if all(m in ix.dropped and ix.dropped[m].data["reason"] in RUN_END_REASONS for m in members)
    }
    left_by_stack = {
        "passed_over": passed_over(ix, handed_back_at_the_end, spec.workload.group_size),
        "held": held_back(ix, handed_back_at_the_end, spec.workload.group_size),
    }
    for how, groups in left_by_stack.items():
        details[f"selection_groups_{how}"] = len(groups)
    left_by_the_end = handed_back_at_the_end - set().union(*left_by_stack.values())
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
