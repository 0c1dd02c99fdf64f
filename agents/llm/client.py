"""Chat clients for the LLM agents on the official SDKs: OpenAI chat completions (any compatible
server through ``base_url``: vLLM, llama.cpp) and Anthropic messages. One neutral conversation format,
tool calls both ways, streaming or not.

Retries are ours, not the SDK's (the SDK's own are switched off so they never stack): 429, 5xx,
timeouts, dropped connections and streams cut mid-way are retried with exponential backoff; an
authentication failure, an unknown model or a malformed request ends the call at once with a message
that says what to fix. Every call's tokens and cost go to the shared ``Accounting``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Protocol

from agents.roles import AgentError

log = logging.getLogger("vibetrain.llm")

# USD per million tokens (input, output); override with --prices FILE (YAML: model: [in, out]).
DEFAULT_PRICES: dict[str, tuple[float, float]] = {
    "gpt-4.1": (2.0, 8.0),
    "gpt-4.1-mini": (0.4, 1.6),
    "gpt-4o": (2.5, 10.0),
    "gpt-4o-mini": (0.15, 0.6),
    "o3": (2.0, 8.0),
    "o4-mini": (1.1, 4.4),
    "claude-opus-4": (15.0, 75.0),
    "claude-sonnet-4": (3.0, 15.0),
    "claude-3-5-haiku": (0.8, 4.0),
}


class LLMError(AgentError):
    """A call that cannot succeed as configured, or that failed after its retries."""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the raw JSON text the model wrote (it may not parse)


@dataclass
class AssistantTurn:
    text: str
    tool_calls: list[ToolCall]
    input_tokens: int = 0
    output_tokens: int = 0


@dataclass
class ToolSpec:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object


@dataclass
class Accounting:
    """Tokens and dollars, per call and in total; ``prices`` in USD per million tokens."""

    prices: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_PRICES))
    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    _unpriced: set[str] = field(default_factory=set)

    def price(self, model: str) -> tuple[float, float]:
        match = max((m for m in self.prices if model == m or model.startswith(m + "-")), key=len, default=None)
        if match is None:
            if model not in self._unpriced:
                self._unpriced.add(model)
                log.warning("no price known for model %r: its cost counts as 0 (give --prices to set one)", model)
            return 0.0, 0.0
        return self.prices[match]

    def add(self, model: str, input_tokens: int, output_tokens: int) -> float:
        per_in, per_out = self.price(model)
        cost = (input_tokens * per_in + output_tokens * per_out) / 1e6
        self.calls += 1
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.cost_usd += cost
        return cost

    def add_reported(self, input_tokens: int, output_tokens: int, cost_usd: float) -> None:
        """A call whose tokens and cost the agent reported itself (a coding-agent CLI)."""
        self.calls += 1
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.cost_usd += cost_usd

    def snapshot(self) -> dict:
        return {
            "calls": self.calls,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": round(self.cost_usd, 6),
        }


@dataclass
class ClientConfig:
    provider: str  # openai | anthropic
    model: str
    api_key_env: str
    base_url: str | None = None
    stream: bool = True
    max_retries: int = 4
    backoff_s: float = 1.0
    timeout_s: float = 120.0
    max_tokens: int = 4096

    def api_key(self) -> str:
        key = os.environ.get(self.api_key_env)
        if not key:
            raise LLMError(f"no API key: set ${self.api_key_env} (or name another variable with --api-key-env)")
        return key


class ChatClient(Protocol):
    accounting: Accounting

    def chat(self, system: str, messages: list[dict], tools: list[ToolSpec]) -> AssistantTurn: ...


def make_client(config: ClientConfig, accounting: Accounting) -> ChatClient:
    if config.provider == "openai":
        return OpenAIChat(config, accounting)
    if config.provider == "anthropic":
        return AnthropicChat(config, accounting)
    raise LLMError(f"unknown provider {config.provider!r}; known: openai, anthropic")


class _RetryingClient:
    """The retry loop both providers share; subclasses say which errors are transient."""

    def __init__(self, config: ClientConfig, accounting: Accounting) -> None:
        self.config, self.accounting = config, accounting

    def chat(self, system: str, messages: list[dict], tools: list[ToolSpec]) -> AssistantTurn:
        attempt = 0
        while True:
            try:
                turn = self._call(system, messages, tools)
            except Exception as error:  # classified just below; anything unrecognised is re-raised unchanged
                transient, message = self._classify(error)
                if message is None:
                    raise
                if not transient:
                    raise LLMError(message) from error
                attempt += 1
                if attempt > self.config.max_retries:
                    raise LLMError(f"{message}; gave up after {self.config.max_retries} retries") from error
                delay = self.config.backoff_s * 2 ** (attempt - 1)
                log.warning("%s; retry %d/%d in %.1fs", message, attempt, self.config.max_retries, delay)
                time.sleep(delay)
                continue
            self.accounting.add(self.config.model, turn.input_tokens, turn.output_tokens)
            return turn

    def _call(self, system: str, messages: list[dict], tools: list[ToolSpec]) -> AssistantTurn:
        raise NotImplementedError

    def _classify(self, error: Exception) -> tuple[bool, str | None]:
        """(transient?, message) for the SDK's errors (both SDKs name them alike); (False, None) for
        anything else, which is re-raised unchanged."""
        sdk, host = self.sdk, self.config.base_url or self.default_host
        where = f"{self.config.provider} {self.config.model} at {host}"
        if isinstance(error, sdk.AuthenticationError):
            return False, f"{where}: authentication failed (401): check ${self.config.api_key_env}"
        if isinstance(error, sdk.NotFoundError):
            return False, f"{where}: not found (404): is the model name right? ({error.message})"
        if isinstance(error, sdk.RateLimitError):
            return True, f"{where}: rate limited (429)"
        if isinstance(error, sdk.APIStatusError):
            return error.status_code >= 500, f"{where}: HTTP {error.status_code}: {error.message}"
        if isinstance(error, (sdk.APIConnectionError, sdk.APITimeoutError, _StreamCut)):
            return True, f"{where}: connection failed or stream cut ({type(error).__name__}: {error})"
        return False, None


class OpenAIChat(_RetryingClient):
    def __init__(self, config: ClientConfig, accounting: Accounting) -> None:
        super().__init__(config, accounting)
        import openai

        self.sdk, self.default_host = openai, "api.openai.com"
        self.client = openai.OpenAI(
            api_key=config.api_key(), base_url=config.base_url, max_retries=0, timeout=config.timeout_s
        )

    @staticmethod
    def _messages(system: str, messages: list[dict]) -> list[dict]:
        out: list[dict] = [{"role": "system", "content": system}]
        for m in messages:
            if m["role"] == "user":
                out.append({"role": "user", "content": m["content"]})
            elif m["role"] == "assistant":
                entry: dict = {"role": "assistant", "content": m.get("text") or None}
                if m.get("tool_calls"):
                    entry["tool_calls"] = [
                        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                        for c in m["tool_calls"]
                    ]
                out.append(entry)
            else:
                out.append({"role": "tool", "tool_call_id": m["tool_call_id"], "content": m["content"]})
        return out

    def _call(self, system: str, messages: list[dict], tools: list[ToolSpec]) -> AssistantTurn:
        kwargs: dict = {
            "model": self.config.model,
            "messages": self._messages(system, messages),
            "max_tokens": self.config.max_tokens,
        }
        if tools:
            kwargs["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
                }
                for t in tools
            ]
        if not self.config.stream:
            response = self.client.chat.completions.create(**kwargs)
            message = response.choices[0].message
            calls = [ToolCall(c.id, c.function.name, c.function.arguments or "") for c in (message.tool_calls or [])]
            usage = response.usage
            return AssistantTurn(
                message.content or "",
                calls,
                usage.prompt_tokens if usage else 0,
                usage.completion_tokens if usage else 0,
            )
        text, calls, usage = [], {}, None
        finished = False
        for chunk in self.client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content:
                    text.append(delta.content)
                for call in delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    entry["id"] = call.id or entry["id"]
                    if call.function is not None:
                        entry["name"] += call.function.name or ""
                        entry["arguments"] += call.function.arguments or ""
                finished = finished or choice.finish_reason is not None
        if not finished:
            raise _StreamCut("the stream ended before the model finished")
        return AssistantTurn(
            "".join(text),
            [ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())],
            usage.prompt_tokens if usage else 0,
            usage.completion_tokens if usage else 0,
        )


class AnthropicChat(_RetryingClient):
    def __init__(self, config: ClientConfig, accounting: Accounting) -> None:
        super().__init__(config, accounting)
        import anthropic

        self.sdk, self.default_host = anthropic, "api.anthropic.com"
        self.client = anthropic.Anthropic(
            api_key=config.api_key(), base_url=config.base_url, max_retries=0, timeout=config.timeout_s
        )

    @staticmethod
    def _messages(messages: list[dict]) -> list[dict]:
        out: list[dict] = []
        for m in messages:
            if m["role"] == "user":
                out.append({"role": "user", "content": m["content"]})
            elif m["role"] == "assistant":
                blocks: list[dict] = [{"type": "text", "text": m["text"]}] if m.get("text") else []
                for call in m.get("tool_calls") or []:
                    try:
                        arguments = json.loads(call.arguments) if call.arguments else {}
                    except json.JSONDecodeError:
                        arguments = {"_unparsed": call.arguments}
                    blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments})
                out.append({"role": "assistant", "content": blocks})
            else:
                result = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
                if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                    out[-1]["content"].append(result)  # results of one turn's calls go back together
                else:
                    out.append({"role": "user", "content": [result]})
        return out

    def _call(self, system: str, messages: list[dict], tools: list[ToolSpec]) -> AssistantTurn:
        kwargs: dict = {
            "model": self.config.model,
            "system": system,
            "messages": self._messages(messages),
            "max_tokens": self.config.max_tokens,
        }
        if tools:
            kwargs["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters} for t in tools
            ]
        if not self.config.stream:
            message = self.client.messages.create(**kwargs)
        else:
            with self.client.messages.stream(**kwargs) as stream:
                for _ in stream:
                    pass
                message = stream.get_final_message()
            if message.stop_reason is None:
                raise _StreamCut("the stream ended before the model finished")
        text = "".join(b.text for b in message.content if b.type == "text")
        calls = [ToolCall(b.id, b.name, json.dumps(b.input)) for b in message.content if b.type == "tool_use"]
        return AssistantTurn(text, calls, message.usage.input_tokens, message.usage.output_tokens)


class _StreamCut(RuntimeError):
    """A stream that ended without the model's final event."""
