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
* independence: completions served to different episodes for the same prompt are independent draws,
  so an identical response comes up only as often as the model's probability of that response allows
  (the running sum of the probabilities of reproducing an earlier one, each under the weights the later
  response claims, whichever version the earlier one was served under); a cluster that decodes one
  request and copies it to others is caught, and so is one that claims the copy under the next version
  (prefilling it there for that version's logprobs). The count is tested at several scales at once:
  repeats of any earlier response, and repeats of those alone whose chance was under 1e-3, 1e-6 and
  1e-12 (a union bound over the four). One copy of a long response is lost in a run's honest repeats of
  short ones, but a repeat of a response whose chance was 1e-30 is the evidence by itself.

Engine numerics: a real engine's probabilities differ from the replay's by up to the target's
``logprob_atol`` (a per token, checked on the drawn tokens), so each test takes an honest engine's
event probability anywhere in [p e^-2a, p e^2a] (the rank test: F(u) within (e^2a - 1) min(u, 1 - u)
of u) and bounds the deviation against the most forgiving end. On float32 CPU targets (a = 1e-3) that
margin is negligible; on bf16 GPU targets (a = 0.05) it is 10%, which a cheat that triples the stops
still clears by far.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

FALSE_ALARM = 1e-4  # each test rejects an honest engine at most this often
# the independence test's scales: it counts repeats among the comparisons whose chance was at most each
INDEPENDENCE_SCALES = (1.0, 1e-3, 1e-6, 1e-12)
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
class Response:
    """A completed (never aborted) sampled turn, as the independence test compares it."""

    at: float  # when it was served
    version: int  # the weights it claims
    prompt: tuple[int, ...]
    episode: str
    temperature: float
    tokens: tuple[int, ...]


@dataclass
class SamplingTests:
    """All five tests over one run's replayed turns. ``atol``: the target's logprob_atol (the margin
    for engine numerics); ``seed``: the harness's, for the rank test's uniform draws."""

    atol: float
    seed: int
    temperature: TemperatureTest = field(default_factory=TemperatureTest)
    responses: list[Response] = field(default_factory=list)
    # log-probability at a temperature of a response to a prompt under a version: (version, temperature,
    # prompt, response) -> float; each response's own, and those the independence test compares across versions
    scored: dict[tuple[int, float, tuple[int, ...], tuple[int, ...]], float] = field(default_factory=dict)
    # Per drawn token, kept until ``results``: its rank U, and the probability of the stop (echo) event
    # with whether it happened. A token is a few numbers; the tests' sums are taken once, at the end.
    _ranks: list[torch.Tensor] = field(default_factory=list)
    _stops: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _echoes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._uniform = torch.Generator().manual_seed(self.seed)

    def add(
        self,
        logits: torch.Tensor,
        chosen: torch.Tensor,
        temperature: float,
        stop_ids: list[int],
        echo_ids: list[int],
    ) -> torch.Tensor:
        """One turn's drawn tokens (a row of ``logits`` each); returns each token's log-probability at
        the temperature (the independence test sums them)."""
        picked = []
        stops = sorted(set(stop_ids))
        echoes = sorted(set(echo_ids) - set(stops))
        for start in range(0, len(chosen), ROWS):
            rows, drawn = logits[start : start + ROWS], chosen[start : start + ROWS]
            logp = torch.log_softmax(rows.double() / temperature, -1)
            self.temperature.add_logp(logp, drawn)
            p = logp.exp()
            px = p.gather(-1, drawn[:, None])
            ids = torch.arange(p.shape[-1], device=p.device)
            ahead = (p > px) | ((p == px) & (ids[None, :] < drawn[:, None]))
            before = (p * ahead).sum(-1)
            draws = torch.rand(len(drawn), generator=self._uniform, dtype=torch.float64).to(p.device)
            self._ranks.append((before + draws * px.squeeze(-1)).clamp(0, 1).cpu())
            for kept, event in ((self._stops, stops), (self._echoes, echoes)):
                if event:
                    index = torch.tensor(event, device=p.device)
                    kept.append((p[:, index].sum(-1).cpu(), torch.isin(drawn, index).cpu()))
            picked.append(logp.gather(-1, drawn[:, None]).squeeze(-1).cpu())
        return torch.cat(picked) if picked else torch.zeros(0, dtype=torch.float64)

    def rank_tests(self) -> list[BernoulliSum]:
        """For each of ``RANK_BINS`` u: how many drawn tokens have U <= u, each with probability exactly
        u under honest sampling (within the numerics' shift)."""
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
        return self._calibration(self._stops)

    def echoes(self) -> BernoulliSum:
        """Tokens of the latest observation drawn against the summed probability of drawing one."""
        return self._calibration(self._echoes)

    def add_response(
        self, at: float, version: int, prompt: list[int], episode: str, temperature: float, tokens: list[int]
    ) -> None:
        """A completed response ``tokens`` to ``prompt`` served to ``episode`` at ``at`` under ``version``
        at ``temperature``. Its own score (``add``'s log-probabilities, summed) comes with its replay."""
        self.responses.append(Response(at, version, tuple(prompt), episode, temperature, tuple(tokens)))

    def add_score(self, version: int, temperature: float, prompt: list[int], tokens: list[int], logp: float) -> None:
        """The log-probability of drawing ``tokens`` after ``prompt`` under ``version`` at ``temperature``."""
        self.scored[(version, temperature, tuple(prompt), tuple(tokens))] = logp

    def scores_needed(self) -> dict[int, set[tuple[float, tuple[int, ...], tuple[int, ...]]]]:
        """By version: the (temperature, prompt, response) the independence test needs scored under it, an
        earlier response to a prompt this version answered, served to another episode under another version
        or temperature (``add_score`` each before ``results``)."""
        by_prompt: dict[tuple[int, ...], list[Response]] = defaultdict(list)
        for response in self._in_order():
            by_prompt[response.prompt].append(response)
        needed: dict[int, set[tuple[float, tuple[int, ...], tuple[int, ...]]]] = defaultdict(set)
        for served in by_prompt.values():
            for n, later in enumerate(served):
                for earlier in served[:n]:
                    drawn_alike = (earlier.version, earlier.temperature) == (later.version, later.temperature)
                    if not drawn_alike and earlier.episode != later.episode:
                        needed[later.version].add((later.temperature, later.prompt, earlier.tokens))
        return dict(needed)

    def _in_order(self) -> list[Response]:
        return sorted(self.responses, key=lambda r: r.at)

    def independence(self) -> list[BernoulliSum]:
        """In the order served: whether each response repeats one an earlier episode got for the same
        prompt, against the probability of doing so by chance (the sum over the distinct earlier responses
        of the probability of drawing each under the weights and temperature this response claims); one
        count for each of ``INDEPENDENCE_SCALES``, of the repeats of responses whose chance was at most it (which
        comparisons a count takes is known before each draw, so each count's bound holds). At a scale, the
        event is repeating one of the earlier responses whose own chance was at most it: a rare copy is
        not hidden by the chance of repeating a likely short answer to the same prompt."""
        tests = [BernoulliSum() for _ in INDEPENDENCE_SCALES]
        earlier: dict[tuple[int, ...], dict[tuple[int, ...], str]] = {}
        for response in self._in_order():
            key = (response.version, response.temperature, response.prompt)
            if (*key, response.tokens) not in self.scored:  # its version has no weights: the replay said so
                continue
            seen = earlier.setdefault(response.prompt, {})
            others = [tokens for tokens, owner in seen.items() if owner != response.episode]
            if others:
                missing = [tokens for tokens in others if (*key, tokens) not in self.scored]
                if missing:
                    raise RuntimeError(
                        f"the independence test needs {len(missing)} earlier response(s) to a prompt scored "
                        f"under version {response.version} (scores_needed lists them)"
                    )
                chance = {tokens: math.exp(self.scored[(*key, tokens)]) for tokens in others}
                for test, scale in zip(tests, INDEPENDENCE_SCALES, strict=True):
                    rare = [tokens for tokens, p in chance.items() if p <= scale]
                    if rare:  # the event: this response repeats one of them; its chance, their sum, each
                        # within e^(+-2a len) of the replay's (its own length: a long sibling's slack is its own)
                        bounds = [
                            sum(chance[tokens] * math.exp(sign * 2 * self.atol * len(tokens)) for tokens in rare)
                            for sign in (0, -1, 1)
                        ]
                        p, low, high = (torch.tensor([min(1.0, b)], dtype=torch.float64) for b in bounds)
                        test.add(p, torch.tensor([response.tokens in rare]), low, high)
            seen.setdefault(response.tokens, response.episode)
        return tests

    def results(self) -> list[tuple[str, float, str]]:
        """(test name, false-alarm bound, what was seen), for the report and the verdict."""
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
        among = "" if scale == 1.0 else f" whose chance was under {scale:g} ({worst.draws} responses could have)"
        out.append(
            (
                "independent samples",
                min(1.0, len(scales) * worst.false_alarm_bound("upper")),
                f"{worst.observed:.0f} responses repeated one another episode got for the same prompt (under "
                f"any version){among}, {worst.expected:.2g} expected by chance",
            )
        )
        return out
