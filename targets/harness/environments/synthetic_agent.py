"""synthetic_agent: an agent loop shaped by the workload — the number of turns, observation size and
tool latency follow the target's distributions (the stand-in for SWE-style tool use).

Each observation shows a few symbols; the agent must repeat them. A turn scores 1 per symbol
repeated in place and ``partial_credit`` per symbol from the alphabet in the wrong place; the
episode's reward is the mean turn score, paid out per step.

``filler_as_letters`` is for randomly initialised models with a real vocabulary: Qwen3-0.6B's
151,936 ids hold 53 named words, so a random policy all but never says a letter, every reward is 0,
every GRPO advantage 0, and training changes nothing (the first H100 run of qwen3-0.6b-h100x1: 393
turns, all rewarded 0; the audit failed it "weights unchanged"). With it, filler token ``<uN>`` reads
as letter ``N mod alphabet``: a random policy says the right letter 1 time in ``alphabet``, rewards
vary within a group, and the policy can learn to say the right ones.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from targets.harness.environments.base import Episode
from targets.harness.tokenizer import ACT, FILLER_PREFIX, LETTERS


class SyntheticAgentParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alphabet: int = Field(default=4, ge=2, le=26)
    symbols_per_turn: int = Field(default=2, ge=1, le=8)
    partial_credit: float = Field(default=0.25, ge=0, le=1)
    filler_as_letters: bool = False


class Symbols:
    """A task: the symbols of each turn, drawn as turns are reached (most episodes end long before
    ``turns.max``). The members of a group share one, so they see the same symbols."""

    def __init__(self, rng: random.Random, letters: list[str], per_turn: int) -> None:
        self.rng, self.letters, self.per_turn = rng, letters, per_turn
        self.alphabet = set(letters)
        self.drawn: list[list[str]] = []

    def of(self, turn: int) -> list[str]:
        while len(self.drawn) <= turn:
            self.drawn.append([self.rng.choice(self.letters) for _ in range(self.per_turn)])
        return self.drawn[turn]


class SyntheticAgent(Episode):
    name = "synthetic_agent"
    Params = SyntheticAgentParams
    draws_turns = True

    def make_task(self, rng: random.Random) -> Symbols:
        return Symbols(rng, LETTERS[: self.params.alphabet], self.params.symbols_per_turn)

    def symbols(self, turn: int) -> list[str]:
        return self.task.of(turn)

    def _show(self, turn: int) -> str:
        return f"repeat {' '.join(self.symbols(turn))} {ACT}"

    def first_observation(self) -> str:
        return self._show(0)

    def respond(self, action_words: Sequence[str]) -> tuple[str, float, bool]:
        wanted, alphabet = self.symbols(self.turn - 1), self.task.alphabet
        words = action_words[: len(wanted)]  # one slice: the action may be hundreds of tokens long
        score = 0.0
        for i, symbol in enumerate(wanted):
            said = self._as_letter(words[i]) if i < len(words) else None
            if said == symbol:
                score += 1.0
            elif said in alphabet:
                score += self.params.partial_credit
        reward = score / len(wanted) / self.max_turns
        done = self.turn >= self.max_turns
        return ("ok" if done else self._show(self.turn)), reward, done

    def _as_letter(self, word: str) -> str:
        """The word as said, or with ``filler_as_letters`` a filler token ``<uN>`` as its letter."""
        if self.params.filler_as_letters and word.startswith(FILLER_PREFIX) and word.endswith(">"):
            return LETTERS[int(word[len(FILLER_PREFIX) : -1]) % self.params.alphabet]
        return word
