"""The audit's statistics, on synthetic data where the truth is known: the temperature test's false
alarm rate on honest sampling (skewed sampling included, where a normal approximation fails) and its
power against too cold, too hot or greedy sampling, and the replay sample size's arithmetic."""

from __future__ import annotations

import math

import torch

from targets.harness.replay import FALSE_ALARM, SAMPLED_TURNS, TemperatureTest


def _test(logits: torch.Tensor, temperature: float, sampled_at: float, generator: torch.Generator) -> TemperatureTest:
    """The temperature test over tokens sampled from softmax(logits / sampled_at), claimed at ``temperature``."""
    chosen = torch.multinomial(torch.softmax(logits / sampled_at, -1), 1, generator=generator).squeeze(-1)
    test = TemperatureTest()
    test.add(logits, chosen, temperature)
    return test


def _logits(generator: torch.Generator, tokens: int, vocab: int = 64) -> torch.Tensor:
    """Distributions from nearly flat to sharply peaked, as a small model's turns are."""
    sharpness = torch.rand(tokens, 1, generator=generator) * 4 + 0.2
    return torch.randn(tokens, vocab, generator=generator) * sharpness


def _peaked(tokens: int, vocab: int = 64, rare: float = 2e-3) -> torch.Tensor:
    """One likely token and a rare rest (``rare`` in all): a trained policy's turns. Honest sampling makes
    the sum of log-probabilities skewed, mostly small gains and a rare large loss."""
    logits = torch.full((tokens, vocab), math.log(rare / (vocab - 1)))
    logits[:, 0] = math.log(1 - rare)
    return logits


def test_honest_sampling_never_looks_dishonest():
    """1,500 honest runs of 30 to 3,000 tokens, mixed distributions: no alarm (the bound allows 1e-4)."""
    generator = torch.Generator().manual_seed(7)
    alarms = 0
    for tokens, trials in ((30, 800), (300, 550), (3000, 150)):
        for _ in range(trials):
            alarms += _test(_logits(generator, tokens), 1.0, 1.0, generator).false_alarm_bound() < FALSE_ALARM
    assert alarms == 0


def test_skewed_honest_sampling_fools_a_normal_approximation_but_not_the_bound():
    """The peaked case: |z| > 4 in 0.4% of honest runs here (the normal tail says 6.3e-5); the bound in none."""
    generator = torch.Generator().manual_seed(9)
    runs = [_test(_peaked(100, rare=1e-3), 1.0, 1.0, generator) for _ in range(1000)]
    normal_alarms = sum(abs(run.z) > 4.0 for run in runs)
    assert normal_alarms / len(runs) > 20 * 6.3e-5, normal_alarms  # what rejected an honest starter
    assert not [run for run in runs if run.false_alarm_bound() < FALSE_ALARM]


def test_sampling_too_cold_or_too_hot_is_caught():
    generator = torch.Generator().manual_seed(8)
    for sampled_at in (0.7, 1.4):
        tests = [_test(_logits(generator, 3000), 1.0, sampled_at, generator) for _ in range(20)]
        assert all(t.false_alarm_bound() < FALSE_ALARM for t in tests), (sampled_at, [t.z for t in tests])
        assert all((t.z > 0) == (sampled_at < 1.0) for t in tests)  # colder: tokens likelier than they should be
    greedy, logits = TemperatureTest(), _logits(generator, 300)  # always the likeliest token, 300 of them
    greedy.add(logits, logits.argmax(-1), 1.0)
    assert greedy.false_alarm_bound() < FALSE_ALARM and greedy.z > 0
    impossible, logits = TemperatureTest(), _logits(generator, 30)  # one token the model rules out
    logits[0, 5] = -math.inf
    impossible.add(logits, torch.tensor([5] + [0] * 29), 1.0)
    assert impossible.false_alarm_bound() == 0.0


def test_the_replay_sample_catches_a_one_percent_cheat_with_probability_099():
    assert SAMPLED_TURNS == 459
    assert 0.99**SAMPLED_TURNS <= 0.01 < 0.99 ** (SAMPLED_TURNS - 1)
