"""The fewest engine steps a request's tokens could have taken (targets/harness/judge/decode_steps.py):
against a search over every draft a prompt-lookup drafter could have proposed, on small random texts."""

from __future__ import annotations

import random

import pytest

from targets.harness.judge.decode_steps import fewest_steps


def _by_search(prompt: list[int], tokens: list[int], drafts: int) -> int:
    """Breadth-first over the positions a step may reach: from position ``i`` each earlier occurrence of the
    sequence's last token proposes what followed it (any length up to ``drafts``, within the sequence as it
    stood); the step keeps the proposed tokens the response repeats and adds one of its own."""
    n, frontier, steps = len(tokens), {0}, 0
    while n not in frontier:
        reached = set()
        for i in frontier:
            sequence = prompt + tokens[:i]
            reached.add(i + 1)
            for j in range(len(sequence) - 1):
                if not sequence or sequence[j] != sequence[-1]:
                    continue
                kept = 0
                while kept < drafts and j + 1 + kept < len(sequence) and i + kept < n:
                    if sequence[j + 1 + kept] != tokens[i + kept]:
                        break
                    kept += 1
                reached.add(min(i + kept + 1, n))
        frontier, steps = reached, steps + 1
    return steps


@pytest.mark.parametrize("seed", range(40))
def test_the_fewest_steps_are_those_a_search_over_every_draft_finds(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 40])  # few words repeat often; many rarely
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
    drafts = rng.choice([1, 2, 4, 8])
    assert fewest_steps(prompt, tokens, drafts) == _by_search(prompt, tokens, drafts)


def test_a_copy_of_the_prompt_is_drafted_and_new_text_is_not():
    prompt = list(range(1, 17))
    assert fewest_steps(prompt, list(range(1, 17)), 4) == 4  # its first token, then 5 a step
    assert fewest_steps(prompt, list(range(1, 17)), 8) == 3
    assert fewest_steps(prompt, list(range(100, 116)), 8) == 16  # nothing to draft from: a token a step
    assert fewest_steps(prompt, list(range(1, 17)), 0) == 16  # a stack that does not draft
    assert fewest_steps(prompt, [], 8) == 0
