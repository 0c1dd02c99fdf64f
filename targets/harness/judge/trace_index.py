"""The audit's view of a trace: every fact an invariant asks of it, computed once (``TraceIndex``),
how one turn's response was built from its segments (``Response``), and the reasons an audit
collects (``Reasons``)."""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field

from targets.api import MAX_SPECULATIVE_TOKENS, Declared, TraceEvent
from targets.harness.judge.decode_steps import fewest_steps
from targets.harness.trace import consumed_at, token_count
from targets.spec import TargetSpec

MAX_REASONS_PER_KIND = 3


class Reasons:
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


# Real runs: an abort's reply may reach the harness a little after the call that caused it returned
# (the engine answers the request and the call separately). Measured over 392 aborts in 107 real runs
# of the test suite on 2 cores: at most 18 ms late. A quarter second leaves room for a loaded machine
# and bounds what a cluster can do past a shrink's return: decode beside the trainer that long at most.
ABORT_SLACK_S = 0.25


@dataclass
class TraceIndex:
    """Everything the invariants ask of a trace, computed once."""

    events: list[TraceEvent]
    by_kind: dict[str, list[TraceEvent]] = field(default_factory=lambda: defaultdict(list))
    created: list[str] = field(default_factory=list)  # episodes in creation order
    group_of: dict[str, str] = field(default_factory=dict)
    members: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))  # group -> its episodes
    group_order: dict[str, int] = field(default_factory=dict)  # group -> creation rank
    relaunch_of: dict[str, str] = field(default_factory=dict)  # relaunched group -> the deferred group it reruns
    created_at: dict[str, float] = field(default_factory=dict)  # group -> when it was launched
    resets: dict[str, TraceEvent] = field(default_factory=dict)
    env_steps: dict[str, list[TraceEvent]] = field(default_factory=lambda: defaultdict(list))
    generated: dict[str, list[TraceEvent]] = field(default_factory=lambda: defaultdict(list))  # non-aborted, in order
    partials: dict[str, list[TraceEvent]] = field(default_factory=lambda: defaultdict(list))  # aborted, with tokens
    dropped: dict[str, TraceEvent] = field(default_factory=dict)
    trained_in: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # episode -> train indices
    verdicts: dict[str, list[TraceEvent]] = field(default_factory=lambda: defaultdict(list))  # the reward model's
    judged: bool = False  # a reward model judges every episode that ends well
    trains: list[TraceEvent] = field(default_factory=list)
    exported: dict[int, float] = field(default_factory=dict)  # step -> when the harness had sealed its weights
    tokens_recorded: bool = True
    stop_token_ids: tuple[int, ...] = ()  # what the harness's runtime handed the candidate
    declared: Declared = field(default_factory=Declared)
    engine_of: dict[str, str] = field(default_factory=dict)  # device -> its engine's name (its first device)
    drafts: int = 0  # the engines' drafted tokens a step, as the stack declared them (credited up to the most allowed)
    start_t: float = 0.0
    end_t: float = 0.0
    _responses: dict[int, Response] = field(default_factory=dict)
    _turn_partials: dict[tuple[str, int], TurnPartials] = field(default_factory=dict)
    _steps: dict[int, int] = field(default_factory=dict)

    def engine(self, device: str) -> str:
        """The engine ``device`` is part of, by the name completions carry: in a simulated run an engine
        spans ``engine_devices`` devices (a shrink of any one takes it whole); a real one, one device."""
        return self.engine_of.get(device, device)

    def reply_slack(self, spec: TargetSpec) -> float:
        """How late an answer may reach the harness after the call that decided it: a real run's
        reply order, plus in a simulated one the answer's modelled way back (``request_overhead_s``)."""
        return ABORT_SLACK_S + (0.0 if self.tokens_recorded else spec.simulator.request_overhead_s)

    @classmethod
    def of(cls, events: list[TraceEvent], judged: bool = False) -> TraceIndex:
        """``judged``: the target has a reward model (``workload.reward_model``)."""
        ix = cls(list(events), judged=judged)
        for e in ix.events:
            ix.by_kind[e.kind].append(e)
        run_start = ix.by_kind["run_start"][0] if ix.by_kind["run_start"] else None
        if run_start is not None:
            ix.start_t = run_start.t
            ix.tokens_recorded = run_start.data.get("tokens_recorded", True)
            ix.stop_token_ids = tuple(run_start.data.get("stop_token_ids", ()))  # none: every request is named
            ix.declared = Declared(**run_start.data.get("declared", {}))
            engines = run_start.data.get("engines") or {}
            ix.engine_of = {device: name for name, devices in engines.items() for device in devices}
            drafts = int((run_start.data.get("engine") or {}).get("speculative_tokens", 0))
            ix.drafts = max(0, min(drafts, MAX_SPECULATIVE_TOKENS))
        ix.end_t = ix.by_kind["run_end"][0].t if ix.by_kind["run_end"] else (ix.events[-1].t if ix.events else 0.0)
        for e in ix.by_kind["episode_created"]:
            ix.created.append(e.data["episode"])
            ix.group_of[e.data["episode"]] = e.data["group"]
            ix.members[e.data["group"]].append(e.data["episode"])
            ix.group_order.setdefault(e.data["group"], len(ix.group_order))
            ix.created_at.setdefault(e.data["group"], e.t)
            if "relaunch" in e.data:
                ix.relaunch_of[e.data["group"]] = e.data["relaunch"]
        ix.resets = {e.data["episode"]: e for e in ix.by_kind["env_reset"]}
        for e in ix.by_kind["env_step"]:
            ix.env_steps[e.data["episode"]].append(e)
        for e in ix.by_kind["generate"]:
            if not e.data["aborted"]:
                ix.generated[e.data["episode"]].append(e)
            elif "tokens" in e.data:
                ix.partials[e.data["episode"]].append(e)
        for e in ix.by_kind["reward"]:
            ix.verdicts[e.data["episode"]].append(e)
        for e in ix.by_kind["sample_dropped"]:
            ix.dropped.setdefault(e.data["episode"], e)
        ix.exported = {e.data["step"]: e.t for e in ix.by_kind["weight_export"]}
        ix.trains = sorted(ix.by_kind["train"], key=lambda e: e.data["start"])
        for i, train in enumerate(ix.trains):
            for t in train.data["trajectories"]:
                ix.trained_in[t["episode"]].append(i)
        return ix

    @staticmethod
    def taken_from(train: TraceEvent) -> float:
        """When a step began taking its batch: its first part's start (stream training), else its own."""
        return min((consumed_at(train, t) for t in train.data["trajectories"]), default=train.data["start"])

    def versioned_answers(self) -> list[TraceEvent]:
        """Every answer, finished or an interrupted segment, that decoded a token under the version it names
        (a request cut before its first token decoded nothing under it)."""
        return [
            g
            for gs in [*self.generated.values(), *self.partials.values()]
            for g in gs
            if "version" in g.data and token_count(g.data.get("tokens", [])) > 0
        ]

    def finished(self, episode: str) -> bool:
        steps = self.env_steps.get(episode)
        return bool(steps) and steps[-1].data["done"]

    def finished_at(self, episode: str) -> float | None:
        """When the controller could know the episode had ended (None: never): its last step's answer,
        which with a reward model waits for the verdict of an episode that ended well (a spare or a
        deferral is judged by what the stack knew; one whose verdict never came was running to it)."""
        if not self.finished(episode):
            return None
        end = self.env_steps[episode][-1]
        if not self.judged or end.data["timed_out"] or end.data["lost"]:
            return end.t
        verdicts = self.verdicts.get(episode)
        return verdicts[0].t if verdicts else None

    def paid(self, episode: str) -> float:
        """The episode's reward: what its environment paid each turn, and a reward model's score of it
        (its first verdict's: one is all ``check_verdicts`` lets through)."""
        paid = sum(s.data["reward"] for s in self.env_steps.get(episode, []))
        verdicts = self.verdicts.get(episode)
        return paid + (verdicts[0].data["score"] if verdicts else 0.0)

    def decode_steps(self, g: TraceEvent) -> int:
        """The fewest engine steps request ``g``'s tokens (its answer's, or an interruption's partial) could
        have taken: one a token, fewer only where the stack drafts and its prompt's and tokens' repeats let
        drafts be kept (``decode_steps.fewest_steps``; real runs, whose tokens the trace holds)."""
        tokens = g.data.get("tokens", [])
        if not self.drafts or not self.tokens_recorded:
            return token_count(tokens)
        known = self._steps.get(id(g))
        if known is None:
            known = self._steps[id(g)] = fewest_steps(g.data["prompt"], tokens, self.drafts)
        return known

    def context_tokens(self, episode: str, turns: int) -> list | int:
        """The episode's context after ``turns`` environment steps (tokens, or a count if not recorded)."""
        reset = self.resets[episode].data["observation"]
        steps = self.env_steps.get(episode, [])[:turns]
        if not self.tokens_recorded:
            return token_count(reset) + sum(
                token_count(s.data["action"]) + token_count(s.data["observation"]) for s in steps
            )
        out = list(reset)
        for s in steps:
            out += s.data["action"] + s.data["observation"]
        return out

    def response(self, g: TraceEvent) -> Response:
        """The whole response a generate event ends (or, for an interrupted one, has so far): its
        own tokens after those of the interrupted segment it resumes, found by matching the
        request's last ``continues`` prompt tokens against what earlier segments of the turn
        produced (their lengths, when tokens are not recorded)."""
        known = self._responses.get(id(g))
        if known is not None:
            return known
        turn = self._partials_of(g)
        if g.data.get("continues", 0):
            # the segments it may resume first, in the order they ended: each then finds its own answered
            # already (a turn cut thousands of times: no recursion), and none is walked twice
            n = turn.count_before(g)
            for a in turn.events[turn.answered : n]:
                if id(a) not in self._responses:
                    self._responses[id(a)] = turn.answer(a, self._resumed(a, turn))
            turn.answered = max(turn.answered, n)
        own = turn.answer(g, self._resumed(g, turn))
        self._responses[id(g)] = own
        return own

    def _resumed(self, g: TraceEvent, turn: TurnPartials) -> Response:
        """``response``'s answer for ``g``, the segments it may resume answered already: its own tokens
        after the latest-ended of those whose response its carried tokens are."""
        d, recorded = g.data, self.tokens_recorded
        logprobs = list(d["logprobs"]) if recorded else []
        own = Response(d["tokens"], logprobs, frozenset([d["version"]]), g, None, g, True)
        n = d.get("continues", 0)
        if not n:
            return own
        tail = d["prompt"][len(d["prompt"]) - n :] if recorded else n
        prefix = turn.latest_ended_as(tail, turn.count_before(g))
        if prefix is None:
            return dataclasses.replace(own, chained=False)
        return Response(
            prefix.tokens + own.tokens,
            prefix.logprobs + own.logprobs,
            prefix.versions | own.versions,
            g,
            prefix,
            prefix.first,
            prefix.chained,
        )

    def interrupted_before(self, g: TraceEvent) -> list[TraceEvent]:
        """The interrupted segments of ``g``'s turn that ended by the time it started, in the order they
        ended (of two at one instant, the one the trace holds first: none may resume the other both ways)."""
        turn = self._partials_of(g)
        return turn.events[: turn.count_before(g)]

    def earlier_seeds(self, g: TraceEvent) -> set:
        """The seeds ``g``'s turn's interrupted segments were asked with, of those ``interrupted_before`` it."""
        turn = self._partials_of(g)
        n = turn.count_before(g)
        return set(turn.seeds[:1]) if 0 < n <= turn.same_seed else set(turn.seeds[:n])

    def _partials_of(self, g: TraceEvent) -> TurnPartials:
        key = (g.data["episode"], g.data["turn"])
        if key not in self._turn_partials:
            self._turn_partials[key] = TurnPartials.of(
                [a for a in self.partials.get(key[0], []) if a.data["turn"] == key[1]]
            )
        return self._turn_partials[key]

    def latest_observation(self, g: TraceEvent) -> list[int]:
        """What the environment said last before turn ``g``: the reset's observation before turn 0,
        else the previous step's (empty when the trace does not hold it)."""
        episode, turn = g.data["episode"], g.data["turn"]
        if turn == 0:
            reset = self.resets.get(episode)
            return list(reset.data["observation"]) if reset is not None else []
        steps = self.env_steps.get(episode, [])
        return list(steps[turn - 1].data["observation"]) if turn <= len(steps) else []

    def policy_at(self, t: float) -> int:
        """The number of training steps finished by time ``t`` (the controller's policy version)."""
        return sum(1 for train in self.trains if train.t <= t)


@dataclass
class TurnPartials:
    """One turn's interrupted segments in the order they ended (of two at one instant, the one the trace
    holds first), looked up by bisection: a turn cut thousands of times costs no quadratic scan."""

    keys: list[tuple[float, int]]  # (when it ended, its place among the episode's in the trace)
    events: list[TraceEvent]
    place: dict[int, int]  # id(segment) -> its place in the trace
    seeds: list  # what each was asked with
    same_seed: int  # how many of the first share the first one's seed
    answered: int = 0  # how many of the first ``TraceIndex.response`` has answered
    # a response answered -> the positions (in the order they ended) of the segments that ended with it
    ended_as: dict[tuple | int, list[int]] = field(default_factory=lambda: defaultdict(list))
    responses: dict[int, Response] = field(default_factory=dict)  # position -> its segment's response

    @classmethod
    def of(cls, in_trace_order: list[TraceEvent]) -> TurnPartials:
        ordered = sorted(enumerate(in_trace_order), key=lambda item: (item[1].t, item[0]))
        seeds = [a.data.get("seed") for _, a in ordered]
        same = next((i for i, seed in enumerate(seeds) if seed != seeds[0]), len(seeds))
        return cls([(a.t, k) for k, a in ordered], [a for _, a in ordered], {id(a): k for k, a in ordered}, seeds, same)

    def answer(self, g: TraceEvent, response: Response) -> Response:
        """Keeps an interrupted segment's response for the segments that may resume it."""
        if id(g) in self.place:
            position = bisect.bisect_left(self.keys, (g.t, self.place[id(g)]))
            key = tuple(response.tokens) if isinstance(response.tokens, list) else response.tokens
            bisect.insort(self.ended_as[key], position)
            self.responses[position] = response
        return response

    def latest_ended_as(self, tokens: list | int, before: int) -> Response | None:
        """The response of the latest-ended of the first ``before`` segments whose response is ``tokens``."""
        positions = self.ended_as.get(tuple(tokens) if isinstance(tokens, list) else tokens, [])
        k = bisect.bisect_left(positions, before)
        return self.responses[positions[k - 1]] if k else None

    def count_before(self, g: TraceEvent) -> int:
        """How many of the first ended by the time ``g`` started: before that instant, or at it and
        ahead of ``g`` in the trace."""
        return bisect.bisect_left(self.keys, (g.data["start"], self.place.get(id(g), math.inf)))


@dataclass(frozen=True)
class Response:
    """One turn's response as the engines produced it, segment by segment: with partial rollout an
    interrupted request returns what it decoded and the turn resumes from it (``continues``). Each keeps
    the response it resumes rather than a copy of its segments: a turn cut thousands of times, its
    resumptions empty, holds each segment once."""

    tokens: list | int  # the whole response (its length when tokens are not recorded)
    logprobs: list[float]
    versions: frozenset[int]  # the weight versions that decoded its segments
    last: TraceEvent  # the segment that ends it
    resumes: Response | None  # the response its last segment resumed
    first: TraceEvent  # the segment it began with
    chained: bool  # every resumed prefix is what an interrupted segment of this turn produced

    @property
    def segments(self) -> list[TraceEvent]:
        """Its segments, first to last."""
        out, at = [], self
        while at is not None:
            out.append(at.last)
            at = at.resumes
        return out[::-1]
