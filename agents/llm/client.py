"""Chat clients for the LLM agents on the official SDKs: OpenAI chat completions (any compatible
server through ``base_url``: vLLM, llama.cpp) and Anthropic messages. One neutral conversation format,
tool calls both ways, streaming or not.

Retries are ours, not the SDK's (the SDK's own are switched off with ``max_retries=0`` so they never
stack): 429, 5xx, timeouts, dropped connections and streams cut mid-way are retried after
``max(retry-after, full-jitter exponential)`` seconds (see ``_RetryingClient.delay``); an
authentication failure, an unknown model or a malformed request ends the call at once with a message
that says what to fix. Every call's tokens and cost go to the shared ``Accounting``, which refuses a
call once the run's cost or token budget is spent (``BudgetSpent``).

The output limit goes to OpenAI as ``max_tokens``, or as ``max_completion_tokens`` for the reasoning
models that refuse ``max_tokens`` (o1, o3, o4, gpt-5 and their variants; any other model that answers
with that 400 is switched once and remembered). A reply cut at the limit comes back with ``cut_at``
set, so the agents tell the model instead of taking the cut text as an answer.
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, replace
from typing import Protocol

from agents.llm.accounting import Accounting
from agents.llm.errors import LLMError, LLMRefused, LLMUnusable

log = logging.getLogger("vibetrain.llm")


CHARACTERS_PER_TOKEN = 4  # what an output the server did not count is estimated at (English text and code)
DEFAULT_MAX_OUTPUT_TOKENS = 4096  # one reply's limit unless --max-output-tokens says otherwise

# OpenAI models that refuse ``max_tokens`` and need ``max_completion_tokens`` (the o-series reasoning
# models and gpt-5), matched on the name after any ``provider/`` prefix: o3, o4-mini, gpt-5.1, ...
COMPLETION_TOKENS_MODELS = re.compile(r"^(o1|o3|o4|gpt-5)([-.]|$)")

# A reply with neither text nor a tool call goes back to the provider as this text: Anthropic refuses
# an empty content list or an empty text block with a 400, and strict OpenAI-compatible servers refuse
# an assistant message with neither content nor tool calls. A placeholder, not omission: omitting the
# turn would put two user messages in a row (refused by chat templates that need alternating roles),
# and would hide from the model that its last reply was empty.
EMPTY_REPLY = "(empty reply: no text and no tool call)"


def assistant_text(message: dict) -> str:
    """An assistant turn's text as it goes back to the provider: blank text becomes "" beside a tool
    call (dropped), or ``EMPTY_REPLY`` when the turn has nothing else (an empty or blank text block is
    a 400 too)."""
    text = message.get("text") or ""
    if text.strip():
        return text
    return "" if message.get("tool_calls") else EMPTY_REPLY


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the raw JSON text the model wrote (it may not parse)


@dataclass
class AssistantTurn:
    text: str
    tool_calls: list[ToolCall]
    input_tokens: int | None = 0  # None: the server reported no usage
    output_tokens: int | None = 0
    cut_at: int | None = None  # the output limit the reply was cut at (finish_reason "length",
    # stop_reason "max_tokens"): its text and tool calls may be incomplete; None when it finished
    cache_write_tokens: int = 0  # of input_tokens, those written to the provider's prompt cache (priced higher)
    cache_read_tokens: int = 0  # of input_tokens, those read from Anthropic's prompt cache (priced lower)


@dataclass
class AttemptUsage:
    """What one attempt's stream said of its usage before it ended. A stream that started is billed
    even when it fails: its tokens count, so retries cannot spend past the budget unseen."""

    started: bool = False  # a first event arrived: the provider began the request
    input_tokens: int | None = None  # as the provider reported it (Anthropic's message_start)
    output_tokens: int = 0
    cache_write_tokens: int = 0
    cache_read_tokens: int = 0


@dataclass
class ToolSpec:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object


@dataclass
class ClientConfig:
    provider: str  # openai | anthropic
    model: str
    api_key_env: str
    base_url: str | None = None
    stream: bool = True
    max_retries: int = 4
    backoff_s: float = 1.0  # the exponential backoff's first ceiling (doubled per retry)
    max_backoff_s: float = 120.0  # no wait is longer; a longer retry-after gives up (as the SDKs do)
    timeout_s: float = 120.0
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS  # one reply's limit

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


def retry_after(error: Exception) -> float | None:
    """Seconds the server asked to wait (``retry-after-ms``, else ``retry-after`` in seconds or as an
    HTTP date; the headers both SDKs read), or None when the error carries no such header."""
    response = getattr(error, "response", None)
    headers = getattr(response, "headers", None)
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) / scale
        except ValueError:
            continue
        if not math.isnan(seconds):
            return max(seconds, 0.0)  # an infinite wait is more than any cap: the call gives up
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        log.warning("ignoring a retry-after header that is neither seconds nor a date: %r", value)
        return None
    return max(when.timestamp() - time.time(), 0.0)


class _RetryingClient:
    """The retry loop both providers share; subclasses say which errors are transient."""

    def __init__(self, config: ClientConfig, accounting: Accounting) -> None:
        self.config, self.accounting = config, accounting
        self.random = random.Random()
        self.sleep = time.sleep  # tests record the waits instead of sleeping them
        self.attempt = AttemptUsage()  # the current attempt's, kept up by ``_call`` as its stream goes
        self.reported_input: int | None = None  # the last call's input tokens, as its server reported them

    def delay(self, attempt: int, asked: float | None) -> float:
        """The wait before retry ``attempt`` (1, 2, ...): full jitter, uniform in [0, ceiling] with the
        ceiling ``backoff_s * 2**(attempt-1)`` capped at ``max_backoff_s``, but never shorter than the
        server's ``retry-after`` (``asked``)."""
        ceiling = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** (attempt - 1))
        return max(asked or 0.0, self.random.uniform(0.0, ceiling))

    def chat(self, system: str, messages: list[dict], tools: list[ToolSpec]) -> AssistantTurn:
        self.accounting.check_budget()
        attempt = 0
        while True:
            self.attempt = AttemptUsage()
            try:
                turn = self._call(system, messages, tools)
            except Exception as error:  # classified just below; anything unrecognised is re-raised unchanged
                self._count_failed_attempt(error)
                kind, message = self._classify(error)
                if message is None:
                    raise
                if kind is not None:  # a refusal of the run's configuration stops the run; of the request, the call
                    raise kind(message) from error
                attempt += 1
                if attempt > self.config.max_retries:
                    raise LLMError(f"{message}; gave up after {self.config.max_retries} retries") from error
                asked = retry_after(error)
                if asked is not None and asked > self.config.max_backoff_s:
                    raise LLMError(
                        f"{message}; the server asks to retry after {asked:.0f}s, more than the "
                        f"{self.config.max_backoff_s:g}s this client waits"
                    ) from error
                delay = self.delay(attempt, asked)
                log.warning("%s; retry %d/%d in %.1fs", message, attempt, self.config.max_retries, delay)
                self.sleep(delay)
                continue
            if turn.input_tokens is None and self.reported_input is not None:
                turn = self._estimated(turn)
            elif turn.input_tokens is not None:
                self.reported_input = turn.input_tokens
            self.accounting.add(
                self.config.model,
                turn.input_tokens,
                turn.output_tokens,
                turn.cache_write_tokens,
                turn.cache_read_tokens,
            )
            return turn

    def _count_failed_attempt(self, error: Exception) -> None:
        """A stream that started and then failed was billed: its tokens count, as reported, else its input
        estimated as the last call's (a conversation only grows) and its output by the characters it
        streamed, said each time."""
        spent = self.attempt
        if not spent.started:
            return  # refused before it began (a 429, a 5xx, a refused connection): nothing billed
        input_tokens, how = spent.input_tokens, "reported"
        if input_tokens is None:
            input_tokens, how = self.reported_input, "estimated as the last call's"
        if input_tokens is None:
            log.warning(
                "%s: an attempt failed mid-stream (%s) before its usage was reported, and no call before it "
                "reported any: its tokens are not known and count as none",
                self.config.model,
                type(error).__name__,
            )
            return
        log.warning(
            "%s: an attempt failed mid-stream (%s): its %d input tokens (%s) and %d output tokens count",
            self.config.model,
            type(error).__name__,
            input_tokens,
            how,
            spent.output_tokens,
        )
        self.accounting.add(
            self.config.model, input_tokens, spent.output_tokens, spent.cache_write_tokens, spent.cache_read_tokens
        )

    def _estimated(self, turn: AssistantTurn) -> AssistantTurn:
        """A reply whose usage never came although this server reports usage (an OpenAI stream cut after
        its last choice, before its usage chunk): its input estimated as the last call's, its output at
        four characters a token, said each time (not the refusal a server that never reports usage gets)."""
        written = len(turn.text) + sum(len(c.name) + len(c.arguments) for c in turn.tool_calls)
        estimate = replace(
            turn, input_tokens=self.reported_input, output_tokens=math.ceil(written / CHARACTERS_PER_TOKEN)
        )
        log.warning(
            "%s: the reply came without its usage (the stream was cut before it): counted as %d input tokens "
            "(the last call's) and %d output tokens (four characters a token)",
            self.config.model,
            estimate.input_tokens,
            estimate.output_tokens,
        )
        return estimate

    def _call(self, system: str, messages: list[dict], tools: list[ToolSpec]) -> AssistantTurn:
        raise NotImplementedError

    def _classify(self, error: Exception) -> tuple[type[LLMError] | None, str | None]:
        """(what to raise, message) for the SDK's errors (both SDKs name them alike): None to raise for a
        transient one (retried); ``LLMUnusable`` where every later call would fail alike (the key, the
        permission, the model, the account's quota or credit); ``LLMRefused`` for a request refused for
        what it holds. (None, None) for anything else, which is re-raised unchanged."""
        sdk, host = self.sdk, self.config.base_url or self.default_host
        where = f"{self.config.provider} {self.config.model} at {host}"
        if isinstance(error, sdk.AuthenticationError):
            return LLMUnusable, f"{where}: authentication failed (401): check ${self.config.api_key_env}"
        if isinstance(error, sdk.PermissionDeniedError):
            return LLMUnusable, f"{where}: permission denied (403): {error.message}"
        if isinstance(error, sdk.NotFoundError):
            return LLMUnusable, f"{where}: not found (404): is the model name right? ({error.message})"
        if isinstance(error, sdk.APIStatusError) and _out_of_credit(error):
            spent = f"the account's quota or credit is spent ({error.status_code})"
            return LLMUnusable, f"{where}: {spent}: {error.message}"
        if isinstance(error, sdk.RateLimitError):
            return None, f"{where}: rate limited (429): {error.message}"
        if isinstance(error, sdk.APIStatusError) and error.status_code < 400:
            # an error event in a stream the server had accepted (Anthropic's overloaded_error comes so)
            kind = _error_type(error.body)
            failed = None if kind in TRANSIENT_STREAM_ERRORS else _failed(error)
            return failed, f"{where}: an error in the stream ({kind}): {error.message}"
        if isinstance(error, sdk.APIStatusError):
            asked = _should_retry(error)
            transient = asked if asked is not None else error.status_code >= 500 or error.status_code in (408, 409)
            return None if transient else _failed(error), f"{where}: HTTP {error.status_code}: {error.message}"
        if isinstance(error, (sdk.APIConnectionError, sdk.APITimeoutError, _StreamCut, *_transport_errors())):
            return None, f"{where}: connection failed or stream cut ({type(error).__name__}: {error})"
        if isinstance(error, sdk.APIError):  # an error payload in the stream (OpenAI raises it without a status)
            kind = _error_type(error.body)
            failed = _failed(error) if kind in PERMANENT_STREAM_ERRORS else None
            return failed, f"{where}: an error in the stream ({kind}): {error.message}"
        return None, None


# Errors a server may send inside a stream it had accepted, by their type: these pass with a retry
# (overloaded, an internal error), the permanent ones name a request that can never succeed.
TRANSIENT_STREAM_ERRORS = frozenset({"overloaded_error", "api_error", "rate_limit_error", "server_error"})
PERMANENT_STREAM_ERRORS = frozenset({"invalid_request_error", "authentication_error", "permission_error"})


def _error_type(body: object) -> str:
    """An error body's type (``{"type": ...}``, or nested under ``error``), "unknown" where it names none."""
    if isinstance(body, dict):
        inner = body.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("type"), str):
            return inner["type"]
        if isinstance(body.get("type"), str) and body["type"] != "error":
            return body["type"]
    return "unknown"


# What a provider says when the account, not the request, is the problem: OpenAI's 429 with
# ``insufficient_quota`` (the rate limiter's status, but no wait ends it), Anthropic's ``billing_error``
# and its 400 "credit balance is too low".
OUT_OF_CREDIT_TYPES = frozenset({"insufficient_quota", "billing_error"})


def _out_of_credit(error: Exception) -> bool:
    body = getattr(error, "body", None)
    inner = body.get("error", body) if isinstance(body, dict) else None
    code = inner.get("code") if isinstance(inner, dict) else None
    message = str(getattr(error, "message", "")).lower()
    return (
        getattr(error, "status_code", None) == 402
        or _error_type(body) in OUT_OF_CREDIT_TYPES
        or code in OUT_OF_CREDIT_TYPES
        or "enforced_spend_limit_reached" in str(body)  # Anthropic's workspace limit, a 429 no wait ends
        or "credit balance" in message
        or "spend limit" in message
        or "api usage limits" in message  # Anthropic's workspace limit as a 400: "... regain access on ..."
    )


# What a provider says when it refuses a request for what it holds, not for how it was asked: a context
# past the model's window (OpenAI's context_length_exceeded, Anthropic's "prompt is too long", vLLM's
# "maximum context length"), a request too large (413), content its filter flags. A candidate's own text
# can cause these; any other refusal (a bad max_tokens, tool choice a server was not started with) is
# the configuration's, an outage to the review.
CONTENT_REFUSAL = re.compile(
    r"context[ _](length|window|limit|size)|exceed_context|max_model_len|prompt is too long|too many (input )?"
    r"tokens|request[ _]too[ _]large|string_above_max_length|content[ _](policy|filter|management)|"
    r"invalid_prompt|usage polic",
    re.IGNORECASE,
)


def _failed(error: Exception) -> type[LLMError]:
    """A refusal no retry changes: ``LLMRefused`` where the request's content was the reason, else ``LLMError``."""
    said = f"{_error_type(getattr(error, 'body', None))} {getattr(error, 'body', '')} {getattr(error, 'message', '')}"
    content = getattr(error, "status_code", None) == 413 or CONTENT_REFUSAL.search(said) is not None
    return LLMRefused if content else LLMError


def _should_retry(error: Exception) -> bool | None:
    """The server's own word (``x-should-retry: true|false``, which both SDKs honour), None without one."""
    headers = getattr(getattr(error, "response", None), "headers", None)
    said = headers.get("x-should-retry") if headers is not None else None
    return {"true": True, "false": False}.get(said) if said is not None else None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library's transport errors (a connection dropped mid-stream): the SDKs let them through
    unwrapped once a stream has started. Whichever of httpx and httpx2 the installed SDKs imported."""
    return tuple(module.TransportError for name in ("httpx", "httpx2") if (module := sys.modules.get(name)))


def token_parameter(model: str) -> str:
    """The name OpenAI takes the output limit under for ``model``: ``max_completion_tokens`` for the
    reasoning models that refuse ``max_tokens``, else ``max_tokens`` (which every OpenAI-compatible
    server, older vLLM and llama.cpp included, understands)."""
    name = model.rsplit("/", 1)[-1]
    return "max_completion_tokens" if COMPLETION_TOKENS_MODELS.match(name) else "max_tokens"


class OpenAIChat(_RetryingClient):
    def __init__(self, config: ClientConfig, accounting: Accounting) -> None:
        super().__init__(config, accounting)
        import openai

        self.sdk, self.default_host = openai, "api.openai.com"
        self.client = openai.OpenAI(
            api_key=config.api_key(), base_url=config.base_url, max_retries=0, timeout=config.timeout_s
        )
        self.token_parameter = token_parameter(config.model)
        self._switched = False  # the parameter was switched once on the server's word; never again

    def _create(self, **kwargs):
        """``chat.completions.create`` with the output limit under the name the model takes. A model
        that refuses the name sent (the 400 "Unsupported parameter: 'max_tokens' is not supported with
        this model. Use 'max_completion_tokens' instead.", or the other way round) is asked again once
        with the other name, which the client then keeps for the rest of the session."""
        limit = {self.token_parameter: self.config.max_output_tokens}
        try:
            return self.client.chat.completions.create(**kwargs, **limit)
        except self.sdk.BadRequestError as error:
            other = "max_completion_tokens" if self.token_parameter == "max_tokens" else "max_tokens"
            refused = getattr(error, "param", None) == self.token_parameter or (
                f"'{self.token_parameter}' is not supported" in str(error.message)
            )
            if self._switched or not refused or other not in str(error.message):
                raise
            log.warning(
                "%s refuses %r: sending the output limit as %r from now on",
                self.config.model,
                self.token_parameter,
                other,
            )
            self.token_parameter, self._switched = other, True
            return self.client.chat.completions.create(**kwargs, **{other: self.config.max_output_tokens})

    @staticmethod
    def _messages(system: str, messages: list[dict]) -> list[dict]:
        out: list[dict] = [{"role": "system", "content": system}]
        for m in messages:
            if m["role"] == "user":
                out.append({"role": "user", "content": m["content"]})
            elif m["role"] == "assistant":
                text = assistant_text(m)
                entry: dict = {"role": "assistant", "content": text or None}
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
        kwargs: dict = {"model": self.config.model, "messages": self._messages(system, messages)}
        if tools:
            kwargs["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
                }
                for t in tools
            ]
        if not self.config.stream:
            response = self._create(**kwargs)
            message = response.choices[0].message
            calls = [ToolCall(c.id, c.function.name, c.function.arguments or "") for c in (message.tool_calls or [])]
            usage = response.usage
            return AssistantTurn(
                message.content or "",
                calls,
                usage.prompt_tokens if usage else None,
                usage.completion_tokens if usage else None,
                self._cut_at(response.choices[0].finish_reason),
            )
        text, calls, usage = [], {}, None
        finished = None
        streamed = 0  # characters of the reply so far: what a stream that fails midway is estimated by
        for chunk in self._create(**kwargs, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content:
                    text.append(delta.content)
                    streamed += len(delta.content)
                for call in delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    entry["id"] = call.id or entry["id"]
                    if call.function is not None:
                        entry["name"] += call.function.name or ""
                        entry["arguments"] += call.function.arguments or ""
                        streamed += len(call.function.name or "") + len(call.function.arguments or "")
                finished = finished or choice.finish_reason
            self.attempt = AttemptUsage(
                True,
                usage.prompt_tokens if usage else None,
                usage.completion_tokens if usage else math.ceil(streamed / CHARACTERS_PER_TOKEN),
            )
        if not finished:
            raise _StreamCut("the stream ended before the model finished")
        return AssistantTurn(
            "".join(text),
            [ToolCall(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())],
            usage.prompt_tokens if usage else None,
            usage.completion_tokens if usage else None,
            self._cut_at(finished),
        )

    def _cut_at(self, finish_reason: str | None) -> int | None:
        return self.config.max_output_tokens if finish_reason == "length" else None


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
                text = assistant_text(m)
                blocks: list[dict] = [{"type": "text", "text": text}] if text else []
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
        # Prompt caching: the system prompt and the tools are the same on every turn of a loop, and the
        # conversation before this turn is what the last turn sent (old results are masked a chunk at a
        # time, ``loop.masked``): marking the ends of the tools, the system prompt and the last two user
        # messages (Anthropic's limit is four) has each turn read what the turn before wrote. OpenAI caches
        # long prefixes by itself, with nothing to mark.
        kwargs: dict = {
            "model": self.config.model,
            "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            "messages": _cache_marked(self._messages(messages)),
            "max_tokens": self.config.max_output_tokens,
        }
        if tools:
            kwargs["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters} for t in tools
            ]
            kwargs["tools"][-1]["cache_control"] = {"type": "ephemeral"}
        if not self.config.stream:
            message = self.client.messages.create(**kwargs)
        else:
            with self.client.messages.stream(**kwargs) as stream:
                streamed = 0  # characters of the reply so far (its output count comes only at its end)
                for event in stream:  # what was billed so far, should the stream fail before its end
                    if event.type == "content_block_delta":
                        delta = event.delta
                        streamed += len(getattr(delta, "text", "") or getattr(delta, "partial_json", "") or "")
                    usage = stream.current_message_snapshot.usage
                    output = max(usage.output_tokens or 0, math.ceil(streamed / CHARACTERS_PER_TOKEN))
                    input_tokens, written, read = _anthropic_input(usage)
                    self.attempt = AttemptUsage(True, input_tokens, output, written, read)
                message = stream.get_final_message()
            if message.stop_reason is None:
                raise _StreamCut("the stream ended before the model finished")
        text = "".join(b.text for b in message.content if b.type == "text")
        calls = [ToolCall(b.id, b.name, json.dumps(b.input)) for b in message.content if b.type == "tool_use"]
        cut_at = self.config.max_output_tokens if message.stop_reason == "max_tokens" else None
        input_tokens, written, read = _anthropic_input(message.usage)
        return AssistantTurn(text, calls, input_tokens, message.usage.output_tokens, cut_at, written, read)


def _cache_marked(messages: list[dict], marks: int = 2) -> list[dict]:
    """Anthropic messages with a cache breakpoint on the last block of each of the last ``marks`` user
    messages (a tool result goes back as a user message): this turn writes the conversation so far, and
    reads what the turn before wrote up to its own last message, however many blocks this turn added.
    Every user text goes as a block, marked or not, so a message reads the same on every turn."""
    users = [index for index, message in enumerate(messages) if message["role"] == "user"]
    for index in users:
        content = messages[index]["content"]
        if isinstance(content, str) and not content.strip():
            continue  # as a block it would be refused (a text block must hold more than whitespace)
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else [dict(b) for b in content]
        if blocks and index in users[-marks:] and (blocks[-1].get("content") or blocks[-1].get("text")):
            blocks[-1]["cache_control"] = {"type": "ephemeral"}  # an empty block may not carry one
        messages[index] = {**messages[index], "content": blocks}
    return messages


def _anthropic_input(usage) -> tuple[int, int, int]:
    """Input tokens, cached prefix included, and of them those written to the cache and those read from it
    (priced by ``Accounting``: a write at CACHE_WRITE_PRICE times the input price, a read at CACHE_READ_PRICE)."""
    read = getattr(usage, "cache_read_input_tokens", 0) or 0
    written = getattr(usage, "cache_creation_input_tokens", 0) or 0
    return (usage.input_tokens or 0) + read + written, written, read


class _StreamCut(RuntimeError):
    """A stream that ended without the model's final event."""
