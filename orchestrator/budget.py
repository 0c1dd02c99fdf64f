"""A run's LLM spend: what the run has used over all its sessions (the state's figure plus what this
session's accounting has counted since it was last saved) and whether a budget stops it."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.config import RunConfig


@dataclass
class LLMBudget:
    accounting: object | None  # the backend's (None offline): counts calls, tokens, dollars
    _at_save: dict = field(default_factory=dict)  # the accounting when the state's figure was last updated

    def snapshot(self) -> dict:
        return self.accounting.snapshot() if self.accounting is not None else {}

    def totals(self, saved: dict) -> dict:
        """The run's use: ``saved`` (the state's, earlier sessions included) and what came since."""
        totals = dict(saved)
        for key, value in self.snapshot().items():
            totals[key] = totals.get(key, 0) + value - self._at_save.get(key, 0)
        return totals

    def saved(self) -> None:
        """The state now holds ``totals``: count from here."""
        self._at_save = self.snapshot()

    def since(self, before: dict) -> dict:
        """What was used since ``before`` (a snapshot): one round's calls, tokens and cost."""
        return {k: v - before.get(k, 0) for k, v in self.snapshot().items()}

    @staticmethod
    def spent(used: dict, config: RunConfig) -> str:
        """Why the budget stops the run ('' while it does not)."""
        if config.max_cost is not None and used.get("cost_usd", 0.0) >= config.max_cost:
            return f"cost budget of ${config.max_cost:g} spent (${used['cost_usd']:.4f})"
        tokens = used.get("input_tokens", 0) + used.get("output_tokens", 0)
        if config.max_tokens is not None and tokens >= config.max_tokens:
            return f"token budget of {config.max_tokens} spent ({tokens})"
        return ""
