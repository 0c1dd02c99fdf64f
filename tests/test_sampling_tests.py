"""The sampling tests (targets/harness/judge/sampling_tests.py) on synthetic distributions where the truth
is known: honest engines are never rejected (the bounds are exact), and each planted engine that
chooses its tokens is, with the power measured here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from targets.harness.judge.sampling_tests import (
    FALSE_ALARM,
    GUESS_CONTEXT,
    LAMBDAS,
    TOKEN_BITS,
    Draw,
    SamplingTests,
    Segment,
    _contexts,
    _run_chances,
    plan_guesses,
)

STOP, VOCAB = 0, 64


def _logits(generator: torch.Generator, tokens: int) -> torch.Tensor:
    """Distributions from nearly flat to sharply peaked, the stop token among the middling ones."""
    sharpness = torch.rand(tokens, 1, generator=generator) * 3 + 0.2
    return torch.randn(tokens, VOCAB, generator=generator) * sharpness


def _honest(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)


def _prefers(logits: torch.Tensor, generator: torch.Generator, wanted, share: float = 0.5) -> torch.Tensor:
    """The last round's plant: where a wanted token's log-probability is within 0.5 of the position's
    expected value (so the sum of log-probabilities stays on target), emit it ``share`` of the time."""
    chosen = _honest(logits, generator)
    logp = torch.log_softmax(logits, -1)
    mean = (logp.exp() * logp).sum(-1)
    for i in range(len(chosen)):
        for token in wanted(i):
            if abs(float(logp[i, token] - mean[i])) < 0.5 and float(torch.rand(1, generator=generator)) < share:
                chosen[i] = token
                break
    return chosen


def _run(logits, chosen, echo=None, seed=0) -> dict[str, float]:
    tests = SamplingTests(atol=1e-3, seed=seed)
    if echo is None:
        tests.add(logits, chosen, 1.0, [STOP], [])
    for i in range(len(chosen) if echo is not None else 0):  # a token a turn: each with its own echo set
        tests.add(logits[i : i + 1], chosen[i : i + 1], 1.0, [STOP], echo(i))
    return {name: bound for name, bound, _ in tests.results()}


def test_honest_engines_are_never_rejected_by_any_test():
    """300 honest runs of 200 to 2,000 tokens: no bound under 1e-4 (each test allows 1e-4)."""
    generator = torch.Generator().manual_seed(11)
    smallest = 1.0
    for tokens, runs in ((200, 200), (2000, 100)):
        for run in range(runs):
            logits = _logits(generator, tokens)
            tests = SamplingTests(atol=1e-3, seed=run)
            tests.add(logits, _honest(logits, generator), 1.0, [STOP], [5, 6, 7])
            smallest = min(smallest, *(bound for _, bound, _ in tests.results()))
    assert smallest >= FALSE_ALARM, smallest


def test_an_engine_that_prefers_the_stop_token_among_typical_ones_is_caught():
    """The temperature test alone cannot see it (the sum of log-probabilities stays on target)."""
    generator = torch.Generator().manual_seed(12)
    caught = 0
    for _ in range(10):
        logits = _logits(generator, 1500)
        bounds = _run(logits, _prefers(logits, generator, lambda i: [STOP]))
        assert bounds["sampling temperature"] > FALSE_ALARM
        caught += bounds["stop calibration"] < FALSE_ALARM
    assert caught == 10


def test_an_engine_that_forces_the_symbol_the_observation_asks_for_is_caught():
    generator = torch.Generator().manual_seed(13)
    logits = _logits(generator, 1500)
    asked = lambda i: [10 + i % 4]  # noqa: E731 - the symbol each observation shows
    bounds = _run(logits, _prefers(logits, generator, asked), echo=asked)
    assert bounds["echo calibration"] < FALSE_ALARM and bounds["sampling temperature"] > FALSE_ALARM


def test_an_engine_that_prefers_typical_tokens_shows_in_the_ranks():
    """Drawing the token nearest the expected log-probability a third of the time: the temperature
    sum stays on target, the ranks pile up in the middle."""
    generator = torch.Generator().manual_seed(14)
    logits = _logits(generator, 3000)
    logp = torch.log_softmax(logits, -1)
    typical = (logp - (logp.exp() * logp).sum(-1, keepdim=True)).abs().argmin(-1)
    chosen = torch.where(torch.rand(3000, generator=generator) < 0.33, typical, _honest(logits, generator))
    bounds = _run(logits, chosen)
    assert bounds["sampled ranks"] < FALSE_ALARM


@dataclass
class _Turn:
    """A synthetic turn for the independence test: its distributions (one row a position) and draws."""

    episode: str
    prompt: tuple[int, ...]
    logits: torch.Tensor
    chosen: torch.Tensor
    carried: tuple[int, ...] = ()


def _independence(
    turns: list[_Turn], atol: float = 1e-3, replayed: set[int] | None = None
) -> tuple[SamplingTests, float]:
    """The tests over ``turns``, asked in their order, those in ``replayed`` replayed (None: every one); and
    the independence bound. A turn's line is its episode's name (the segments of one response share it)."""
    draws = _draws(turns)
    replayed = set(range(len(turns))) if replayed is None else replayed
    guesses = plan_guesses(draws, replayed)
    tests = SamplingTests(atol=atol, seed=0)
    for n, t in enumerate(turns):
        if n in replayed:
            tests.add(t.logits, t.chosen, 1.0, [STOP], [], guesses[n], _segment(turns, n))
    return tests, dict((name, bound) for name, bound, _ in tests.results())["independent samples"]


def _draws(turns: list[_Turn]) -> list[Draw]:
    """``turns`` as the guess plan reads them, asked in their order, each on its episode's line."""
    return [
        Draw(float(n), t.episode, t.carried, tuple(t.chosen.tolist()), frozenset({STOP})) for n, t in enumerate(turns)
    ]


def _segment(turns: list[_Turn], n: int) -> Segment:
    """Turn ``n``'s place in its response: a turn that carries tokens comes after the earlier turns of its
    episode whose responses so far they begin with (as the audit's ``TraceIndex.response`` chains them)."""
    t = turns[n]
    after = tuple(
        k
        for k in range(n)
        if t.carried
        and turns[k].episode == t.episode
        and t.carried[: len(turns[k].carried) + len(turns[k].chosen)]
        == turns[k].carried + tuple(turns[k].chosen.tolist())
    )
    return Segment(key=n, after=after, at=len(t.carried))


def _clustered(generator, copy: bool, members: int = 4, length: int = 8) -> list[_Turn]:
    """Groups of ``members`` episodes asking the same prompt (a group shares its task): honest, each
    draws its own response; copying, one decode answers all."""
    turns = []
    for group in range(40):
        logits = _logits(generator, length) * 0.3  # flat enough that honest repeats are rare
        shared = _honest(logits, generator)
        for member in range(members):
            chosen = shared if copy else _honest(logits, generator)
            turns.append(_Turn(f"g{group}/e{member}", (group,), logits, chosen))
    return turns


def test_copied_completions_are_caught_and_honest_repeats_are_not():
    generator = torch.Generator().manual_seed(15)
    assert _independence(_clustered(generator, copy=False))[1] >= FALSE_ALARM
    assert _independence(_clustered(generator, copy=True))[1] < FALSE_ALARM


def test_a_copy_claimed_under_the_next_version_is_caught_and_honest_groups_straddling_one_are_not():
    """Groups of two episodes asking the same prompt, a weight update between their turns. Copying, the
    decode under version 0 is copied to the other, which claims version 1 with version 1's log-probabilities
    (a prefill of the copy there), so the replay agrees with it: the test guessed only from responses under
    the same version once; it guesses from any earlier response, each guess's chance under the weights the
    guessed turn claims."""
    generator = torch.Generator().manual_seed(17)
    for copy, caught in ((False, False), (True, True)):
        turns = []
        for group in range(40):
            before = _logits(generator, 8) * 0.3
            after = before + 0.05 * torch.randn(before.shape, generator=generator)
            first = _honest(before, generator)
            turns.append(_Turn(f"g{group}/e0", (group,), before, first))
            turns.append(_Turn(f"g{group}/e1", (group,), after, first if copy else _honest(after, generator)))
        tests, bound = _independence(turns)
        assert (bound < FALSE_ALARM) == caught, bound
    assert tests.independence()[0].observed > 200  # the copies' tokens once their runs are under 1e-3


def test_a_copy_edited_split_or_served_for_another_prompt_is_caught():
    """The cheaper evasions of an exact-repeat test: re-draw one token of the copy (a prefill for the
    logprobs), hand the copy over as an interrupted segment plus a resumed turn whose prompt carries it, or
    serve it for another prompt."""
    generator = torch.Generator().manual_seed(20)
    for evasion in ("edited", "split", "another prompt"):
        turns = []
        for group in range(20):
            logits = _logits(generator, 16) * 0.3
            original = _honest(logits, generator)
            turns.append(_Turn(f"g{group}/e0", (group,), logits, original))
            if evasion == "another prompt":  # a groupmate's later turn, whose context differs, answered with it
                turns.append(_Turn(f"g{group}/e1", (group, 7), logits, original))
            elif evasion == "edited":
                edited = original.clone()
                edited[5] = (edited[5] + 1) % VOCAB
                turns.append(_Turn(f"g{group}/e1", (group,), logits, edited))
            else:
                head, tail = tuple(original[:6].tolist()), original[6:]
                turns.append(_Turn(f"g{group}/e1", (group,), logits[:6], original[:6]))
                turns.append(_Turn(f"g{group}/e1", (group,), logits[6:], tail, carried=head))
        tests, bound = _independence(turns)
        assert bound < FALSE_ALARM, (evasion, bound)


def _likely(generator: torch.Generator, tokens: int) -> torch.Tensor:
    """Rows with one likely token each (about 0.2 of the mass), so that a short copied stretch is no
    rare event and only a run across the copy's edits makes it one."""
    logits = torch.randn(tokens, VOCAB, generator=generator) * 0.5
    logits[torch.arange(tokens), torch.randint(1, VOCAB, (tokens,), generator=generator)] += 3.0
    return logits


@pytest.mark.parametrize("every", [3, 2])
def test_a_copy_with_every_few_tokens_re_drawn_is_caught(every):
    """The red team's evasion of 4-token contexts: re-draw every few tokens of the copy (one prefill of the
    copy gives every position's logits), so that no four tokens in a row are copied. Over answers with a
    likely token at each position (so a short copied stretch is no rare event), the guesses follow the
    copied turn on past a re-drawn token, and a run carries on across it; counted in stretches of four or
    fewer, the copies (every third or every other token re-drawn) passed. Honest groups of the same shape
    raise nothing."""

    def served(group: int, rows: torch.Tensor, original: torch.Tensor, other: torch.Tensor, copying: bool):
        copy = original.clone()
        copy[every - 1 :: every] = other[every - 1 :: every]
        return [_Turn(f"g{group}/e1", (group,), rows, copy if copying else other)]

    _caught_only_copying(22, served)


def test_a_copy_served_a_token_a_segment_is_caught():
    """A run of drawn guesses was one segment's: a copy handed over as an interrupted segment of one token,
    resumed for one more, and so on, was never a run (a token's chance alone is far over 1e-3) and passed.
    A resumed turn's run now goes on from the segment it resumes. Honest turns cut as often raise nothing."""

    def served(group: int, rows: torch.Tensor, original: torch.Tensor, other: torch.Tensor, copying: bool):
        tokens = original if copying else other
        return [
            _Turn(f"g{group}/e1", (group,), rows[at : at + 1], tokens[at : at + 1], tuple(tokens[:at].tolist()))
            for at in range(len(tokens))
        ]

    _caught_only_copying(24, served)


def test_a_request_that_only_claims_a_copys_window_takes_no_context_over():
    """A red team's decoys: a copy served to both members of a group a token a segment, and before each
    token an interrupted request of another episode that claims the copy's last four tokens and a junk
    token as its response so far and draws one token. Being first with that context, it made every guess
    there the junk token, and the copy passed. A context is kept only where a turn drew the token after it
    (the audit names such a request too: tests/test_audit.py). Honest groups served alike raise nothing."""
    generator, junk = torch.Generator().manual_seed(25), VOCAB - 1
    for copying in (False, True):
        turns = []
        for group in range(20):
            rows = _likely(generator, 32)
            answers = [_honest(rows, generator).tolist() for _ in range(2)]
            answers = [answers[0]] * 2 if copying else answers
            for at in range(32):
                window = tuple(answers[0][max(0, at - GUESS_CONTEXT) : at])
                claimed = window + (junk if answers[0][at] != junk else junk - 1,)
                turns.append(_Turn(f"host{group}/e0", (99,), rows[at : at + 1], torch.tensor([3]), claimed))
                for member, answer in enumerate(answers):
                    drawn = torch.tensor(answer[at : at + 1])
                    turns.append(_Turn(f"g{group}/e{member}", (group,), rows[at : at + 1], drawn, tuple(answer[:at])))
        assert (_independence(turns)[1] < FALSE_ALARM) == copying, copying


def test_a_squatter_that_draws_junk_after_every_context_first_hides_no_copy():
    """A red team's squatter: a dropped spare restarted from scratch before each token of the copy, its
    restart claiming the copy's tokens so far and drawing a junk token (a prefill and one decode). First
    with each context, it made every guess there junk, and the copy served to the groupmates passed. A
    guess is now the set of tokens the first ``FOLLOWERS_KEPT`` lines drew after its context, the drawn
    one followed from there on. The squatter's restarts here are not replayed (a sample that missed them);
    replayed, each repeats its predecessor (a restart is guessed from its attempt: test_audit.py). Honest
    restarts and groups raise nothing."""
    generator, junk = torch.Generator().manual_seed(26), VOCAB - 1
    for copying in (False, True):
        turns, replayed = [], set()
        for group in range(20):
            rows = _likely(generator, 32)
            answers = [_honest(rows, generator) for _ in range(2)]
            answers = [answers[0]] * 2 if copying else answers
            for at in range(32):
                if copying:
                    claimed = answers[0][:at].tolist() + [junk if answers[0][at] != junk else junk - 1]
                else:
                    claimed = _honest(rows[: at + 1], generator).tolist()
                turns.append(_Turn(f"g{group}/spare#{at}", (group,), rows[: at + 1], torch.tensor(claimed)))
            for member, answer in enumerate(answers):
                replayed.add(len(turns))
                turns.append(_Turn(f"g{group}/e{member}", (group,), rows, answer))
        assert (_independence(turns, replayed=replayed)[1] < FALSE_ALARM) == copying, copying


def test_a_decoy_followed_first_hides_no_copy():
    """A red team's decoy: a dropped spare forwarded before a group, its response the copy's first M tokens,
    then each later copy token behind a junk one (one prefill, nothing decoded). The copies' first drawn
    guess found the decoy, the one going on furthest, and followed it; each later guess was the decoy's
    junk, yet the decoy's next token shared the copy's last and kept the follow: 1 hit a member. M is the
    cheater's choice, made against the plan itself. A turn's guesses are now the followed token and its
    context's set together. The decoys are not replayed (a sample that missed them)."""
    generator, choose = torch.Generator().manual_seed(28), torch.Generator().manual_seed(29)

    def decoy(copy: list[int], m: int) -> list[int]:
        tokens = list(copy[:m])
        for token in copy[m:]:
            junk = int(torch.randint(1, VOCAB - 1, (1,), generator=choose))
            tokens += [junk if junk != token else junk + 1, token]
        return tokens

    def hits(turns: list[_Turn], copy: list[int]) -> int:
        draws = _draws(turns)
        draws += [Draw(float(len(turns) + n), f"probe{n}", (), tuple(copy), frozenset({STOP})) for n in range(2)]
        return sum(copy[q] == token for q, token in plan_guesses(draws, {len(draws) - 1})[len(draws) - 1])

    for copying in (False, True):
        turns, replayed = [], set()
        for group in range(20):
            rows = _likely(generator, 32)
            answers = [_honest(rows, generator) for _ in range(4)]
            answers = [answers[0]] * 4 if copying else answers
            copy = answers[0].tolist()
            spare = f"g{group}/spare"
            tokens = min(
                (decoy(copy, m) for m in range(1, 8)),
                key=lambda d: hits([*turns, _Turn(spare, (group,), rows[:1], torch.tensor(d))], copy),
            )
            turns.append(_Turn(spare, (group,), _likely(generator, len(tokens)), torch.tensor(tokens)))
            for member, answer in enumerate(answers):
                replayed.add(len(turns))
                turns.append(_Turn(f"g{group}/e{member}", (group,), rows, answer))
        assert (_independence(turns, replayed=replayed)[1] < FALSE_ALARM) == copying, copying


def _caught_only_copying(seed: int, served) -> None:
    """Twenty groups of two episodes asking one prompt over 32 rows with a likely token each (``_likely``):
    the first draws its own answer, the second is answered by ``served(group, rows, the first's answer,
    an answer drawn apart, copying)``; the independence test rejects the copying run and passes the
    honest one."""
    generator = torch.Generator().manual_seed(seed)
    for copying in (False, True):
        turns = []
        for group in range(20):
            rows = _likely(generator, 32)
            original, other = _honest(rows, generator), _honest(rows, generator)
            turns.append(_Turn(f"g{group}/e0", (group,), rows, original))
            turns += served(group, rows, original, other, copying)
        assert (_independence(turns)[1] < FALSE_ALARM) == copying, copying


KEPT_BETWEEN_DROPS = 2  # so the copy keeps at least two in three of its source's tokens


def _dropping_copy(source: torch.Tensor, rows: torch.Tensor, length: int) -> tuple[torch.Tensor, list[int]]:
    """The red team's adaptive copier, which reads the harness: it copies ``source`` token by token and
    drops the next source token whenever copying it would draw a guess that takes its run under 3e-3
    (``plan_guesses``, ``_run_chances``), having copied ``KEPT_BETWEEN_DROPS`` since its last drop (the
    copy stays a copy: two in three of its source's tokens at least, so the source is long enough).
    Returns the copy and the source position of each of its tokens."""
    taken: list[int] = []
    at = kept = 0  # kept: tokens copied since the last drop
    while len(taken) < length:
        trial = [*taken, at]
        tokens = tuple(int(source[j]) for j in trial)
        plan = plan_guesses(
            [Draw(0.0, "a", (), tuple(source.tolist()), frozenset()), Draw(1.0, "c", (), tokens, frozenset())], {1}
        )[1]
        positions = [q for q, _ in plan]
        chances = [float(torch.softmax(rows[trial[q]], -1)[t]) for q, t in plan]
        hits = [tokens[q] == t for q, t in plan]
        rare = positions and positions[-1] == len(trial) - 1 and hits[-1]
        if rare and kept >= KEPT_BETWEEN_DROPS and _run_chances(positions, chances, hits)[0][-1] < 3e-3:
            at, kept = at + 1, 0  # drop it
            continue
        taken.append(at)
        at, kept = at + 1, kept + 1
    return source[taken], taken


def test_a_copy_that_drops_tokens_to_break_its_runs_is_caught():
    """A run of drawn guesses ended where the copy left its source's alignment, so a copier that drops a
    source token whenever its run would turn rare (no decode at all) passed, keeping two in three of its
    source's tokens. The guesses now realign one or two tokens either way and a run carries on over
    ``RUN_GAP`` positions. Still open: a copy of every other token only, which in these rows (each a
    position's own, whatever came before) is a plausible sample, and under a real model's contexts pays
    in likelihood. Honest groups of the same shape raise nothing."""
    generator = torch.Generator().manual_seed(23)
    for copying in (False, True):
        turns = []
        for group in range(12):
            rows = _likely(generator, 48)
            original, other = _honest(rows, generator), _honest(rows[:24], generator)
            turns.append(_Turn(f"g{group}/e0", (group,), rows, original))
            if copying:
                copy, taken = _dropping_copy(original, rows, 24)
                turns.append(_Turn(f"g{group}/e1", (group,), rows[taken], copy))
            else:
                turns.append(_Turn(f"g{group}/e1", (group,), rows[:24], other))
        assert (_independence(turns)[1] < FALSE_ALARM) == copying, copying


def test_a_peaked_answer_repeats_often_and_that_is_chance():
    """Responses of one likely token after another: most members of a group repeat each other honestly."""
    generator = torch.Generator().manual_seed(16)
    logits = torch.full((3, VOCAB), -4.0)
    logits[:, 5] = 4.0
    turns = [_Turn(f"g{n // 4}/e{n % 4}", (n // 4,), logits, _honest(logits, generator)) for n in range(200)]
    tests, bound = _independence(turns)
    assert sum(int(g.hit.sum()) for g in tests._guesses) > 300  # drawn guesses, at every chance
    assert bound >= FALSE_ALARM


@pytest.mark.parametrize("copies", [0, 1])
def test_one_copied_long_response_among_many_honest_repeats_is_caught(copies):
    """A cluster that copies one response only, once: among a run's honest repeats of likely tokens the
    copy is one run of drawn guesses, and past a chance of 1e-12 its every further token is the evidence.
    An honest long response raises nothing."""
    generator = torch.Generator().manual_seed(19)
    peaked = torch.full((3, VOCAB), -4.0)
    peaked[:, 5] = 4.0
    turns = [_Turn(f"g{n // 4}/e{n % 4}", (n // 4,), peaked, _honest(peaked, generator)) for n in range(200)]
    flat = _logits(generator, 12) * 0.3
    first = _honest(flat, generator)
    turns.append(_Turn("g99/e0", (99,), flat, first))
    turns.append(_Turn("g99/e1", (99,), flat, first if copies else _honest(flat, generator)))
    tests, bound = _independence(turns)
    assert sum(int(g.hit.sum()) for g in tests._guesses) > 300  # among hundreds of honest drawn guesses
    assert (bound < FALSE_ALARM) == bool(copies), bound


def test_a_context_key_matches_exactly_where_the_tokens_do():
    """Contexts are integers (one per context of every drawn token: millions on a long-context target):
    two positions share a key where, and only where, their last tokens (or whole prefixes) are the same,
    or the same but for the one left unknown; the largest token id included."""
    import itertools
    import random

    rng = random.Random(0)
    largest = (1 << TOKEN_BITS) - 2
    sequences = [tuple(rng.choice((0, 1, 2, largest)) for _ in range(rng.randrange(1, 9))) for _ in range(40)]

    def shown(full, i):  # the contexts as the tokens say them: -1 leads a prefix, None is a token left unknown
        if i < GUESS_CONTEXT:
            return [(-1, *full[:i])]
        window = full[i - GUESS_CONTEXT : i]
        return [window, *(window[:k] + (None,) + window[k + 1 :] for k in range(GUESS_CONTEXT))]

    pairs = [
        (key, told)
        for full in sequences
        for i, keys in enumerate(_contexts(full))
        for key, told in zip(keys, shown(full, i), strict=True)
    ]
    for (key, told), (other, other_told) in itertools.combinations(pairs, 2):
        assert (key == other) == (told == other_told), (told, other_told)


def test_a_stop_token_is_never_guessed():
    """A stack may cancel a redundant spare, and the turns it leaves are the shorter ones: a guess of the
    stop token would count that choice as copying."""
    draws = [
        Draw(0.0, "a", (), (7, STOP), frozenset({STOP})),
        Draw(1.0, "b", (), (7, 9), frozenset({STOP})),
    ]
    assert plan_guesses(draws, {1}) == {1: [(0, 7)]}


def test_stop_and_echo_ids_outside_the_vocabulary_are_never_drawn_and_no_crash():
    """A controller may ask for stop ids past the vocabulary or negative (the audit names them): no token
    drawn is one, and the tests run on."""
    generator = torch.Generator().manual_seed(21)
    logits = _logits(generator, 50)
    tests = SamplingTests(atol=1e-3, seed=0)
    tests.add(logits, _honest(logits, generator), 1.0, [STOP, VOCAB + 5, -1], [VOCAB, -2, 3])
    assert all(bound >= FALSE_ALARM for _, bound, _ in tests.results())


@pytest.mark.parametrize("atol, alarm", [(1e-3, True), (0.3, False)])
def test_engine_numerics_within_the_tolerance_are_forgiven(atol, alarm):
    """An engine whose stop token is e^0.5 likelier than the replay's: beyond a float32 target's
    tolerance, within a loose one's (2 x 0.3 of log-probability either way)."""
    generator = torch.Generator().manual_seed(17)
    logits = _logits(generator, 20000)
    shifted = logits.clone()
    shifted[:, STOP] += 0.5
    chosen = _honest(shifted, generator)
    tests = SamplingTests(atol=atol, seed=0)
    tests.add(logits, chosen, 1.0, [STOP], [])
    bound = dict((n, b) for n, b, _ in tests.results())["stop calibration"]
    assert (bound < FALSE_ALARM) == alarm, bound
    assert math.isfinite(bound)


def test_the_temperature_bound_is_the_same_whether_its_grid_is_taken_whole_or_in_chunks(monkeypatch):
    """The exponent grid's log-sum-exps are taken over as many rows at once as ``CGF_ELEMENTS`` allows
    for the device (a 150k vocabulary takes one row a chunk on a CPU): chunked, each exponent's
    cumulant sum is still the per-row sum a direct computation gives."""
    from targets.harness.judge import sampling_tests

    generator = torch.Generator().manual_seed(18)
    logp = torch.log_softmax(_logits(generator, 50).double(), -1)
    chosen = _honest(logp, generator)
    mean = (logp.exp() * logp).sum(-1)
    colder = torch.stack([(torch.logsumexp((1 + lam) * logp, -1) - lam * mean).sum() for lam in LAMBDAS.tolist()])
    hotter = torch.stack([(torch.logsumexp((1 - lam) * logp, -1) + lam * mean).sum() for lam in LAMBDAS.tolist()])
    for elements in (1 << 26, len(LAMBDAS) * VOCAB * 7, 1):  # whole; 7 rows a chunk; a row a chunk
        monkeypatch.setitem(sampling_tests.CGF_ELEMENTS, "cpu", elements)
        test = sampling_tests.TemperatureTest()
        test.add_logp(logp, chosen)
        assert torch.allclose(test.colder, colder, rtol=1e-12) and torch.allclose(test.hotter, hotter, rtol=1e-12)


def test_the_bernoulli_bounds_are_the_same_whether_their_tokens_are_summed_whole_or_in_chunks(monkeypatch):
    """A Bernoulli bound sums its events ``BERNOULLI_ROWS`` at a time (a long run's million tokens would
    otherwise make gigabyte temporaries): 7 at a time gives the bounds, and both tails' grids, of all at once."""
    from targets.harness.judge import sampling_tests

    generator = torch.Generator().manual_seed(19)
    logits = _logits(generator, 400)
    chosen = _prefers(logits, generator, lambda i: [STOP])
    bounds = []
    for rows in (1 << 16, 7):
        monkeypatch.setattr(sampling_tests, "BERNOULLI_ROWS", rows)
        bounds.append(_run(logits, chosen, echo=lambda i: [10 + i % 4]))
    assert bounds[0]["stop calibration"] < FALSE_ALARM  # bounds that mean something, not 1.0 everywhere
    for name, bound in bounds[0].items():
        assert math.isclose(bound, bounds[1][name], rel_tol=1e-9), (name, bound, bounds[1][name])
    p = torch.rand(400, generator=generator, dtype=torch.float64)  # both tails' grids, not only the reported one
    sums = []
    for rows in (1 << 16, 7):
        monkeypatch.setattr(sampling_tests, "BERNOULLI_ROWS", rows)
        test = sampling_tests.BernoulliSum()
        test.add(p, p < 0.5, p * 0.9, p * 1.1)
        sums.append(test)
    assert torch.allclose(sums[0].upper, sums[1].upper, rtol=1e-12)
    assert torch.allclose(sums[0].lower, sums[1].lower, rtol=1e-12)


def test_turns_taken_together_give_what_each_turn_taken_alone_gives():
    """Short turns wait and are taken ``ROWS`` rows at a time (a turn is often a few tokens): every test's
    sums are those of each turn taken alone, stops, echoes and guesses each counted for its own turn, a
    long turn among the short ones, at two temperatures."""
    generator = torch.Generator().manual_seed(21)
    turns = _clustered(generator, copy=True, length=6)
    long = _logits(generator, 300)
    turns.insert(50, _Turn("long", (99,), long, _honest(long, generator)))
    draws = [Draw(float(n), t.episode, (), tuple(t.chosen.tolist()), frozenset({STOP})) for n, t in enumerate(turns)]
    guesses = plan_guesses(draws, set(range(len(turns))))
    together, alone = SamplingTests(atol=1e-3, seed=0), SamplingTests(atol=1e-3, seed=0)
    for n, t in enumerate(turns):
        temperature, echo = (1.0, [10 + n % 5, 20]) if n < 100 else (0.7, [] if n % 2 else [STOP, 30])
        for tests in (together, alone):
            tests.add(t.logits, t.chosen, temperature, [STOP], echo, guesses[n])
        alone.temperature  # noqa: B018 -- reading the sums takes the waiting turns: here, each turn alone
    assert sum(len(made) for made in guesses.values()) > 100
    assert together.independence()[0].observed > 50 and together.echoes().observed > 0

    def sums(tests: SamplingTests) -> list[float]:
        counts = [tests.stops(), tests.echoes(), *tests.independence(), *tests.rank_tests()]
        return [tests.temperature.deviation, tests.temperature.variance] + [
            x for c in counts for x in (c.observed, c.expected, c.draws)
        ]

    assert sums(together) == pytest.approx(sums(alone), rel=1e-9)
    assert [b for _, b, _ in together.results()] == pytest.approx([b for _, b, _ in alone.results()], rel=1e-6)
