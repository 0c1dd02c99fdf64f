"""The errors of an LLM call, by what the run does about them: ``LLMError`` ends the call (or the
attempt), ``LLMRefused`` names a request refused for what it held, ``LLMUnusable`` stops the run (the
backend refuses its configuration), ``BudgetSpent`` ends it at its budget."""

from __future__ import annotations

from agents.roles import AgentError


class LLMError(AgentError):
    """A call that cannot succeed as configured, or that failed after its retries."""


class BudgetSpent(LLMError):
    """The run's LLM budget (``--max-cost``, ``--max-tokens``) is spent: no further call is made. An
    ``AgentError``, so the attempt in progress ends and the round loop stops at its budget check."""


class LLMUnusable(LLMError):
    """The provider refuses the run's configuration (its key, its permission, its model: 401, 403, 404;
    the account's quota, credit or spend limit): every later call would fail alike, so the run stops
    naming it, rather than fail round after round."""


class LLMRefused(LLMError):
    """The provider refused this request for what it holds (a context past the model's window, a request
    too large, content its filter flags: ``client.CONTENT_REFUSAL``): retrying it cannot help, and the
    content may be a candidate's, put there to make its reviewer fail (``LLMJudge`` rejects on it)."""


class BudgetUnkept(LLMUnusable):
    """The run has an LLM budget and the server reports no token usage: the budget cannot be kept, so
    the backend cannot be used as configured, and the run stops rather than spend past it unseen."""
