"""The audit's tests of how the engines sampled, on the distributions the replay recomputes under
the weights each turn claims (``replay.py``): not only how likely the drawn tokens were, but which
tokens were drawn.

Under honest sampling at temperature T every test below is a sum of per-token terms whose
conditional law given the past is known exactly, so each has an exact tail bound (Chernoff, with
Markov's inequality, made uniform over a grid of exponents by a union bound) and rejects only when
that bound puts an honest engine's chance of deviating as far under ``FALSE_ALARM``. No normal
approximation is trusted (an honest starter was once rejected at z = -4.1 by one). The five tests
together reject an honest engine with probability at most ``5 x FALSE_ALARM`` a run (each test's own
union bounds, over the rank test's bins and the independence test's scales, inside its ``FALSE_ALARM``).

* temperature: the sum of the drawn tokens' log-probabilities against its mean (greedy, colder or
  hotter sampling); its bound uses each token's exact cumulant generating function.
* rank: the randomized probability integral transform U of each drawn token, the vocabulary ordered
  from most to least probable (ties by id), and a uniform draw from the harness's seed inside the
  token's own mass. U is uniform on [0, 1] and independent of the past under honest sampling,
  whatever the distribution; an engine that prefers tokens of some likelihood (the typical ones,
  keeping the temperature test's sum on target) moves mass between U's bins. Tested at the 7 eighths.
* stop calibration: how often a stop token was drawn against the summed probability of drawing one.
  An engine that ends turns early where the model only might have catches it (in the last round's
  plant: 421 stops where the model predicts 144).
* echo calibration: how often the drawn token is one of those in the episode's latest observation
  (the symbol an environment asks for), against the summed probability of drawing one.
* independence: responses are independent draws (two episodes', two turns of one, a turn and its
  restart). Before each drawn token the test guesses the tokens that earlier responses drew there (any
  turn of the trace, replayed or not, to any prompt, under any version): the one it has been following
  (they shared a token at most ``FOLLOW_GAP`` positions back, at the same shift or one or two tokens
  either way), and each of the first ``FOLLOWERS_KEPT`` that had the same context (the last
  ``GUESS_CONTEXT`` tokens, or those with one unknown, or the whole prefix while shorter; a resumed turn
  read on from its interrupted segment), the drawn one followed from there on. A set, not the first: a
  squatter that draws junk after each context before the copy's token (a dropped spare restarted at
  every token, in a red team's copy) would own every first guess, and a decoy that shares each copy
  token behind a junk one, once followed, kept every later guess (another red team's). It counts the
  guesses drawn against the summed probability of drawing them under the weights the turn claims, among
  the guesses that would extend a run of drawn guesses (each at most ``RUN_GAP`` positions after the
  last) to a chance under 1e-3, 1e-6, 1e-12 (a union bound over the three). A cluster that decodes one
  request and copies the response to others is caught, also when it claims the copy under another
  version or for another prompt, re-draws some of its tokens (every other one, in the tests), drops a
  source token in three to break its runs, or hands it over as an interrupted segment and its
  resumption, or as a token a segment (a resumed turn's run goes on from the segment it resumes). Not
  counted over every guess: a stack that cancels redundant spares, or drops the longest
  turns, leaves turns selected on their own tokens, and a count over every guess then drifts (a toy of
  3,000 groups keeping 8 of 10: 5,702 drawn against 5,337 expected, a false alarm), where runs as
  improbable as 1e-3 did not (3 drawn against 6.0). For the same reason a stop token is never guessed.

Engine numerics: a real engine's probabilities differ from the replay's by up to the target's
``logprob_atol`` (a per token, checked on the drawn tokens), so each test takes an honest engine's
event probability anywhere in [p e^-2a, p e^2a] (the rank test: F(u) within (e^2a - 1) min(u, 1 - u)
of u) and bounds the deviation against the most forgiving end. On float32 CPU targets (a = 1e-3) that
margin is negligible; on bf16 GPU targets (a = 0.05) it is 10%, which a cheat that triples the stops
still clears by far.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FALSE_ALARM = 1e-4  # each test rejects an honest engine at most this often
# the independence test: tokens of context a guess matches, and the scales it counts guesses at (those
# whose run's chance was at most each: ``_run_chances``)
GUESS_CONTEXT = 4
FOLLOWERS_KEPT = 8  # lines a context keeps to guess from: a squatter has to draw junk after it this often
FOLLOW_GAP = 3  # positions a guess may follow its source past the last token they shared
RUN_GAP = GUESS_CONTEXT + FOLLOW_GAP  # positions a run of drawn guesses carries on past its last
INDEPENDENCE_SCALES = (1e-3, 1e-6, 1e-12)
LAMBDAS = torch.logspace(-2.5, 0.5, 16, dtype=torch.float64)  # the temperature bound's grid
EXPONENTS = torch.logspace(-3.5, 1.5, 26, dtype=torch.float64)  # the Bernoulli bounds' grid
RANK_BINS = tuple(k / 8 for k in range(1, 8))  # the rank test's thresholds
ROWS = 256  # rows of a vocabulary-wide computation at a time
# The temperature bound's grid over rows and vocabulary at once: on a CPU, few enough that the
# temporaries are reused rather than mapped afresh (page faults cost more than the arithmetic); on an
# accelerator, many, so that a large vocabulary still takes tens of rows a launch.
CGF_ELEMENTS = {"cpu": 1 << 18}  # 2 MB of float64 a temporary
CGF_ELEMENTS_ACCELERATOR = 1 << 26
BERNOULLI_ROWS = 1 << 16  # events a Bernoulli bound's grid takes at once (26 x 64K float64: 13 MB)


@dataclass
class TemperatureTest:
    """The sum S of the drawn tokens' log-probabilities minus their means. For each lambda of a grid
    and each direction, exp(+-lambda S - sum K(+-lambda)) is a martingale of mean 1, K each token's
    exact cumulant generating function under p_T (its whole vocabulary, so the skew of a peaked
    distribution is in it); Markov's inequality and a union bound over the grid give
    P_honest(deviation this large) <= 2G * min exp(-(+-lambda S - sum K))."""

    deviation: float = 0.0  # S
    variance: float = 0.0
    tokens: int = 0
    colder: torch.Tensor = field(default_factory=lambda: torch.zeros(len(LAMBDAS), dtype=torch.float64))
    hotter: torch.Tensor = field(default_factory=lambda: torch.zeros(len(LAMBDAS), dtype=torch.float64))

    def add(self, logits: torch.Tensor, chosen: torch.Tensor, temperature: float) -> None:
        """Tokens ``chosen`` (one per row), claimed sampled from softmax(logits / temperature)."""
        self.add_logp(torch.log_softmax(logits.double() / temperature, -1), chosen)

    def add_logp(self, logp: torch.Tensor, chosen: torch.Tensor) -> None:
        p = logp.exp()
        mean = (p * logp).sum(-1)
        self.deviation += float((logp.gather(-1, chosen[:, None]).squeeze(-1) - mean).sum())
        self.variance += float(((p * logp**2).sum(-1) - mean**2).clamp(min=0).sum())
        self.tokens += len(chosen)
        lambdas = LAMBDAS.to(logp.device)[:, None, None]
        elements = CGF_ELEMENTS.get(logp.device.type, CGF_ELEMENTS_ACCELERATOR)
        rows = max(1, elements // (len(LAMBDAS) * logp.shape[-1]))  # the whole grid at once, in bounded memory
        for start in range(0, len(chosen), rows):  # K(+-lam) = log E exp(+-lam (x - E)), exactly
            part, centre = logp[None, start : start + rows], lambdas[..., 0] * mean[None, start : start + rows]
            self.colder += (torch.logsumexp((1 + lambdas) * part, -1) - centre).sum(-1).cpu()
            self.hotter += (torch.logsumexp((1 - lambdas) * part, -1) + centre).sum(-1).cpu()

    @property
    def z(self) -> float:
        return self.deviation / math.sqrt(self.variance) if self.variance > 0 else 0.0

    def false_alarm_bound(self) -> float:
        """At most this probable, for an engine that really samples at the temperature, is a deviation
        as large as this one (either way)."""
        if not math.isfinite(self.deviation):
            return 0.0  # a token the model gives probability zero: no honest engine samples it
        exponent = torch.maximum(LAMBDAS * self.deviation - self.colder, -LAMBDAS * self.deviation - self.hotter)
        return min(1.0, 2 * len(LAMBDAS) * math.exp(-float(exponent.max())))


@dataclass
class BernoulliSum:
    """The count of events x_t ~ Bernoulli(p_t), each p_t known before its draw within [low, high]:
    exp(lambda (X - sum log(1 - h + h e^lambda)) / ...) bounds both tails (Chernoff), the upper with
    the highs and the lower with the lows, each uniform over ``EXPONENTS`` by a union bound."""

    observed: float = 0.0
    expected: float = 0.0
    draws: int = 0
    upper: torch.Tensor = field(default_factory=lambda: torch.zeros(len(EXPONENTS), dtype=torch.float64))
    lower: torch.Tensor = field(default_factory=lambda: torch.zeros(len(EXPONENTS), dtype=torch.float64))

    def add(self, p: torch.Tensor, x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> None:
        p, low, high = (t.double().cpu().clamp(0, 1) for t in (p, low, high))
        self.observed += float(x.double().sum())
        self.expected += float(p.sum())
        self.draws += len(p)
        lam = EXPONENTS[:, None]
        for start in range(0, len(p), BERNOULLI_ROWS):  # the grid over a run's million tokens, in bounded memory
            self.upper += torch.log1p(high[None, start : start + BERNOULLI_ROWS] * torch.expm1(lam)).sum(-1)
            self.lower += torch.log1p(low[None, start : start + BERNOULLI_ROWS] * torch.expm1(-lam)).sum(-1)

    def false_alarm_bound(self, sides: str = "both") -> float:
        """At most this probable, under honest draws, is a count as far from its expectation."""
        s = self.observed
        exponents = []
        if sides in ("both", "upper"):
            exponents.append(EXPONENTS * s - self.upper)
        if sides in ("both", "lower"):
            exponents.append(-EXPONENTS * s - self.lower)
        best = max(float(e.max()) for e in exponents)
        return min(1.0, len(exponents) * len(EXPONENTS) * math.exp(-best))


def _slack(p: torch.Tensor, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    return p * math.exp(-margin), (p * math.exp(margin)).clamp(max=1.0)


@dataclass(frozen=True)
class Draw:
    """A sampled turn (or interrupted segment) as the independence test reads it: only its tokens."""

    at: float  # when it was asked
    line: object  # the response it is part of (its episode, turn, and first segment): never guessed from itself
    carried: tuple[int, ...]  # tokens it carries from an interrupted segment (a resumed turn goes on from them)
    tokens: tuple[int, ...]  # what it drew
    stops: frozenset[int]


TOKEN_BITS = 32  # a token's field in a context's key: the id plus 1 (0: a token left unknown)
_FIELD = (1 << TOKEN_BITS) - 1


def _contexts(full: tuple[int, ...]) -> list[list[int]]:
    """For each position ``i`` of ``full``, what a guess there may match, most specific first: the last
    ``GUESS_CONTEXT`` tokens, then the same with one of them unknown (a copy with a token re-drawn); or
    the whole prefix while shorter. Each context is one integer, its tokens' fields side by
    side (a prefix's behind a leading 1, negated, so that no prefix is a window): the plan keeps one for
    each context of every drawn token, millions on a long-context target, and a tuple key with a dict of
    followers cost ~1.7 KB a token (``benchmarks/plan_guesses_cost.py``)."""
    contexts, window, prefix = [], 0, 1
    for i, token in enumerate(full):
        if i < GUESS_CONTEXT:
            contexts.append([~prefix])
            prefix = (prefix << TOKEN_BITS) | (token + 1)
        else:
            contexts.append(
                [window, *(window & ~(_FIELD << TOKEN_BITS * (GUESS_CONTEXT - 1 - k)) for k in range(GUESS_CONTEXT))]
            )
        window = ((window << TOKEN_BITS) | (token + 1)) & ((1 << TOKEN_BITS * GUESS_CONTEXT) - 1)
    return contexts


def _realigned(source: tuple[int, ...], full: tuple[int, ...], i: int, shift: int) -> int | None:
    """The shift at which ``source`` shares the token before position ``i`` with ``full``: the same, or
    one or two either way (a copy that dropped or put in tokens), the nearest; None if none does."""
    for moved in (0, 1, -1, 2, -2):
        at = i - 1 + shift + moved
        if 0 <= at < len(source) and source[at] == full[i - 1]:
            return shift + moved
    return None


def plan_guesses(turns: list[Draw], guessed: set[int]) -> dict[int, list[tuple[int, int]]]:
    """For each turn whose index is in ``guessed``, in the order asked: (position in its tokens, token)
    for each position where it guesses a token that is not a stop (several tokens at a position: a set,
    drawn if any one is). A guess comes from earlier turns of other lines (``Draw.line``): the one the turn
    has been following (they shared a token at most ``FOLLOW_GAP`` positions back; it goes on there at the
    shift where they shared the last, ``_realigned``), and each of the first ``FOLLOWERS_KEPT`` with the
    same context (``_contexts``, over the turn's carried tokens and its own), the one whose token was drawn
    followed from there on (of several, the one that goes on furthest: a squatter's junk line ends soon).
    A context is kept where a turn drew the token after it (a resumed turn's carried tokens were kept where
    its segments drew them: a request that only claims them, cut at once, takes no context over). Any
    prompt: another response is drawn apart from this one whatever it was asked, and a copy may be served
    for another prompt. Only the turn's own tokens before a guess and other responses' tokens decide it,
    and honest engines draw those apart from it, so each guess's chance is known before its draw."""
    followers: dict[int, int | tuple[int, ...]] = {}  # context -> the first ``FOLLOWERS_KEPT`` lines' ``_follower``s
    lines = {line: n for n, line in enumerate(dict.fromkeys(turn.line for turn in turns))}
    fulls = [turn.carried + turn.tokens for turn in turns]
    guesses: dict[int, list[tuple[int, int]]] = {}
    for k in sorted(range(len(turns)), key=lambda k: turns[k].at):
        turn, full, line = turns[k], fulls[k], lines[turns[k].line]
        contexts = _contexts(full)
        if k in guessed:
            guesses[k] = []
            following, shared = None, -FOLLOW_GAP - 1  # (source turn, its position less ours), where last shared
            for i in range(len(full)):
                tokens: dict[int, tuple[int, int]] = {}  # each distinct token guessed, with the source to follow
                if following is not None and i > 0:
                    shift = _realigned(fulls[following[0]], full, i, following[1])
                    if shift is not None:
                        following, shared = (following[0], shift), i - 1
                if (
                    following is not None
                    and i - shared <= FOLLOW_GAP
                    and 0 <= i + following[1] < len(fulls[following[0]])
                ):
                    tokens[fulls[following[0]][i + following[1]]] = following
                for context in contexts[i]:  # and, followed or not, the context's (a decoy followed hides none)
                    sources = [(turn_, at - i) for turn_, at in _followed(followers.get(context), line)]
                    for source in sources:  # of a token's sources, the followed one, else the one going on furthest
                        token = fulls[source[0]][i + source[1]]
                        kept = tokens.get(token)
                        if kept is None or (
                            kept != following and len(fulls[source[0]]) - source[1] > len(fulls[kept[0]]) - kept[1]
                        ):
                            tokens[token] = source
                    if sources:
                        break
                if full[i] in tokens:
                    following, shared = tokens[full[i]], i
                if i >= len(turn.carried):
                    guesses[k] += [(i - len(turn.carried), token) for token in tokens if token not in turn.stops]
        for i, keys in enumerate(contexts[len(turn.carried) :], start=len(turn.carried)):  # the turn's own draws
            for context in keys:  # the first ``FOLLOWERS_KEPT`` lines to draw after a context, one position each
                entry = followers.get(context)
                if entry is None:
                    followers[context] = _follower(line, k, i)
                elif isinstance(entry, int):
                    if entry >> 2 * TOKEN_BITS != line:
                        followers[context] = (entry, _follower(line, k, i))
                elif len(entry) < FOLLOWERS_KEPT and all(f >> 2 * TOKEN_BITS != line for f in entry):
                    followers[context] = (*entry, _follower(line, k, i))
    return guesses


def _follower(line: int, turn: int, position: int) -> int:
    """A turn that had a context at a position, with its line's number, as one integer."""
    return (line << 2 * TOKEN_BITS) | (turn << TOKEN_BITS) | position


def _followed(entry: int | tuple[int, ...] | None, line: int) -> list[tuple[int, int]]:
    """(turn, position) of each of ``entry``'s followers from another line than ``line``."""
    return [
        ((follower >> TOKEN_BITS) & _FIELD, follower & _FIELD)
        for follower in (entry if isinstance(entry, tuple) else () if entry is None else (entry,))
        if follower >> 2 * TOKEN_BITS != line
    ]


@dataclass(frozen=True)
class RunState:
    """Where a run of drawn guesses stands: its chance so far, and the position of its last drawn guess
    (None: no run)."""

    chance: float = 1.0
    last_hit: int | None = None


def _run_chances(
    positions: list[int], chances: list[float], hits: list[bool], start: RunState = RunState()
) -> tuple[torch.Tensor, RunState]:
    """For each guess of a turn (by position): the chance of the run it would extend, its own chance times
    those of the guesses drawn before it in the run, each at most ``RUN_GAP`` positions after the last. A
    copied stretch of tokens is one run, as improbable as the stretch, also where the copy re-draws, drops
    or puts in a few tokens (the guesses realign within ``FOLLOW_GAP`` positions, or find the copy again by
    its context within ``RUN_GAP``); only a longer stretch of its own starts a new one. ``start``: the run
    the segment before left (a resumed turn's), in the same positions; returned, the run this one leaves."""
    runs, run, last_hit = [], start.chance, start.last_hit
    for position, chance, hit in zip(positions, chances, hits, strict=True):
        if last_hit is None or position - last_hit > RUN_GAP:
            run = 1.0
        runs.append(run * chance)
        if hit:
            run, last_hit = run * chance, position
    return torch.tensor(runs, dtype=torch.float64), RunState(run, last_hit)


def _turn_events(event_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each turn's event ids (its stops, its echoes), padded: (ids [turns, most], which are real)."""
    most = max((len(ids) for ids in event_ids), default=0) or 1
    index = torch.zeros(len(event_ids), most, dtype=torch.long)
    valid = torch.zeros(len(event_ids), most, dtype=torch.bool)
    for turn, ids in enumerate(event_ids):
        index[turn, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        valid[turn, : len(ids)] = True
    return index, valid


@dataclass(frozen=True)
class Segment:
    """Where a turn's drawn tokens sit in the whole response they belong to: a resumed turn's run of drawn
    guesses goes on from the segments before it (otherwise a copy served a token a segment is never a
    run). ``key``: this segment's; ``after``: the keys of the segments before it in its response, the
    nearest last (the run goes on from the nearest of them that was tested: an empty segment, cut before
    it drew a token, is never tested); ``at``: the position of its first token in the whole response."""

    key: object
    after: tuple[object, ...] = ()
    at: int = 0


@dataclass
class _Turn:
    """One turn's drawn tokens as ``SamplingTests.add`` was given them, until its rows are taken together."""

    logits: torch.Tensor
    chosen: torch.Tensor
    stops: list[int]  # the stop ids in the vocabulary
    echoes: list[int]  # the latest observation's ids in the vocabulary, stops aside
    guessed: torch.Tensor  # [guesses, 2]: (position in the turn, token), sorted (a position's set together)
    segment: Segment


@dataclass
class _Guesses:
    """One segment's guesses, kept until ``independence`` chains the runs of a turn's segments."""

    chance: torch.Tensor
    hit: torch.Tensor
    positions: list[int]  # in the whole response
    segment: Segment


@dataclass
class SamplingTests:
    """All five tests over one run's replayed turns. ``atol``: the target's logprob_atol (the margin
    for engine numerics); ``seed``: the harness's, for the rank test's uniform draws. Turns shorter than
    ``ROWS`` wait (copied) until ``ROWS`` rows are there and are taken together, in the order they came: a
    turn is often a few tokens, and the vocabulary-wide work per call costs more than its rows."""

    atol: float
    seed: int
    _temperature: TemperatureTest = field(default_factory=TemperatureTest)
    # Per drawn token, kept until ``results``: its rank U, and the probability of the stop (echo) event
    # with whether it happened. A token is a few numbers; the tests' sums are taken once, at the end.
    _ranks: list[torch.Tensor] = field(default_factory=list)
    _stops: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _echoes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _guesses: list[_Guesses] = field(default_factory=list)
    _waiting: list[_Turn] = field(default_factory=list)  # short turns not yet taken, all at one temperature
    _waiting_at: float = 0.0

    def __post_init__(self) -> None:
        self._uniform = torch.Generator().manual_seed(self.seed)

    @property
    def temperature(self) -> TemperatureTest:
        self._take_waiting()
        return self._temperature

    def add(
        self,
        logits: torch.Tensor,
        chosen: torch.Tensor,
        temperature: float,
        stop_ids: list[int],
        echo_ids: list[int],
        guesses: list[tuple[int, int]] = (),
        segment: Segment | None = None,
    ) -> None:
        """One turn's drawn tokens (a row of ``logits`` each), with the independence test's guesses for
        it (``plan_guesses``); ``segment``: where they sit in a resumed turn's response (None: a turn of
        its own)."""
        segment = segment if segment is not None else Segment(key=object())
        vocabulary = range(logits.shape[-1])  # an id outside it is never drawn (the audit names such stop ids)
        stops = sorted({i for i in stop_ids if i in vocabulary})
        echoes = sorted({i for i in echo_ids if i in vocabulary} - set(stops))
        guessed = torch.tensor(sorted(set(guesses)), dtype=torch.long).reshape(-1, 2)
        if len(guessed) and not 0 <= int(guessed[:, 0].min()) <= int(guessed[:, 0].max()) < len(chosen):
            raise ValueError(f"a guess outside the turn's {len(chosen)} tokens: {guessed[:, 0].tolist()}")
        if self._waiting_at != temperature or len(chosen) >= ROWS:  # in order: the rank test's draws, same rows
            self._take_waiting()
        if len(chosen) >= ROWS:  # a long turn alone, not copied
            self._take([_Turn(logits, chosen, stops, echoes, guessed, segment)], temperature)
            return
        self._waiting.append(_Turn(logits.clone(), chosen, stops, echoes, guessed, segment))
        self._waiting_at = temperature
        if sum(len(turn.chosen) for turn in self._waiting) >= ROWS:
            self._take_waiting()

    def _take_waiting(self) -> None:
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            self._take(waiting, self._waiting_at)

    def _take(self, turns: list[_Turn], temperature: float) -> None:
        """The turns' rows, ``ROWS`` at a time: each token's rank, stop and echo events, and guesses."""
        if len(turns) == 1:  # a long turn: its own rows, not a copy (40,960 x 151,936 float32 is 25 GB)
            logits, chosen = turns[0].logits, turns[0].chosen
        else:
            logits, chosen = torch.cat([t.logits for t in turns]), torch.cat([t.chosen for t in turns])
        lengths = torch.tensor([len(t.chosen) for t in turns])
        owner = torch.repeat_interleave(torch.arange(len(turns)), lengths)  # each row's turn
        starts = [0, *torch.cumsum(lengths, 0).tolist()]
        events = [_turn_events([t.stops for t in turns]), _turn_events([t.echoes for t in turns])]
        guessed = torch.cat([t.guessed + torch.tensor([start, 0]) for t, start in zip(turns, starts)])
        chances = torch.zeros(len(guessed), dtype=torch.float64)
        hits = torch.zeros(len(guessed), dtype=torch.bool)
        for start in range(0, len(chosen), ROWS):
            rows, drawn = logits[start : start + ROWS], chosen[start : start + ROWS]
            logp = torch.log_softmax(rows.double() / temperature, -1)
            self._temperature.add_logp(logp, drawn)
            p = logp.exp()
            px = p.gather(-1, drawn[:, None])
            ids = torch.arange(p.shape[-1], device=p.device)
            ahead = (p > px) | ((p == px) & (ids[None, :] < drawn[:, None]))
            before = (p * ahead).sum(-1)
            draws = torch.rand(len(drawn), generator=self._uniform, dtype=torch.float64).to(p.device)
            self._ranks.append((before + draws * px.squeeze(-1)).clamp(0, 1).cpu())
            row_turns = owner[start : start + ROWS]
            for kept, (turn_index, turn_valid) in zip((self._stops, self._echoes), events, strict=True):
                index, valid = turn_index[row_turns].to(p.device), turn_valid[row_turns].to(p.device)
                with_event = valid.any(-1)
                if with_event.any():
                    probability = (p.gather(-1, index) * valid).sum(-1)
                    hit = ((drawn[:, None] == index) & valid).any(-1)
                    kept.append((probability[with_event].cpu(), hit[with_event].cpu()))
            here = (guessed[:, 0] >= start) & (guessed[:, 0] < start + len(drawn))
            if here.any():
                at, token = (guessed[here, 0] - start).to(p.device), guessed[here, 1].to(p.device)
                chances[here], hits[here] = p[at, token].cpu(), (drawn[at] == token).cpu()
        first = 0
        for turn in turns:  # a position's guesses are one event: any of its tokens drawn, their summed chance
            n = len(turn.guessed)
            at, which = torch.unique_consecutive(turn.guessed[:, 0], return_inverse=True)
            chance = torch.zeros(len(at), dtype=torch.float64).index_add_(0, which, chances[first : first + n])
            hit = torch.zeros(len(at), dtype=torch.long).index_add_(0, which, hits[first : first + n].long()) > 0
            positions = [turn.segment.at + q for q in at.tolist()]
            self._guesses.append(_Guesses(chance.clamp(max=1.0), hit, positions, turn.segment))
            first += n

    def rank_tests(self) -> list[BernoulliSum]:
        """For each of ``RANK_BINS`` u: how many drawn tokens have U <= u, each with probability exactly
        u under honest sampling (within the numerics' shift)."""
        self._take_waiting()
        ranks = torch.cat(self._ranks) if self._ranks else torch.zeros(0, dtype=torch.float64)
        margin = math.expm1(2 * self.atol)
        tests = []
        for u in RANK_BINS:
            test, exact, shift = BernoulliSum(), torch.full_like(ranks, u), margin * min(u, 1 - u)
            test.add(exact, ranks <= u, exact - shift, exact + shift)
            tests.append(test)
        return tests

    def _calibration(self, kept: list[tuple[torch.Tensor, torch.Tensor]]) -> BernoulliSum:
        test = BernoulliSum()
        if kept:
            probability, hit = torch.cat([k[0] for k in kept]), torch.cat([k[1] for k in kept])
            test.add(probability, hit, *_slack(probability, 2 * self.atol))
        return test

    def stops(self) -> BernoulliSum:
        """Stop tokens drawn against the summed probability of drawing one."""
        self._take_waiting()
        return self._calibration(self._stops)

    def echoes(self) -> BernoulliSum:
        """Tokens of the latest observation drawn against the summed probability of drawing one."""
        self._take_waiting()
        return self._calibration(self._echoes)

    def independence(self) -> list[BernoulliSum]:
        """How often a guess was drawn, against the summed probability of drawing it: one count for each
        of ``INDEPENDENCE_SCALES``, of the guesses whose run's chance was at most it (``_run_chances``;
        known before each draw, so each count's bound holds)."""
        self._take_waiting()
        tests = [BernoulliSum() for _ in INDEPENDENCE_SCALES]
        if self._guesses:
            chance, drawn = (torch.cat([g.chance for g in self._guesses]), torch.cat([g.hit for g in self._guesses]))
            run = self._runs()
            for test, scale in zip(tests, INDEPENDENCE_SCALES, strict=True):
                rare = run <= scale
                test.add(chance[rare], drawn[rare], *_slack(chance[rare], 2 * self.atol))
        return tests

    def _runs(self) -> torch.Tensor:
        """Each guess's run chance (``_run_chances``), in the order of ``_guesses``: a turn's own run, or
        a resumed turn's carried on from the nearest segment before it that was tested (a segment comes
        after those before it in its response, and only they decide its runs, so each guess's run is known
        before its draw whatever the segments' order here)."""
        left: dict[object, RunState] = {}
        runs: list[torch.Tensor | None] = [None] * len(self._guesses)
        for k in sorted(range(len(self._guesses)), key=lambda k: self._guesses[k].segment.at):
            g = self._guesses[k]
            start = next((left[key] for key in reversed(g.segment.after) if key in left), RunState())
            runs[k], left[g.segment.key] = _run_chances(g.positions, g.chance.tolist(), g.hit.tolist(), start)
        return torch.cat(runs)

    def results(self) -> list[tuple[str, float, str]]:
        """(test name, false-alarm bound, what was seen), for the report and the verdict."""
        self._take_waiting()
        out = [
            (
                "sampling temperature",
                self.temperature.false_alarm_bound(),
                f"z = {self.temperature.z:.1f} over {self.temperature.tokens} tokens",
            )
        ]
        rank, stops, echoes = self.rank_tests(), self.stops(), self.echoes()
        worst = min(rank, key=lambda t: t.false_alarm_bound())
        bound = min(1.0, len(rank) * worst.false_alarm_bound())
        u = RANK_BINS[rank.index(worst)]
        out.append(
            (
                "sampled ranks",
                bound,
                f"{worst.observed:.0f} of {worst.draws} drawn tokens in the likeliest {u:.3g} of the mass, "
                f"{worst.expected:.0f} expected",
            )
        )
        out.append(
            (
                "stop calibration",
                stops.false_alarm_bound(),
                f"{stops.observed:.0f} stop tokens drawn, {stops.expected:.1f} expected",
            )
        )
        out.append(
            (
                "echo calibration",
                echoes.false_alarm_bound(),
                f"{echoes.observed:.0f} tokens of the latest observation drawn, {echoes.expected:.1f} expected",
            )
        )
        scales = self.independence()
        worst = min(scales, key=lambda t: t.false_alarm_bound("upper"))
        scale = INDEPENDENCE_SCALES[scales.index(worst)]
        out.append(
            (
                "independent samples",
                min(1.0, len(scales) * worst.false_alarm_bound("upper")),
                f"{worst.observed:.0f} of {worst.draws} guesses extending a run of drawn guesses to a chance under "
                f"{scale:g} drawn (the token that followed the same "
                f"context in an earlier response), {worst.expected:.2g} "
                "expected by chance",
            )
        )
        return out
