"""What the run's LLM calls cost: the price table (``--prices`` overrides it) and ``Accounting``, which
counts every call's tokens and dollars and refuses a call once the run's budget is spent."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from agents.llm.errors import BudgetSpent, BudgetUnkept

log = logging.getLogger("vibetrain.llm")

# USD per million tokens (input, output); override with --prices FILE (YAML: model: [in, out]).
DEFAULT_PRICES: dict[str, tuple[float, float]] = {
    "gpt-4.1": (2.0, 8.0),
    "gpt-4.1-mini": (0.4, 1.6),
    "gpt-4o": (2.5, 10.0),
    "gpt-4o-mini": (0.15, 0.6),
    "gpt-4o-2024-05-13": (5.0, 15.0),  # the first gpt-4o snapshot, dearer than the alias
    "gpt-4.1-nano": (0.1, 0.4),
    "gpt-5": (1.25, 10.0),
    "gpt-5-mini": (0.25, 2.0),
    "gpt-5-nano": (0.05, 0.4),
    "o3": (2.0, 8.0),
    "o3-pro": (20.0, 80.0),
    "o4-mini": (1.1, 4.4),
    "claude-opus-4": (15.0, 75.0),
    "claude-opus-4-0": (15.0, 75.0),  # the aliases Anthropic gives the 4.0 models
    "claude-sonnet-4-0": (3.0, 15.0),
    "claude-opus-4-1": (15.0, 75.0),
    "claude-opus-4-5": (5.0, 25.0),
    "claude-sonnet-4": (3.0, 15.0),
    "claude-sonnet-4-5": (3.0, 15.0),
    "claude-haiku-4-5": (1.0, 5.0),
    "claude-3-5-haiku": (0.8, 4.0),
}
# A dated snapshot (gpt-4.1-2025-04-14, claude-sonnet-4-20250514) or -latest is priced as its model; any
# other suffix names another model (o3-pro is no o3, at ten times its price) and needs its own entry.
SNAPSHOT = re.compile(r"-(\d{8}|\d{4}-\d{2}-\d{2}|latest)$")

CACHE_WRITE_PRICE = 1.25  # a prompt-cache write, as a multiple of the input price (Anthropic's 5-minute cache)
CACHE_READ_PRICE = 0.1  # a prompt-cache read (Anthropic's; OpenAI's cached input is counted at the input price)


@dataclass
class Accounting:
    """Tokens and dollars, per call and in total; ``prices`` in USD per million tokens. ``max_cost`` and
    ``max_tokens`` are the run's budget over ``spent_before`` (its earlier sessions' use) plus this
    session's; ``check_budget`` is called before every model call. ``on_call`` runs after each call is
    counted (the run saves its spend there, so a killed run resumes knowing every call it paid for)."""

    prices: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_PRICES))
    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    max_cost: float | None = None
    max_tokens: int | None = None
    spent_before: dict = field(default_factory=dict)
    on_call: Callable[[], None] = lambda: None
    _unpriced: set[str] = field(default_factory=set)
    _unreported: set[str] = field(default_factory=set)

    def priced_as(self, model: str) -> str | None:
        """The price table's entry for ``model``: itself, or the model a dated snapshot of it is; None if none."""
        if model in self.prices:
            return model
        base = SNAPSHOT.sub("", model)
        return base if base != model and base in self.prices else None

    def price(self, model: str) -> tuple[float, float]:
        match = self.priced_as(model)
        if match is None:
            if model not in self._unpriced:
                self._unpriced.add(model)
                log.warning("no price known for model %r: its cost counts as 0 (give --prices to set one)", model)
            return 0.0, 0.0
        return self.prices[match]

    def add(
        self,
        model: str,
        input_tokens: int | None,
        output_tokens: int | None,
        cache_write_tokens: int = 0,
        cache_read_tokens: int = 0,
    ) -> float:
        """Count one call (tokens None: the server reported no usage; refused under a budget). The cache's
        writes and reads are of ``input_tokens``, priced at their own multiples of the input price."""
        if input_tokens is None or output_tokens is None:
            input_tokens, output_tokens = self.unreported(model)
        per_in, per_out = self.price(model)
        uncached = input_tokens - cache_write_tokens - cache_read_tokens
        cost = (
            per_in * (uncached + cache_write_tokens * CACHE_WRITE_PRICE + cache_read_tokens * CACHE_READ_PRICE)
            + output_tokens * per_out
        ) / 1e6
        self.calls += 1
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.cost_usd += cost
        self.on_call()
        return cost

    def unreported(self, model: str) -> tuple[int, int]:
        """A call the server reported no usage for: under a token or cost budget the run cannot go on
        (``BudgetUnkept``); without one it counts as no tokens, said once."""
        if self.max_tokens is not None or self.max_cost is not None:
            raise BudgetUnkept(
                f"{model}: the server reported no token usage, so the run's LLM budget (--max-tokens, --max-cost) "
                "cannot be kept; use a server that reports it (vLLM and llama.cpp do) or run without a budget"
            )
        if model not in self._unreported:
            self._unreported.add(model)
            log.warning("%s: the server reported no token usage: its calls count no tokens and no cost", model)
        return 0, 0

    def add_reported(self, input_tokens: int, output_tokens: int, cost_usd: float) -> None:
        """A call whose tokens and cost the agent reported itself (a coding-agent CLI)."""
        self.calls += 1
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.cost_usd += cost_usd
        self.on_call()

    def run_cost(self) -> float:
        """Dollars the whole run has spent: its earlier sessions' and this one's."""
        return self.spent_before.get("cost_usd", 0.0) + self.cost_usd

    def run_tokens(self) -> int:
        """Tokens (input and output) the whole run has spent: its earlier sessions' and this one's."""
        before = self.spent_before.get("input_tokens", 0) + self.spent_before.get("output_tokens", 0)
        return before + self.input_tokens + self.output_tokens

    def check_budget(self) -> None:
        """Raise ``BudgetSpent`` when the run's cost or token budget is already spent."""
        cost, tokens = self.run_cost(), self.run_tokens()
        if self.max_cost is not None and cost >= self.max_cost:
            raise BudgetSpent(f"cost budget of ${self.max_cost:g} spent (${cost:.4f}): no further LLM call")
        if self.max_tokens is not None and tokens >= self.max_tokens:
            raise BudgetSpent(f"token budget of {self.max_tokens} spent ({tokens}): no further LLM call")

    def snapshot(self) -> dict:
        return {
            "calls": self.calls,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": round(self.cost_usd, 6),
        }
