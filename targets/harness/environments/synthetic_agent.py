"""synthetic_agent: an agent loop shaped by the workload — the number of turns, observation size and
tool latency follow the target's distributions (the stand-in for SWE-style tool use).

Each observation shows a few symbols; the agent must repeat them. A turn scores 1 per symbol
repeated in place and ``partial_credit`` per symbol from the alphabet in the wrong place; the
episode's reward is the mean turn score, paid out per step.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

from targets.harness.environments.base import Episode
from targets.harness.tokenizer import ACT, LETTERS


class SyntheticAgentParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    alphabet: int = Field(default=4, ge=2, le=26)
    symbols_per_turn: int = Field(default=2, ge=1, le=8)
    partial_credit: float = Field(default=0.25, ge=0, le=1)


class SyntheticAgent(Episode):
    name = "synthetic_agent"
    Params = SyntheticAgentParams
    draws_turns = True

    def make_task(self, rng: random.Random) -> list[list[str]]:
        letters = LETTERS[: self.params.alphabet]
        return [
            [rng.choice(letters) for _ in range(self.params.symbols_per_turn)]
            for _ in range(self.workload.turns.max)
        ]

    def _show(self, turn: int) -> str:
        return f"repeat {' '.join(self.task[turn])} {ACT}"

    def first_observation(self) -> str:
        return self._show(0)

    def respond(self, action_words: list[str]) -> tuple[str, float, bool]:
        wanted = self.task[self.turn - 1]
        alphabet = set(LETTERS[: self.params.alphabet])
        score = 0.0
        for i, symbol in enumerate(wanted):
            said = action_words[i] if i < len(action_words) else None
            if said == symbol:
                score += 1.0
            elif said in alphabet:
                score += self.params.partial_credit
        reward = score / len(wanted) / self.max_turns
        done = self.turn >= self.max_turns
        return ("ok" if done else self._show(self.turn)), reward, done
