"""A fake LLM provider for tests: real HTTP on loopback, speaking the OpenAI chat-completions and the
Anthropic messages wire protocols (plain JSON and server-sent-event streaming, text and tool calls),
replaying scripted replies. The official SDK clients talk to it as to the real services.

A script is a queue of replies per role; the role of a request is read from the ``ROLE: <name>`` line
the agents put in their system prompt. A reply is ``Reply(text=..., tool_calls=[(name, args)], ...)``
or a fault: ``Fault(status=429)``, ``Fault(status=500)``, ``Fault(drop=True)`` (the stream is cut
mid-way), ``Fault(reset=True)`` (closed inside a chunk: a transport error), ``Fault(stream_error=
"overloaded_error")`` (an error event in a stream the server had accepted), ``Fault(status=429,
headers={"retry-after": "2"})``, ``Fault(status=429, kind="insufficient_quota")`` (the body's error
type). ``Reply(cut=True)`` stops at the output limit (OpenAI ``finish_reason: length``, Anthropic
``stop_reason: max_tokens``). Every request is recorded (``server.requests``) for the tests to inspect.

Requests the real services refuse are refused alike, with their 400s: an OpenAI reasoning model (o1,
o3, o4, gpt-5, and ``fake-reasoner``, which no client knows by name) given ``max_tokens``;
a ``legacy/...`` model (an older compatible server) given ``max_completion_tokens``; an Anthropic request
without ``max_tokens``, or with a message whose content is empty or an empty or blank text block; an
OpenAI assistant message with neither content nor tool calls (as strict compatible servers, Mistral's
among them, refuse it).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROLE = re.compile(r"ROLE: (\w+)")
KEY = "VIBETRAIN_TEST_LLM_KEY"  # the variable the tests put the fake key in
REFUSES_MAX_TOKENS = re.compile(r"^(o1|o3|o4|gpt-5)([-.]|$)|^fake-reasoner$")


@dataclass
class Reply:
    text: str = ""
    tool_calls: list[tuple[str, dict | str]] = field(default_factory=list)  # str args: sent verbatim (invalid JSON)
    input_tokens: int = 100
    output_tokens: int = 20
    cut: bool = False  # stopped at the output limit
    usage: bool = True  # False: no usage reported (an OpenAI-compatible server that ignores include_usage)
    usage_cut: bool = False  # an OpenAI stream: the connection closes after the last choice, before the usage
    cache_write_tokens: int = 0  # Anthropic: of the input, written to the prompt cache (cache_creation_input_tokens)
    cache_read_tokens: int = 0  # Anthropic: of the input, read from the prompt cache (cache_read_input_tokens)


@dataclass
class Fault:
    status: int | None = None  # an HTTP error status
    drop: bool = False  # start a stream, then cut the connection
    input_tokens: int = 1  # what a dropped Anthropic stream's message_start reports
    reset: bool = False  # start a chunked stream, then close the connection inside a chunk
    stream_error: str | None = None  # start a stream, then send an error event of this type
    headers: dict[str, str] = field(default_factory=dict)  # sent with the error (retry-after, ...)
    kind: str | None = None  # the error body's type (OpenAI's type and code): insufficient_quota, billing_error, ...
    message: str | None = None  # the error body's message


class FakeLLMServer:
    def __init__(self) -> None:
        self.scripts: dict[str, deque] = defaultdict(deque)
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def script(self, role: str, *replies) -> None:
        self.scripts[role].extend(replies)

    def __enter__(self) -> FakeLLMServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _next(self, role: str):
        with self.lock:
            queue = self.scripts.get(role)
            if not queue:
                return Fault(status=500), f"fake server: no scripted reply left for role {role!r}"
            return queue.popleft(), ""

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                return

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                anthropic = self.path.endswith("/messages")
                system = (
                    body.get("system", "")
                    if anthropic
                    else next((m.get("content", "") for m in body.get("messages", []) if m.get("role") == "system"), "")
                )
                system = system if isinstance(system, str) else " ".join(b.get("text", "") for b in system)
                match = ROLE.search(system)
                role = match.group(1) if match else "unknown"
                with server.lock:
                    server.requests.append(
                        {"path": self.path, "role": role, "body": body, "headers": dict(self.headers)}
                    )
                if (
                    self.headers.get("authorization", "").endswith("bad-key")
                    or self.headers.get("x-api-key") == "bad-key"
                ):
                    return self._error(401, "invalid api key", anthropic)
                if body.get("model") == "no-such-model":
                    return self._json(
                        404,
                        {
                            "error": {
                                "message": "The model `no-such-model` does not exist",
                                "type": "invalid_request_error",
                            }
                        }
                        if not anthropic
                        else {"type": "error", "error": {"type": "not_found_error", "message": "model: no-such-model"}},
                    )
                refused = _anthropic_refusal(body) if anthropic else _openai_refusal(body)
                if refused is not None:
                    return self._json(400, refused)
                reply, why = server._next(role)
                stream = bool(body.get("stream"))
                if isinstance(reply, Fault):
                    if reply.drop:
                        return (
                            self._dropped(anthropic, reply.input_tokens) if stream else self._cut_short(*TRUNCATED_JSON)
                        )
                    if reply.reset:
                        return self._cut_short(*CUT_IN_A_CHUNK)
                    if reply.stream_error is not None:
                        return self._stream_error(reply.stream_error, anthropic)
                    message = reply.message or why or f"scripted {reply.status}"
                    return self._error(reply.status, message, anthropic, reply.headers, reply.kind)
                if anthropic:
                    return self._anthropic_stream(reply) if stream else self._json(200, _anthropic_message(reply, body))
                return self._openai_stream(reply, body) if stream else self._json(200, _openai_completion(reply, body))

            # -- plumbing --------------------------------------------------------------------------
            def _json(self, status: int, payload: dict, headers: dict | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def _error(
                self, status: int, message: str, anthropic: bool, headers: dict | None = None, kind: str | None = None
            ) -> None:
                if anthropic:
                    kind = kind or {401: "authentication_error", 429: "rate_limit_error"}.get(status, "api_error")
                    return self._json(status, {"type": "error", "error": {"type": kind, "message": message}}, headers)
                error = {"message": message, "type": kind or "error", "code": kind or status}
                return self._json(status, {"error": error}, headers)

            def _sse_start(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                self.close_connection = True

            def _cut_short(self, headers: dict, body: bytes) -> None:
                """A response whose body is cut where ``body`` ends: a JSON body announced in full (the
                client finds it truncated), or a chunked one cut inside its first chunk (its HTTP library
                raises)."""
                self.send_response(200)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)

            def _stream_error(self, kind: str, anthropic: bool) -> None:
                """The server's error event in the middle of a stream it answered 200."""
                self._sse_start()
                error = {"type": kind, "message": f"scripted {kind} mid-stream"}
                event = f"event: error\ndata: {json.dumps({'type': 'error', 'error': error})}"
                self.wfile.write(f"{event if anthropic else 'data: ' + json.dumps({'error': error})}\n\n".encode())
                self.wfile.flush()

            def _dropped(self, anthropic: bool, input_tokens: int) -> None:
                self._sse_start()
                first = (
                    {
                        "type": "message_start",
                        "message": {
                            "id": "msg_drop",
                            "type": "message",
                            "role": "assistant",
                            "model": "fake",
                            "content": [],
                            "stop_reason": None,
                            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
                        },
                    }
                    if anthropic
                    else {
                        "id": "c",
                        "object": "chat.completion.chunk",
                        "created": 0,
                        "model": "fake",
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "partial"}}],
                    }
                )
                event = "event: message_start\n" if anthropic else ""
                self.wfile.write(f"{event}data: {json.dumps(first)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.05)
                self.connection.shutdown(2)  # cut mid-stream

            def _openai_stream(self, reply: Reply, body: dict) -> None:
                self._sse_start()
                base = {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": body.get("model", "fake"),
                }

                def send(choice_delta: dict, finish=None, usage=None) -> None:
                    chunk = {
                        **base,
                        "choices": [{"index": 0, "delta": choice_delta, "finish_reason": finish}]
                        if choice_delta is not None
                        else [],
                    }
                    if usage is not None:
                        chunk["usage"] = usage
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())

                send({"role": "assistant", "content": ""})
                for piece in _pieces(reply.text):
                    send({"content": piece})
                for i, (name, args) in enumerate(reply.tool_calls):
                    arguments = args if isinstance(args, str) else json.dumps(args)
                    send(
                        {
                            "tool_calls": [
                                {
                                    "index": i,
                                    "id": f"call_{i}",
                                    "type": "function",
                                    "function": {"name": name, "arguments": ""},
                                }
                            ]
                        }
                    )
                    for piece in _pieces(arguments):
                        send({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                send({}, finish=_openai_finish(reply))
                if reply.usage_cut:
                    self.wfile.flush()
                    time.sleep(0.05)
                    self.connection.shutdown(2)  # no usage chunk, no [DONE]
                    return
                if reply.usage:
                    send(None, usage=_openai_usage(reply))
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _anthropic_stream(self, reply: Reply) -> None:
                self._sse_start()

                def send(kind: str, payload: dict) -> None:
                    self.wfile.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode())

                send(
                    "message_start",
                    {
                        "message": {
                            "id": "msg_fake",
                            "type": "message",
                            "role": "assistant",
                            "model": "fake",
                            "content": [],
                            "stop_reason": None,
                            "stop_sequence": None,
                            "usage": _anthropic_usage(reply, 1),
                        }
                    },
                )
                index = 0
                if reply.text:
                    send("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    for piece in _pieces(reply.text):
                        send("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}})
                    send("content_block_stop", {"index": 0})
                    index = 1
                for i, (name, args) in enumerate(reply.tool_calls, start=index):
                    arguments = args if isinstance(args, str) else json.dumps(args)
                    send(
                        "content_block_start",
                        {
                            "index": i,
                            "content_block": {"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {}},
                        },
                    )
                    for piece in _pieces(arguments):
                        send(
                            "content_block_delta",
                            {"index": i, "delta": {"type": "input_json_delta", "partial_json": piece}},
                        )
                    send("content_block_stop", {"index": i})
                send(
                    "message_delta",
                    {
                        "delta": {"stop_reason": _anthropic_stop(reply), "stop_sequence": None},
                        "usage": {"output_tokens": reply.output_tokens},
                    },
                )
                send("message_stop", {})
                self.wfile.flush()

        return Handler


# how a response is cut short (``_cut_short``): its headers, and the bytes sent before the cut
TRUNCATED_JSON = ({"content-type": "application/json", "content-length": "1000"}, b'{"id": "cut')
CUT_IN_A_CHUNK = ({"content-type": "text/event-stream", "transfer-encoding": "chunked"}, b"400\r\ndata: {")


def _pieces(text: str, size: int = 7) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _openai_completion(reply: Reply, body: dict) -> dict:
    message: dict = {"role": "assistant", "content": reply.text or None}
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
            for i, (name, args) in enumerate(reply.tool_calls)
        ]
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": body.get("model", "fake"),
        "choices": [{"index": 0, "message": message, "finish_reason": _openai_finish(reply)}],
        **({"usage": _openai_usage(reply)} if reply.usage else {}),
    }


def _openai_usage(reply: Reply) -> dict:
    return {
        "prompt_tokens": reply.input_tokens,
        "completion_tokens": reply.output_tokens,
        "total_tokens": reply.input_tokens + reply.output_tokens,
    }


def _anthropic_message(reply: Reply, body: dict) -> dict:
    content: list[dict] = [{"type": "text", "text": reply.text}] if reply.text else []
    for i, (name, args) in enumerate(reply.tool_calls):
        content.append(
            {
                "type": "tool_use",
                "id": f"toolu_{i}",
                "name": name,
                "input": args if isinstance(args, dict) else {"_raw": args},
            }
        )
    return {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", "fake"),
        "content": content,
        "stop_reason": _anthropic_stop(reply),
        "stop_sequence": None,
        "usage": _anthropic_usage(reply, reply.output_tokens),
    }


def _openai_finish(reply: Reply) -> str:
    return "length" if reply.cut else "tool_calls" if reply.tool_calls else "stop"


def _anthropic_stop(reply: Reply) -> str:
    return "max_tokens" if reply.cut else "tool_use" if reply.tool_calls else "end_turn"


def _openai_refusal(body: dict) -> dict | None:
    """The 400 body OpenAI (or a strict compatible server) answers this request with; None if it is fine."""
    model = body.get("model", "")
    refused = "max_completion_tokens" if model.startswith("legacy/") else "max_tokens"
    if refused in body and (refused == "max_completion_tokens" or REFUSES_MAX_TOKENS.match(model)):
        other = "max_completion_tokens" if refused == "max_tokens" else "max_tokens"
        return {
            "error": {
                "message": f"Unsupported parameter: '{refused}' is not supported with this model. "
                f"Use '{other}' instead.",
                "type": "invalid_request_error",
                "param": refused,
                "code": "unsupported_parameter",
            }
        }

    def refuse(message: str, i: int) -> dict:
        return {"error": {"message": message, "type": "invalid_request_error", "param": f"messages.{i}", "code": None}}

    messages = body.get("messages", [])
    waiting: dict[str, int] = {}  # tool calls not answered yet, by id: the message that made them
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            if waiting.pop(m.get("tool_call_id"), None) is None:
                return refuse(
                    f"messages.{i}: messages with role 'tool' must be a response to a preceding message with "
                    "'tool_calls'",
                    i,
                )
            continue
        if waiting:  # a message other than a tool answer while calls wait
            return refuse(
                f"messages.{min(waiting.values())}: an assistant message with 'tool_calls' must be followed by tool "
                f"messages responding to each 'tool_call_id'; missing: {', '.join(sorted(waiting))}",
                i,
            )
        if m.get("role") == "assistant":
            if not m.get("content") and not m.get("tool_calls"):
                return refuse(f"messages.{i}: an assistant message must have either content or tool_calls", i)
            waiting = {call["id"]: i for call in m.get("tool_calls") or []}
    if waiting:
        return refuse(f"messages.{min(waiting.values())}: tool_calls without responses: {sorted(waiting)}", 0)
    return None


def _anthropic_refusal(body: dict) -> dict | None:
    """The 400 body Anthropic answers this request with; None if it is fine."""

    def refuse(message: str) -> dict:
        return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}

    if "max_tokens" not in body:
        return refuse("max_tokens: Field required")
    messages = body.get("messages", [])
    marked = [
        block
        for block in [*body.get("tools", []), *body.get("system", []), *(b for m in messages for b in _blocks(m))]
        if isinstance(block, dict) and "cache_control" in block
    ]
    if len(marked) > 4:
        return refuse(f"A maximum of 4 blocks with cache_control may be provided. Found {len(marked)}.")
    for i, m in enumerate(messages):
        content = m.get("content")
        if not content and not (i == len(messages) - 1 and m.get("role") == "assistant"):
            return refuse(
                f"messages.{i}: all messages must have non-empty content except for the optional "
                "final assistant message"
            )
        for j, block in enumerate(content if isinstance(content, list) else []):
            if block.get("type") == "text" and not block.get("text", "").strip():
                return refuse(f"messages.{i}.content.{j}.text: text content blocks must contain non-whitespace text")
    for i, m in enumerate(messages):  # each tool_use answered by a tool_result in the very next message
        blocks = m.get("content") if isinstance(m.get("content"), list) else []
        asked = {b.get("id") for b in blocks if b.get("type") == "tool_use"} if m.get("role") == "assistant" else set()
        following = messages[i + 1].get("content") if i + 1 < len(messages) else []
        answered = {
            b.get("tool_use_id") for b in following if isinstance(following, list) and b.get("type") == "tool_result"
        }
        if asked - answered:
            return refuse(
                f"messages.{i + 1}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                f"{', '.join(sorted(asked - answered))}"
            )
        if m.get("role") == "user" and i > 0:
            before = messages[i - 1].get("content") if isinstance(messages[i - 1].get("content"), list) else []
            made = {b.get("id") for b in before if b.get("type") == "tool_use"}
            stray = {b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"} - made
            if stray:
                return refuse(f"messages.{i}: unexpected `tool_use_id` found in `tool_result` blocks: {sorted(stray)}")
    return None


def _blocks(message: dict) -> list:
    content = message.get("content")
    return content if isinstance(content, list) else []


def generate(server: FakeLLMServer, tmp_path, target, provider: str, *extra: str, model: str = ""):
    """``vibetrain generate`` against the fake server (simulated, one repeat, the key in ``KEY``):
    (exit code, output, run directory)."""
    from typer.testing import CliRunner

    from orchestrator.cli import app

    run = tmp_path / f"run-{provider}"
    base = server.url + "/v1" if provider == "openai" else server.url
    model = model or ("gpt-4o" if provider == "openai" else "claude-sonnet-4")
    options = ["--agents", provider, "--model", model, "--base-url", base, "--api-key-env", KEY]
    places = ["--out", str(run), "--workspaces", str(tmp_path / "ws")]
    # the subprocess sandbox: its candidate processes start warm (the sandboxes' own tests are test_agents.py's)
    argv = ["generate", str(target), *options, "--simulate", "--repeat", "1", "--held-out", "0", *places, *extra]
    if "--sandbox" not in extra:
        argv += ["--sandbox", "subprocess"]
    result = CliRunner().invoke(app, argv, env={"COLUMNS": "140"})
    return result.exit_code, result.output, run


def _anthropic_usage(reply: Reply, output_tokens: int) -> dict:
    """Anthropic counts the input apart from what went to and came from its prompt cache."""
    written, read = reply.cache_write_tokens, reply.cache_read_tokens
    return {
        "input_tokens": reply.input_tokens - written - read,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": read,
        "output_tokens": output_tokens,
    }
