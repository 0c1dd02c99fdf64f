"""The sampling tests (targets/harness/judge/sampling_tests.py) on synthetic distributions where the truth
is known: honest engines are never rejected (the bounds are exact), and each planted engine that
chooses its tokens is, with the power measured here."""

from __future__ import annotations

import math

import pytest
import torch

from targets.harness.judge.sampling_tests import FALSE_ALARM, LAMBDAS, SamplingTests

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


def _clustered(generator, copy: bool) -> SamplingTests:
    """Groups of four episodes asking the same prompt (a group shares its task): honest, each draws
    its own 8-token response; copying, one decode answers all four."""
    tests = SamplingTests(atol=1e-3, seed=0)
    at = 0.0
    for group in range(40):
        logits = _logits(generator, 8) * 0.3  # flat enough that honest repeats are rare
        shared = _honest(logits, generator)
        for member in range(4):
            chosen = shared if copy else _honest(logits, generator)
            logp = tests.add(logits, chosen, 1.0, [STOP], [])
            at += 1.0
            tests.add_response(at, 0, [group], f"g{group}/e{member}", 1.0, chosen.tolist())
            tests.add_score(0, 1.0, [group], chosen.tolist(), float(logp.sum()))
    return tests


def test_copied_completions_are_caught_and_honest_repeats_are_not():
    generator = torch.Generator().manual_seed(15)
    honest = dict((name, bound) for name, bound, _ in _clustered(generator, copy=False).results())
    copied = dict((name, bound) for name, bound, _ in _clustered(generator, copy=True).results())
    assert honest["independent samples"] >= FALSE_ALARM
    assert copied["independent samples"] < FALSE_ALARM


def _straddling(generator, copy: bool, score_across: bool = True) -> SamplingTests:
    """Groups of two episodes asking the same prompt, a weight update between their turns: one served
    under version 0, one under version 1. Honest, each draws its own response under its own weights;
    copying, the decode under version 0 is copied to the other, which claims version 1 with version 1's
    log-probabilities (a prefill of the copy there), so the replay agrees with it."""
    tests = SamplingTests(atol=1e-3, seed=0)
    weights: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    for group in range(40):
        before = _logits(generator, 8) * 0.3
        weights[(0, (group,))] = before
        weights[(1, (group,))] = before + 0.05 * torch.randn(before.shape, generator=generator)
        first = _honest(before, generator)
        for version in (0, 1):
            logits = weights[(version, (group,))]
            chosen = first if version == 0 or copy else _honest(logits, generator)
            logp = tests.add(logits, chosen, 1.0, [STOP], [])
            tests.add_response(2.0 * group + version, version, [group], f"g{group}/e{version}", 1.0, chosen.tolist())
            tests.add_score(version, 1.0, [group], chosen.tolist(), float(logp.sum()))
    needed = tests.scores_needed()
    assert sorted(needed) == [1] and len(needed[1]) == 40  # the earlier response of each group, under version 1
    for version, responses in needed.items() if score_across else ():
        for temperature, prompt, tokens in responses:
            logp = torch.log_softmax(weights[(version, prompt)] / temperature, -1).gather(
                -1, torch.tensor(tokens)[:, None]
            )
            tests.add_score(version, temperature, list(prompt), list(tokens), float(logp.sum()))
    return tests


def test_a_copy_claimed_under_the_next_version_is_caught_and_honest_groups_straddling_one_are_not():
    """The independence test compared responses keyed by (version, prompt), so a copy served to a groupmate
    under the next version was never compared with its original: now every earlier response to the prompt
    is, by its probability under the weights the later response claims."""
    generator = torch.Generator().manual_seed(17)
    honest = dict((name, bound) for name, bound, _ in _straddling(generator, copy=False).results())
    copied = _straddling(generator, copy=True)
    assert honest["independent samples"] >= FALSE_ALARM
    assert copied.independence()[0].observed == 40
    assert dict((name, bound) for name, bound, _ in copied.results())["independent samples"] < FALSE_ALARM


def test_a_response_compared_across_versions_without_its_score_is_an_error_not_a_pass():
    generator = torch.Generator().manual_seed(18)
    with pytest.raises(RuntimeError, match="scored under version 1"):
        _straddling(generator, copy=False, score_across=False).independence()


def test_a_peaked_one_token_answer_repeats_often_and_that_is_chance():
    """Responses of one likely token: most members of a group repeat each other honestly."""
    generator = torch.Generator().manual_seed(16)
    tests = SamplingTests(atol=1e-3, seed=0)
    logits = torch.full((1, VOCAB), -4.0)
    logits[0, STOP] = 4.0
    for n in range(200):
        chosen = _honest(logits, generator)
        logp = tests.add(logits, chosen, 1.0, [STOP], [])
        tests.add_response(float(n), 0, [n // 4], f"g{n // 4}/e{n % 4}", 1.0, chosen.tolist())
        tests.add_score(0, 1.0, [n // 4], chosen.tolist(), float(logp.sum()))
    independence = tests.independence()[0]
    assert independence.observed > 100
    assert dict((n, b) for n, b, _ in tests.results())["independent samples"] >= FALSE_ALARM


@pytest.mark.parametrize("copies", [0, 1])
def test_one_copied_long_response_among_many_honest_short_repeats_is_caught(copies):
    """A cluster that copies one response only, once: among a run's honest repeats of peaked short answers
    the count over every comparison cannot tell one more, but among the comparisons whose chance was under
    1e-12 a single repeat is itself the evidence. Honest long responses raise nothing."""
    generator = torch.Generator().manual_seed(19)
    tests = SamplingTests(atol=1e-3, seed=0)
    peaked = torch.full((1, VOCAB), -4.0)
    peaked[0, STOP] = 4.0
    for n in range(200):
        chosen = _honest(peaked, generator)
        logp = tests.add(peaked, chosen, 1.0, [STOP], [])
        tests.add_response(float(n), 0, [n // 4], f"g{n // 4}/e{n % 4}", 1.0, chosen.tolist())
        tests.add_score(0, 1.0, [n // 4], chosen.tolist(), float(logp.sum()))
    flat = _logits(generator, 12) * 0.3
    first = _honest(flat, generator)
    for member in range(2):
        chosen = first if member < copies + 1 else _honest(flat, generator)
        logp = tests.add(flat, chosen, 1.0, [STOP], [])
        tests.add_response(300.0 + member, 0, [999], f"g999/e{member}", 1.0, chosen.tolist())
        tests.add_score(0, 1.0, [999], chosen.tolist(), float(logp.sum()))
    everything, *_, rarest = tests.independence()
    assert everything.false_alarm_bound("upper") >= FALSE_ALARM  # one more among a hundred is chance
    bound = dict((n, b) for n, b, _ in tests.results())["independent samples"]
    if copies:
        assert rarest.observed == 1 and bound < FALSE_ALARM
    else:
        assert rarest.observed == 0 and bound >= FALSE_ALARM


def test_a_long_sibling_does_not_lend_its_slack_to_a_copy():
    """On a bf16 target (logprob_atol 0.05) each earlier response's chance is allowed e^(2a len) for the
    engine's numerics, its own length: a 2,000-token sibling once lent its e^200 to every response it was
    compared with, and a copy of a 400-token response (chance e^-100) was no evidence at all."""
    tests = SamplingTests(atol=0.05, seed=0)
    long, copied = tuple(range(2, 2002)), tuple(range(3, 403))
    served = [("a", long, -3000.0), ("b", copied, -100.0), ("c", copied, -100.0)]
    for at, (episode, tokens, logp) in enumerate(served):
        tests.add_response(float(at), 0, [1], episode, 1.0, list(tokens))
        tests.add_score(0, 1.0, [1], list(tokens), logp)
    bound = min(t.false_alarm_bound("upper") for t in tests.independence()) * len(tests.independence())
    assert bound < FALSE_ALARM


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
