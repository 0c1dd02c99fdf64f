"""The audit's statistics, on synthetic data where the truth is known: the temperature test's false
alarm rate on honest sampling and its power against too cold or too hot sampling, and the replay
sample size's arithmetic."""

from __future__ import annotations

import math

import torch

from targets.harness.replay import SAMPLED_TURNS, TEMPERATURE_Z, temperature_terms


def _z(logits: torch.Tensor, temperature: float, sampled_at: float, generator: torch.Generator) -> float:
    probs = torch.softmax(logits / sampled_at, -1)
    chosen = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    deviation, variance = temperature_terms(logits, chosen, temperature)
    return deviation / math.sqrt(variance)


def _logits(generator: torch.Generator, tokens: int, vocab: int = 64) -> torch.Tensor:
    """Distributions from nearly flat to sharply peaked, as a small model's turns are."""
    sharpness = torch.rand(tokens, 1, generator=generator) * 4 + 0.2
    return torch.randn(tokens, vocab, generator=generator) * sharpness


def test_honest_sampling_rarely_looks_dishonest():
    """10,000 honest runs of 30 to 3,000 tokens: |z| > 4 in under 1e-3 of them (nominal 6.3e-5)."""
    generator = torch.Generator().manual_seed(7)
    alarms, runs = 0, 0
    for tokens in (30, 300, 3000):
        trials = {30: 6000, 300: 3000, 3000: 1000}[tokens]
        for _ in range(trials):
            alarms += abs(_z(_logits(generator, tokens), 1.0, 1.0, generator)) > TEMPERATURE_Z
            runs += 1
    assert runs == 10000 and alarms / runs < 1e-3, (alarms, runs)


def test_sampling_too_cold_or_too_hot_is_caught():
    generator = torch.Generator().manual_seed(8)
    for sampled_at in (0.7, 1.4):
        zs = [_z(_logits(generator, 3000), 1.0, sampled_at, generator) for _ in range(20)]
        assert all(abs(z) > TEMPERATURE_Z for z in zs), (sampled_at, zs)
        assert all((z > 0) == (sampled_at < 1.0) for z in zs)  # colder: tokens likelier than they should be


def test_the_replay_sample_catches_a_one_percent_cheat_with_probability_099():
    assert SAMPLED_TURNS == 459
    assert 0.99**SAMPLED_TURNS <= 0.01 < 0.99 ** (SAMPLED_TURNS - 1)
