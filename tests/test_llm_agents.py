"""LLM agents against a fake provider (real HTTP on loopback, both wire protocols, streaming and tool
calls; the official SDK clients talk to it): the clients' retries and errors, the tools' helpful
errors, structured answers with one repair, and full `vibetrain generate` rounds whose implementer
edits the stack through tool calls — validated and committed, or rejected by the LLM review — plus
budgets, and keys that never reach the sandbox (the coding-agent CLIs: test_cli_agent.py)."""

from __future__ import annotations

import email.utils
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import git
import pytest
from typer.testing import CliRunner

from agents.llm.accounting import Accounting
from agents.llm.agents import ImplementerOutput, LLMImplementer, OutputSchemaError, Review, answer
from agents.llm.client import EMPTY_REPLY, ClientConfig, ToolCall, make_client
from agents.llm.errors import BudgetSpent, LLMError, LLMRefused, LLMUnusable
from agents.llm.tools import Toolbox
from agents.roles import AgentError, Task
from orchestrator.cli import app
from orchestrator.config import LLMConfig
from orchestrator.history import History
from orchestrator.runs import RunSetupError, _check_cost_counted
from orchestrator.state import (
    RoundRecord,
    RunConfig,
    RunState,
    RunStateError,
    load_llm_spend,
    new_state,
    save_llm_spend,
)
from skills.starter import starter_params, write_starter
from targets.harness.isolation.sandbox import Sandbox

sys.path.insert(0, str(Path(__file__).parent))
from fake_llm import KEY, FakeLLMServer, Fault, Reply, generate  # noqa: E402

runner = CliRunner()


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(KEY, "sk-test-secret")
    with FakeLLMServer() as fake:
        yield fake


def _client(
    server, provider: str, stream: bool = True, retries: int = 3, model: str = "gpt-4o", accounting=None, **options
):
    base = server.url + "/v1" if provider == "openai" else server.url
    config = ClientConfig(provider, model, KEY, base, stream=stream, max_retries=retries, backoff_s=0.01, **options)
    return make_client(config, accounting or Accounting())


# -- clients ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
@pytest.mark.parametrize("stream", [True, False])
def test_tool_calls_round_trip_and_transient_faults_are_retried(server, provider, stream):
    server.script(
        "implementer",
        Fault(status=429),
        Fault(status=503),
        Fault(drop=True),
        Reply(
            text="reading",
            tool_calls=[("read_file", {"path": "stack/params.json"})],
            input_tokens=1000,
            output_tokens=50,
        ),
        Reply(text='{"summary": "done"}', input_tokens=1200, output_tokens=30),
    )
    client = _client(server, provider, stream)
    turn = client.chat("ROLE: implementer", [{"role": "user", "content": "go"}], [])
    assert turn.text == "reading" and [(c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [
        ("read_file", {"path": "stack/params.json"})
    ]
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "text": turn.text, "tool_calls": turn.tool_calls},
        {"role": "tool", "tool_call_id": turn.tool_calls[0].id, "name": "read_file", "content": "{}"},
    ]
    assert client.chat("ROLE: implementer", messages, []).text == '{"summary": "done"}'
    assert len(server.requests) == 5  # three faults, two answers: the SDK's own retries are off
    last = server.requests[-1]["body"]
    if provider == "openai":
        assert last["messages"][-1] == {"role": "tool", "tool_call_id": "call_0", "content": "{}"}
    else:
        assert last["messages"][-1]["content"][0]["type"] == "tool_result"
    billed = int(stream and provider == "anthropic")  # the dropped stream's message_start: 1 input token
    assert client.accounting.snapshot() == {
        "calls": 2 + billed,
        "input_tokens": 2200 + billed,
        "output_tokens": 80,
        "cost_usd": pytest.approx(((2200 + billed) * 2.5 + 80 * 10) / 1e6, abs=1e-6),  # the snapshot's rounding
    }  # gpt-4o's price


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_stream_that_failed_midway_was_billed_and_counts(server, provider, caplog):
    """Only the attempt that succeeded was counted: with four retries a call could be billed five times
    its prompt and count once, past the budget unseen. A started stream's tokens count as its provider
    reported them (Anthropic's message_start), else its input as the last call's (OpenAI's usage comes
    last); a request refused before it began (a 429) was not billed and counts nothing."""
    server.script(
        "implementer",
        Reply(text="first", input_tokens=1000, output_tokens=10),
        Fault(status=429),
        Fault(drop=True, input_tokens=1500),
        Reply(text="second", input_tokens=1600, output_tokens=10),
    )
    client = _client(server, provider)
    for _ in range(2):
        client.chat("ROLE: implementer", [{"role": "user", "content": "go"}], [])
    dropped = 1500 if provider == "anthropic" else 1000  # reported, or estimated as the last call's
    assert client.accounting.snapshot()["calls"] == 3
    assert client.accounting.input_tokens == 1000 + dropped + 1600, client.accounting.snapshot()
    assert "failed mid-stream" in caplog.text and ("estimated" in caplog.text) == (provider == "openai")
    streamed = 2 if provider == "openai" else 0  # OpenAI's dropped stream sent "partial": 7 characters
    assert client.accounting.output_tokens == 10 + streamed + 10, client.accounting.snapshot()


def test_an_openai_stream_cut_before_its_usage_counts_an_estimate_not_a_refusal(server, caplog):
    """The SDK ends a stream quietly where the connection closes: a reply whose last choice came but not
    its usage chunk was taken as a server that reports no usage, and a budgeted run stopped for it. On a
    server that has reported usage it is a cut: the reply counts, at an estimate that says so."""
    server.script("implementer", Reply(text="one", input_tokens=1000), Reply(text="two" * 40, usage_cut=True))
    client = _client(server, "openai", accounting=Accounting(max_tokens=1_000_000))
    client.chat("ROLE: implementer", [{"role": "user", "content": "go"}], [])
    assert client.chat("ROLE: implementer", [{"role": "user", "content": "go"}], []).text == "two" * 40
    assert client.accounting.snapshot()["input_tokens"] == 2000 and client.accounting.output_tokens == 20 + 30
    assert "came without its usage" in caplog.text


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_errors_in_the_middle_of_a_stream_are_retried_or_named_never_raised_raw(server, provider):
    """Once a stream has started the SDKs let through what breaks it unwrapped: a connection closed
    inside a chunk (the HTTP library's transport error), an error event (Anthropic's overloaded_error
    comes as a status error of 200, OpenAI's as a bare APIError). They were re-raised raw: the round
    ended in an error, an LLM planner's took the whole run down with a traceback."""
    overloaded = "overloaded_error" if provider == "anthropic" else "server_error"
    server.script("implementer", Fault(reset=True), Fault(stream_error=overloaded), Reply(text="ok"))
    assert _client(server, provider).chat("ROLE: implementer", [{"role": "user", "content": "go"}], []).text == "ok"
    assert len(server.requests) == 3
    server.script("implementer", Fault(stream_error="invalid_request_error"), Reply(text="never asked"))
    with pytest.raises(LLMError, match="an error in the stream \\(invalid_request_error\\)"):
        _client(server, provider).chat("ROLE: implementer", [{"role": "user", "content": "go"}], [])
    assert len(server.requests) == 4  # a request that can never succeed is not retried


@pytest.mark.parametrize("stream", [True, False])
def test_a_server_that_reports_no_usage_stops_a_budgeted_run_and_is_said_otherwise(server, stream, caplog):
    """An OpenAI-compatible server that ignores include_usage counted every call as 0 tokens and $0:
    --max-tokens and --max-cost never stopped the run, and nothing said so."""
    server.script("implementer", Reply(text="one", usage=False), Reply(text="two", usage=False))
    unbudgeted = _client(server, "openai", stream)
    assert unbudgeted.chat("ROLE: implementer", [{"role": "user", "content": "go"}], []).text == "one"
    assert unbudgeted.accounting.snapshot()["input_tokens"] == 0 and "reported no token usage" in caplog.text
    budgeted = _client(server, "openai", stream, accounting=Accounting(max_tokens=100_000))
    with pytest.raises(LLMUnusable, match="reported no token usage, so the run's LLM budget .* cannot be kept"):
        budgeted.chat("ROLE: implementer", [{"role": "user", "content": "go"}], [])


def test_a_budgeted_run_on_a_server_that_reports_no_usage_stops_at_its_first_call(server, tmp_path, fast_target):
    """Raised as a spent budget, it ended the attempt and the loop's own budget check (which had counted
    nothing) let the run go on, every round's calls unaccounted. It stops the run, saying why."""
    server.script("judge", Reply(text=json.dumps({"verdict": "accept", "reasons": []}), usage=False))
    code, output, run = generate(server, tmp_path, fast_target, "openai", "--rounds", "1", "--max-tokens", "100000")
    assert code == 1 and "reported no token usage" in output and "Traceback" not in output, output
    assert [r["role"] for r in server.requests] == ["judge"]  # the starter's review: the one call made


def test_anthropic_cache_writes_count_at_their_higher_price(server):
    """A prompt-cache write is billed 1.25 times the input price; it was counted at the input price,
    under what the run spent (the judge's and evaluator's one-shot prompts are mostly writes)."""
    server.script("judge", Reply(text="ok", input_tokens=1000, cache_write_tokens=800, output_tokens=0))
    client = _client(server, "anthropic")
    client.chat("ROLE: judge", [{"role": "user", "content": "go"}], [])
    assert client.accounting.snapshot()["input_tokens"] == 1000
    assert client.accounting.cost_usd == pytest.approx((200 * 2.5 + 800 * 2.5 * 1.25) / 1e6)  # gpt-4o's price


def test_anthropic_cache_reads_count_at_a_tenth_of_the_input_price(server):
    """A turn that reads the conversation from the prompt cache is billed a tenth of the input price for
    what it read: counted at the full price, a long tool loop's spend read up to ten times too high, and a
    --max-cost budget stopped the run early."""
    server.script("judge", Reply(text="ok", input_tokens=1000, cache_read_tokens=700, cache_write_tokens=200))
    client = _client(server, "anthropic")
    client.chat("ROLE: judge", [{"role": "user", "content": "go"}], [])
    assert client.accounting.snapshot()["input_tokens"] == 1000
    assert client.accounting.cost_usd == pytest.approx((100 * 2.5 + 200 * 2.5 * 1.25 + 700 * 2.5 * 0.1 + 20 * 10) / 1e6)


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_the_fake_server_refuses_a_tool_call_left_unanswered_as_the_providers_do(server, provider):
    """Both providers refuse a conversation with a tool call no tool result answers (a 400): the fake
    accepted it, so a client that lost the pairing would have passed every test."""
    calls = [ToolCall("call_1", "read_file", "{}"), ToolCall("call_2", "list_files", "{}")]
    answered = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "text": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "name": "read_file", "content": "x"},
    ]
    server.script("planner", Reply(text="ok"))
    assert _ask(_client(server, provider), messages=[*answered, _tool_answer("call_2")]).text == "ok"
    for broken in (answered, [*answered, {"role": "user", "content": "next"}], [answered[0], _tool_answer("call_9")]):
        with pytest.raises(LLMError, match="HTTP 400") as raised:  # a client's mistake: no content refusal
            _ask(_client(server, provider), messages=broken)
        assert type(raised.value) is LLMError


def _tool_answer(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": "list_files", "content": "y"}


def test_a_429_storm_gives_up_with_a_clear_message(server):
    server.script("planner", *[Fault(status=429)] * 5)
    with pytest.raises(LLMError, match=r"rate limited \(429\): .*scripted 429; gave up after 3 retries"):
        _client(server, "openai").chat("ROLE: planner", [{"role": "user", "content": "x"}], [])
    assert len(server.requests) == 4


def test_authentication_and_unknown_model_fail_at_once(server, monkeypatch):
    monkeypatch.setenv(KEY, "bad-key")
    for provider in ("openai", "anthropic"):
        with pytest.raises(LLMError, match=rf"authentication failed \(401\): check \${KEY}"):
            _client(server, provider).chat("ROLE: judge", [{"role": "user", "content": "x"}], [])
    monkeypatch.setenv(KEY, "sk-test")
    for provider in ("openai", "anthropic"):
        with pytest.raises(LLMError, match=r"not found \(404\): is the model name right\?"):
            _client(server, provider, model="no-such-model").chat("ROLE: judge", [{"role": "user", "content": "x"}], [])
    monkeypatch.delenv(KEY)
    with pytest.raises(LLMError, match=f"no API key: set \\${KEY}"):
        _client(server, "openai")


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_each_error_is_retried_refused_or_stops_the_run_by_what_it_says(server, provider):
    """A spent quota or credit stops the run (OpenAI's comes as a 429 no wait ends; Anthropic's as a 400 or a
    billing_error); 408 and 409 pass with a retry, as the SDKs' own retries know; the server's x-should-retry
    decides where it says; a 400 refuses the request for what it holds, which no retry changes."""
    quota = Fault(status=429, kind="insufficient_quota", message="You exceeded your current quota")
    for fault in (
        quota,
        Fault(status=400, kind="invalid_request_error", message="Your credit balance is too low to access the API"),
        Fault(status=402, kind="billing_error", message="billing"),
    ):
        server.requests.clear()
        server.script("planner", fault)
        with pytest.raises(LLMUnusable, match=r"quota or credit is spent .*" + fault.message):
            _ask(_client(server, provider))
        assert len(server.requests) == 1
    server.script("planner", Fault(status=408), Fault(status=409), Reply(text="ok"))
    assert _ask(_client(server, provider)).text == "ok"
    server.script("planner", Fault(status=500, headers={"x-should-retry": "false"}))
    with pytest.raises(LLMError, match=r"HTTP 500") as raised:
        _ask(_client(server, provider))
    assert not isinstance(raised.value, (LLMRefused, LLMUnusable))
    server.script("planner", Fault(status=400, headers={"x-should-retry": "true"}), Reply(text="ok"))
    assert _ask(_client(server, provider)).text == "ok"
    server.requests.clear()
    server.script("planner", Fault(status=400, message="prompt is too long: 40000 tokens > 32768 maximum"))
    with pytest.raises(LLMRefused, match=r"HTTP 400: .*prompt is too long"):
        _ask(_client(server, provider))
    assert len(server.requests) == 1
    for wording in (  # the servers' own words for a context overflow or a flagged prompt
        "input length and `max_tokens` exceed context limit: 178959 + 64000 > 200000",  # Anthropic
        "request (4390 tokens) exceeds the available context size (4096 tokens)",  # llama.cpp
        "This model's maximum context length is 32768 tokens",  # vLLM, OpenAI
        "Invalid prompt: your prompt was flagged as potentially violating our usage policy",  # OpenAI
    ):
        server.script("planner", Fault(status=400, message=wording))
        with pytest.raises(LLMRefused):
            _ask(_client(server, provider))
    # a refusal of how the request was made is the configuration's, not the content's (and never retried)
    for fault in (
        Fault(status=400, message="max_tokens: 100000 > 64000, which is the maximum allowed for this model"),
        Fault(status=422, message='"auto" tool choice requires --enable-auto-tool-choice'),
    ):
        server.script("planner", fault)
        with pytest.raises(LLMError, match=f"HTTP {fault.status}") as raised:
            _ask(_client(server, provider))
        assert type(raised.value) is LLMError
    spend = Fault(status=429, kind="rate_limit_error", message="workspace limit: enforced_spend_limit_reached")
    server.script("planner", spend)  # Anthropic's workspace spend limit: a 429 no wait ends
    with pytest.raises(LLMUnusable, match="quota or credit is spent"):
        _ask(_client(server, provider))


def test_a_plan_step_in_any_language_becomes_a_task_id_or_is_left_out(tiny_spec):
    """The LLM planner's plan steps become backlog tasks: 'µ' and 'é' are alphanumeric to Python but no
    character of a task id, and the run stopped with a ValidationError traceback."""
    from types import SimpleNamespace

    from agents.offline.planner import OfflinePlanner
    from orchestrator.policies.llm import LLMPolicy
    from orchestrator.state import RoundRecord, RunState

    r0 = RoundRecord(
        round=0,
        task=Task(id="starter", title="s", rationale="r"),
        parent_round=None,
        parent_commit="",
        verdict="accepted",
        commit="c0",
        headline=1.0,
        became_best=True,
    )
    state = RunState.model_construct(rounds=[r0], backlog=[], best_round=0)
    plan = ["then tune the µ-batch size", "réduire la latence", "µµµ"]
    choice = SimpleNamespace(parent_round=0, task=Task(id="add-kv_routing", title="t", rationale="r"), plan=plan)
    policy = LLMPolicy(OfflinePlanner(tiny_spec), 0, SimpleNamespace(plan=lambda *args: choice), lambda r: "")
    parent, task = policy.propose(state, lambda r: {})
    assert (parent.commit, task.id) == ("c0", "add-kv_routing")
    assert [t.id for t in state.backlog] == ["plan-then-tune-the---batch-size", "plan-r-duire-la-latence"]


def test_costs_come_from_the_price_table_and_unknown_models_say_so(caplog):
    accounting = Accounting()
    assert accounting.add("claude-sonnet-4-20250514", 1_000_000, 100_000) == pytest.approx(3.0 + 1.5)
    assert accounting.add("gpt-4.1-2025-04-14", 1_000_000, 0) == pytest.approx(2.0)  # a dated snapshot is its model
    # another model whose name starts as a priced one's was priced as that one: o3-pro as o3, at a tenth
    assert accounting.priced_as("o3-pro") == "o3-pro" and accounting.priced_as("o3-deep-research") is None
    assert accounting.priced_as("claude-opus-4-5") == "claude-opus-4-5" and accounting.priced_as("gpt-4o-x") is None
    assert accounting.price("claude-sonnet-4-0") == accounting.price("claude-sonnet-4-20250514")  # an alias
    assert (
        accounting.add("my-local-model", 10, 10) == 0.0 and "no price known for model 'my-local-model'" in caplog.text
    )


def _ask(client, role: str = "planner", messages: list | None = None):
    return client.chat(f"ROLE: {role}", messages or [{"role": "user", "content": "x"}], [])


@pytest.mark.parametrize("stream", [True, False])
def test_the_output_limit_goes_under_the_name_each_model_takes(server, stream):
    """Reasoning models get max_completion_tokens from the start; a model no list knows learns it from
    OpenAI's 400 once (one retry, then remembered); the limit itself is configurable."""
    limit = {"max_output_tokens": 777}
    for model, sent in (
        ("gpt-4o", "max_tokens"),
        ("o4-mini", "max_completion_tokens"),
        ("gpt-5.1", "max_completion_tokens"),
    ):
        server.requests.clear()
        server.script("planner", Reply(text="ok"))
        assert _ask(_client(server, "openai", stream, model=model, **limit)).text == "ok"
        [request] = server.requests
        assert request["body"][sent] == 777 and len({"max_tokens", "max_completion_tokens"} & set(request["body"])) == 1
    for model, first, then in (
        ("fake-reasoner", "max_tokens", "max_completion_tokens"),  # refuses max_tokens, though no list names it
        ("legacy/o3", "max_completion_tokens", "max_tokens"),  # an older server that only knows max_tokens
    ):
        server.requests.clear()
        server.script("planner", Reply(text="first"), Reply(text="second"))
        client = _client(server, "openai", stream, model=model, **limit)
        assert _ask(client).text == "first" and _ask(client).text == "second"
        sent = [[k for k in ("max_tokens", "max_completion_tokens") if k in r["body"]] for r in server.requests]
        assert sent == [[first], [then], [then]]  # switched once on the 400, then remembered
    server.script("anthropic_judge", Reply(text="ok"))
    _ask(_client(server, "anthropic", stream, model="claude-sonnet-4", **limit), role="anthropic_judge")
    assert server.requests[-1]["body"]["max_tokens"] == 777


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_an_empty_reply_goes_back_as_a_placeholder_never_as_empty_content(server, provider):
    """Anthropic refuses `content: []` and blank text blocks with a 400 (strict OpenAI-compatible servers
    refuse an assistant message with neither content nor tool calls): the empty turn goes back as
    EMPTY_REPLY, and blank text beside a tool call is left out."""
    client = _client(server, provider)
    server.script("judge", Reply(text=""), Reply(text='{"verdict": "accept"}'))
    assert answer(client, "ROLE: judge", [{"role": "user", "content": "x"}], Review, "judge").verdict == "accept"
    body = server.requests[-1]["body"]
    assistant = [m for m in body["messages"] if m["role"] == "assistant"]
    if provider == "openai":
        assert assistant == [{"role": "assistant", "content": EMPTY_REPLY}]
    else:
        assert assistant == [{"role": "assistant", "content": [{"type": "text", "text": EMPTY_REPLY}]}]
    server.script("judge", Reply(text="fine"))
    call = ToolCall("call_0", "read_file", '{"path": "x"}')
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "text": "  \n", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "name": "read_file", "content": "data"},
    ]
    assert _ask(client, "judge", messages).text == "fine"  # no blank text block beside the tool call
    sent = server.requests[-1]["body"]["messages"]
    if provider == "anthropic":
        assert [b["type"] for b in sent[1]["content"]] == ["tool_use"]


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_backoff_honours_retry_after_and_jitters(server, provider, monkeypatch):
    """The wait is max(retry-after, full jitter in [0, backoff * 2**(n-1)]): retry-after-ms, retry-after
    in seconds or as an HTTP date; a retry-after longer than the cap gives up at once."""
    import types

    import agents.llm.client

    now = time.time()  # the client's clock, held still: however slow the calls, the date is 10 s ahead of it
    monkeypatch.setattr(agents.llm.client, "time", types.SimpleNamespace(time=lambda: now, sleep=time.sleep))
    in_ten_seconds = email.utils.formatdate(now + 10, usegmt=True)
    server.script(
        "planner",
        Fault(status=429, headers={"retry-after": "2"}),
        Fault(status=503, headers={"retry-after-ms": "1500"}),
        Fault(status=429),
        Fault(status=429, headers={"retry-after": in_ten_seconds}),
        Fault(status=500),
        Reply(text="ok"),
    )
    client = _client(server, provider, retries=5)
    waits: list[float] = []
    client.sleep, client.random = waits.append, random.Random(7)
    assert _ask(client).text == "ok"
    reference = random.Random(7)
    jitter = [reference.uniform(0, 0.01 * 2**n) for n in range(5)]
    assert waits[:3] == [2.0, 1.5, jitter[2]] and waits[4] == jitter[4]
    assert 8.0 < waits[3] <= 10.0  # the HTTP date, to the second
    assert 0 < jitter[2] < 0.04  # jittered, not the bare exponential
    server.requests.clear()
    server.script("planner", Fault(status=429, headers={"retry-after": "600"}))
    with pytest.raises(
        LLMError, match=r"rate limited \(429\): .*; the server asks to retry after 600s, more than the 120s"
    ):
        _ask(client)
    assert len(server.requests) == 1 and len(waits) == 5


def _llm_run_at_its_starter():
    """The run state of an llm-policy run whose round 0 (the starter) was validated and is the best."""
    settings = dict(target="tiny-qwen3-cpu", target_id="tiny-qwen3-cpu", policy="llm", agents="openai", seed=0)
    state = new_state(RunConfig(**settings, llm=LLMConfig(model="m")))
    starter = Task(id="starter", title="starter", rationale="r")
    state.rounds.append(RoundRecord(round=0, task=starter, parent_round=None, parent_commit="c0", verdict="accepted"))
    state.best_round = 0
    return state


def test_a_planner_call_that_finds_the_budget_spent_stops_the_run_not_falls_back_to_the_backlog(
    server, tiny_spec, tmp_path
):
    """The llm policy fell back to the backlog on every AgentError, BudgetSpent too: the round then ran a
    task whose implementer could only fail on the budget, and the task was marked tried for --resume."""
    from agents.llm.agents import LLMPlanner
    from agents.offline.planner import OfflinePlanner
    from orchestrator.policies.llm import LLMPolicy

    spent = Accounting(max_tokens=100, spent_before={"input_tokens": 90, "output_tokens": 20})
    planner = LLMPlanner(tiny_spec, _client(server, "openai", accounting=spent))
    policy = LLMPolicy(OfflinePlanner(tiny_spec), 0, planner, design_of=lambda record: "")
    state = _llm_run_at_its_starter()
    with pytest.raises(BudgetSpent, match="token budget of 100 spent"):
        policy.propose(state, lambda record: {})
    assert server.requests == []  # refused before it was sent


def test_the_planner_is_told_each_parameters_range_and_the_validated_candidates_params(server, tiny_spec):
    """It saw only the parameters' names and no round's params.json: its changes left the ranges or rebuilt
    a configuration, and each such round silently fell back to the backlog."""
    from agents.llm.agents import LLMPlanner
    from agents.offline.planner import OfflinePlanner
    from orchestrator.policies.llm import LLMPolicy

    answer = {"parent_round": 0, "task": {"id": "add-kv-routing", "title": "t", "rationale": "r"}, "plan": []}
    server.script("planner", Reply(text=json.dumps(answer)))
    policy = LLMPolicy(OfflinePlanner(tiny_spec), 0, LLMPlanner(tiny_spec, _client(server, "openai")), lambda r: "")
    state = _llm_run_at_its_starter()
    state.rounds[0].commit = "c0"
    params = starter_params(tiny_spec, "colocate")
    parent, task = policy.propose(state, lambda record: params)
    assert task.id == "add-kv-routing"
    prompt = server.requests[-1]["body"]["messages"][0]["content"]
    [shown] = [line.removeprefix("- round 0: ") for line in prompt.splitlines() if line.startswith("- round 0: {")]
    assert json.loads(shown) == params
    assert "redundant_envs int [0, 4] step 1, default 0 (the simulator models it)" in prompt, prompt


def test_a_planner_that_fails_hands_the_round_to_the_backlog_and_the_round_says_why(tiny_spec):
    """The fallback's reason was only logged: a run planned by the backlog every round said nothing of it."""
    from agents.offline.planner import OfflinePlanner
    from orchestrator.policies.llm import LLMPolicy

    class FailingPlanner:
        def plan(self, state, design, params):
            raise AgentError("the provider answered 503 five times")

    policy = LLMPolicy(OfflinePlanner(tiny_spec), 0, FailingPlanner(), design_of=lambda record: "")
    state = _llm_run_at_its_starter()
    params = starter_params(tiny_spec, "colocate")
    parent, task = policy.propose(state, lambda record: params)
    backlog_parent, backlog_task = policy.backlog.propose(state, lambda record: params)
    assert (parent, task.id) == (backlog_parent, backlog_task.id)
    assert task.rationale.startswith("the LLM planner failed (the provider answered 503 five times)")
    assert task.rationale.endswith(backlog_task.rationale)


def test_a_planner_task_that_rebuilds_a_configuration_hands_the_round_to_the_backlog(tiny_spec):
    """The llm policy checked only the task's id: a task under a new id whose changes gave back a configuration
    the run had built (the starter's own, here) ran a round to measure it again."""
    from types import SimpleNamespace

    from agents.offline.planner import OfflinePlanner
    from orchestrator.policies.llm import LLMPolicy

    params = starter_params(tiny_spec, "colocate")
    again = Task(id="retune", title="t", rationale="r", changes={k: params[k] for k in list(params)[:1]})
    choice = SimpleNamespace(parent_round=0, task=again, plan=[])
    policy = LLMPolicy(OfflinePlanner(tiny_spec), 0, SimpleNamespace(plan=lambda *args: choice), lambda r: "")
    state = _llm_run_at_its_starter()
    state.rounds[0].commit = "c1"  # the starter, validated as a commit of its own
    parent, task = policy.propose(state, lambda record: params)
    assert task.id != "retune" and "build a configuration the run built already" in task.rationale


def test_the_budget_is_checked_before_every_call(server):
    """A spent budget refuses the next call before it is sent (BudgetSpent, an AgentError: the attempt
    ends), counting the run's earlier sessions too."""
    by_tokens = Accounting(max_tokens=100)
    client = _client(server, "openai", accounting=by_tokens)
    server.script("planner", Reply(text="one"), Reply(text="two"))
    assert _ask(client).text == "one"  # 0 tokens spent when it started; 120 after
    with pytest.raises(BudgetSpent, match=r"token budget of 100 spent \(120\)"):
        _ask(client)
    assert len(server.requests) == 1 and issubclass(BudgetSpent, AgentError)
    by_cost = Accounting(max_cost=0.001, spent_before={"cost_usd": 0.0008, "input_tokens": 9, "output_tokens": 9})
    client = _client(server, "anthropic", model="claude-sonnet-4", accounting=by_cost)
    server.scripts["planner"].clear()
    server.script("planner", Reply(text="three"), Reply(text="four"))
    assert _ask(client).text == "three"  # $0.0008 before + 100 * 3 + 20 * 15 per Mtok = $0.0014
    with pytest.raises(BudgetSpent, match=r"cost budget of \$0.001 spent \(\$0.0014\)"):
        _ask(client)
    assert len(server.requests) == 2


# -- structured answers ------------------------------------------------------------------------------


def test_a_malformed_answer_gets_one_repair_and_then_fails_clearly(server):
    client = _client(server, "anthropic")
    server.script("implementer", Reply(text="sure, here you go"), Reply(text='{"summary": "fixed it"}'))
    assert (
        answer(
            client, "ROLE: implementer", [{"role": "user", "content": "x"}], ImplementerOutput, "implementer"
        ).summary
        == "fixed it"
    )
    assert "did not match the required JSON" in json.dumps(server.requests[-1]["body"]["messages"][-1])
    server.script("implementer", Reply(text='{"summary": ""}'), Reply(text='{"wrong": 1}'))
    with pytest.raises(OutputSchemaError, match="the implementer's answer failed its schema twice"):
        answer(client, "ROLE: implementer", [{"role": "user", "content": "x"}], ImplementerOutput, "implementer")


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_a_reply_cut_at_the_output_limit_is_reported_and_never_final(server, provider, tmp_path, tiny_spec):
    """finish_reason "length" / stop_reason "max_tokens": the cut reply's tool calls are not run, its
    text is not the answer even when it parses, and the model is told where it was cut."""
    client = _client(server, provider, max_output_tokens=300)
    server.script(
        "judge",
        Reply(text='{"verdict": "accept"}', cut=True),
        Reply(text='{"verdict": "reject", "reasons": ["numbers made up"]}'),
    )
    review = answer(client, "ROLE: judge", [{"role": "user", "content": "x"}], Review, "judge")
    assert review.verdict == "reject"
    assert "Your reply was cut at the output limit of 300 tokens" in json.dumps(server.requests[-1]["body"]["messages"])
    server.script("judge", Reply(text='{"verdict": "acc', cut=True), Reply(text='{"verdict": "accept"}', cut=True))
    with pytest.raises(OutputSchemaError, match="cut at the output limit of 300 tokens twice"):
        answer(client, "ROLE: judge", [{"role": "user", "content": "x"}], Review, "judge")

    workspace = tmp_path / "ws"
    write_starter(workspace, tiny_spec, "colocate")
    server.script(
        "implementer",
        Reply(tool_calls=[("write_file", '{"path": "stack/new.py", "content": "print(1)\\nprint(')], cut=True),
        Reply(text='{"summary": "done"}', cut=True),
        Reply(text='{"summary": "wrote it in two edits"}'),
    )
    implementer = LLMImplementer(tiny_spec, client, Sandbox.detect("auto"), None, checks=lambda ws: "PASSED")
    task = Task(id="t", title="write a file", rationale="test")
    attempt = implementer.implement(task, workspace, [])
    assert attempt.summary == "wrote it in two edits" and not (workspace / "stack/new.py").exists()
    notes = [
        m for m in server.requests[-1]["body"]["messages"] if m["role"] == "user" and "cut at the output" in str(m)
    ]
    assert len(notes) == 2 and "Its tool calls (write_file) were not run" in str(notes[0])

    # a model that spends the whole limit every turn (a reasoning model thinking) stops at the third cut
    # in a row, naming the option, not at the end of its 40 turns
    server.script("implementer", *[Reply(text="thinking", cut=True)] * 4)
    requests = len(server.requests)
    with pytest.raises(AgentError, match="output limit of 300 tokens 3 turns in a row .*--max-output-tokens"):
        implementer.implement(task, workspace, [])
    assert len(server.requests) - requests == 3


# -- tools ---------------------------------------------------------------------------------------------


@pytest.fixture
def toolbox(tmp_path, tiny_spec):
    write_starter(tmp_path / "ws", tiny_spec, "colocate")
    return Toolbox(tmp_path / "ws", Sandbox.detect("auto"))


def _call(toolbox, name, **arguments):
    return toolbox.call(ToolCall("c", name, json.dumps(arguments)))


def test_edit_file_explains_a_miss_and_an_ambiguity_and_shows_the_result(toolbox):
    missing = _call(toolbox, "edit_file", path="stack/params.json", old='"controller":"colocate"', new="x")
    assert (
        missing.startswith("error: the old text is not in stack/params.json")
        and 'closest line is 2: \'"controller": "colocate",\'' in missing
    )
    ambiguous = _call(toolbox, "edit_file", path="stack/colocate.py", old="self", new="me")
    assert "occurs" in ambiguous and "times in stack/colocate.py (lines [" in ambiguous
    edited = _call(
        toolbox,
        "edit_file",
        path="stack/params.json",
        old='"controller": "colocate"',
        new='"controller": "static_split"',
    )
    assert edited.startswith("edited stack/params.json; lines 1-") and '2|   "controller": "static_split",' in edited
    assert '"static_split"' in _call(toolbox, "read_file", path="stack/params.json")


def test_an_edit_that_breaks_python_says_so_with_the_line(toolbox):
    lines = (toolbox.workspace / "stack/colocate.py").read_text().splitlines()
    line = next(n for n, text in enumerate(lines, 1) if text.startswith("from "))
    broken = _call(
        toolbox, "edit_file", path="stack/colocate.py", old=lines[line - 1], new=lines[line - 1] + "\ndef (:"
    )
    assert f"WARNING: stack/colocate.py no longer compiles: invalid syntax at line {line + 1}" in broken
    fixed = _call(toolbox, "edit_file", path="stack/colocate.py", old="\ndef (:", new="")
    assert fixed.endswith("stack/colocate.py compiles.")


def test_a_file_past_what_the_scan_reads_is_never_compiled_nor_edited_on_the_host(toolbox, monkeypatch):
    """edit_file compiled the whole file in the orchestrator's process: a red team's 4 MB list literal took it
    from 44 MB to 2.2 GB (some 600 times the file). Past the integrity scan's 1 MiB it is not compiled (the gate
    refuses it); past read_file's 8 MiB, not read."""
    from agents.llm import tools

    big = toolbox.workspace / "stack" / "big.py"
    big.write_text("x = [" + "1, " * 400_000 + "]\n")  # 1.2 MB
    compiled = []
    monkeypatch.setattr(tools, "compile", lambda *args: compiled.append(args), raising=False)
    said = _call(toolbox, "edit_file", path="stack/big.py", old="x = [", new="y = [")
    assert "over the 1048576 the integrity scan reads: refused" in said and not compiled
    monkeypatch.setattr(tools, "MAX_READ_BYTES", 1 << 20)
    assert "more than the 1048576 edit_file reads" in _call(toolbox, "edit_file", path="stack/big.py", old="y", new="x")


def test_read_file_views_numbered_line_ranges_and_the_contract_read_only(toolbox):
    view = _call(toolbox, "read_file", path="stack/colocate.py", start_line=2, end_line=3)
    total = len((toolbox.workspace / "stack/colocate.py").read_text().splitlines())
    assert view.splitlines()[0] == f"stack/colocate.py, lines 2-3 of {total}; read on with start_line=4"
    assert [line.split("|")[0] for line in view.splitlines()[1:]] == ["2", "3"]
    assert "past its end" in _call(toolbox, "read_file", path="stack/colocate.py", start_line=10_000)
    contract = _call(toolbox, "read_file", path="targets/api.py", start_line=1, end_line=5)
    assert contract.startswith("targets/api.py, lines 1-5 of ")
    assert "lines 1-" in _call(toolbox, "read_file", path="skills/recipes/colocate.py")
    assert _call(toolbox, "read_file", path="skills/recipes/../../README.md").startswith("error: no file")
    for path in ("targets/api.py", ".gitignore", "README.md", "skills/recipes/colocate.py"):
        refused = _call(toolbox, "write_file", path=path, content="x")
        assert refused.startswith("error: ") and ("not writable" in refused or "outside" in refused), refused
    assert "not writable" in _call(toolbox, "edit_file", path=".gitignore", old="x", new="y")
    assert _call(toolbox, "write_file", path="DESIGN.md", content="# d\n").startswith("wrote DESIGN.md (1 lines)")


def test_paths_stay_in_the_workspace_and_long_results_keep_head_and_tail(toolbox):
    assert "is outside the workspace" in _call(toolbox, "read_file", path="../../etc/passwd")
    assert "is git's" in _call(toolbox, "read_file", path=".git/config")
    loud = _call(
        toolbox, "run_command", command="python3 -c \"print('y' * 30000); raise SystemExit('the real error')\""
    )
    assert "characters cut from the middle" in loud and "the real error" in loud and len(loud) < 12_200
    assert loud.startswith("exit code 1")


def test_links_out_of_the_workspace_are_never_followed(toolbox, tmp_path, monkeypatch):
    """A candidate can make links (run_command); the tools run outside the sandbox, so a link to
    /proc/self/environ would hand them the harness's keys."""
    monkeypatch.setenv("VIBETRAIN_SECRET_PROBE", "sk-must-not-leak")
    (toolbox.workspace / "stack" / "env").symlink_to("/proc/self/environ")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keys.txt").write_text("sk-must-not-leak\n")
    (toolbox.workspace / "stack" / "out").symlink_to(outside)
    assert "sk-must-not-leak" not in _call(toolbox, "search_files", pattern="sk-must", path=".")
    listing = _call(toolbox, "list_files", path="stack")
    assert "stack/env\n" not in listing + "\n" and "keys.txt" not in listing
    assert "outside the workspace" in _call(toolbox, "read_file", path="stack/env")


def test_the_design_and_the_annotations_never_follow_a_link_out(toolbox, tmp_path, monkeypatch, tiny_spec):
    """Reading DESIGN.md (the read_design tool, the next attempt's prompt) and expanding the stack's
    annotations run on the host: a DESIGN.md linked to /proc/self/environ handed the model the host's
    keys, and a stack file linked to the library's recipe was rewritten in place by the expansion."""
    from agents.llm.agents import expand_annotations, implementer_prompt

    monkeypatch.setenv("VIBETRAIN_SECRET_PROBE", "sk-must-not-leak")
    workspace = toolbox.workspace
    (workspace / "DESIGN.md").unlink()
    (workspace / "DESIGN.md").symlink_to("/proc/self/environ")
    answered = _call(toolbox, "read_design")
    assert "sk-must-not-leak" not in answered and "a link out of the workspace" in answered
    prompt = implementer_prompt(tiny_spec, Task(id="t", title="t", rationale="r"), workspace, [], [])
    assert "sk-must-not-leak" not in prompt and "a link out of the workspace" in prompt

    recipe = tmp_path / "library" / "kv_cache.py"  # stands for skills/recipes/kv_cache.py
    recipe.parent.mkdir()
    recipe.write_text((Path(__file__).parent.parent / "skills" / "recipes" / "kv_cache.py").read_text())
    before = recipe.read_bytes()
    assert b"# VAL:" in before
    (workspace / "stack" / "linked.py").symlink_to(recipe)
    problems = expand_annotations(workspace)
    assert recipe.read_bytes() == before
    assert problems == ["stack/linked.py: a link out of the workspace: not expanded; put the file itself there"]


def test_a_stack_that_is_a_link_out_is_neither_listed_nor_expanded(toolbox, tmp_path):
    """The file map (the next attempt's prompt) and the annotations' expansion skipped links inside stack/,
    not a stack/ that is itself one: a red team's command swapped stack/ for a link to a host folder its
    sandbox could not see, and the prompt listed that folder's files with their first lines (an API token)."""
    from agents.llm.agents import expand_annotations
    from agents.llm.context import file_map

    host = tmp_path / "host-secrets"
    (host / "proj").mkdir(parents=True)
    (host / "proj" / "settings.py").write_text('"""API_TOKEN=sk-live-1234 do not share"""\n# VAL: VAL_NON_EMPTY\n')
    workspace = toolbox.workspace
    (workspace / "stack").rename(workspace / "stack.real")
    (workspace / "stack").symlink_to(host)
    assert file_map(workspace) == []
    assert expand_annotations(workspace) == [
        "stack: a symbolic link: not expanded; the stack must be a folder of the workspace"
    ]
    assert "sk-live" in (host / "proj" / "settings.py").read_text()  # untouched


def test_a_huge_design_record_is_cut_in_every_prompt(toolbox, tiny_spec):
    """DESIGN.md went whole into the implementer's prompt (resent every turn) and the planner's: an agent's
    4 MB one made a million-token call, past any --max-cost in one go. Both cut it to its head and tail."""
    from agents.llm.agents import implementer_prompt
    from agents.llm.tools import MAX_DESIGN

    (toolbox.workspace / "DESIGN.md").write_text("# Decisions\n" + "padding line\n" * 300_000)
    prompt = implementer_prompt(tiny_spec, Task(id="t", title="t", rationale="r"), toolbox.workspace, [], [])
    assert len(prompt) < 2 * MAX_DESIGN + 60_000 and "characters cut from the middle" in prompt


def test_the_implementer_is_told_every_way_of_faking_figures_the_gate_and_the_reviewer_look_for(toolbox, tiny_spec):
    """Attempts were rejected for rules the implementer was never told: only the judge's prompt listed the
    ways a stack can fake its figures. The implementer's lists each with what the gate checks of it."""
    from agents.llm.agents import implementer_prompt
    from agents.llm.hacks import HACKS

    prompt = implementer_prompt(tiny_spec, Task(id="t", title="t", rationale="r"), toolbox.workspace, [], [])
    rules = prompt[prompt.index("## Rules") : prompt.index("## Workflow")]
    assert all(f"- {hack.name}: {hack.how}" in rules for hack in HACKS)
    assert "cannot be done as asked" in rules


def test_the_judges_reasons_are_cut_in_the_next_attempts_prompt(toolbox, tiny_spec, monkeypatch):
    """A reason may quote the candidate's own text whole (a controller's exception): a megabyte one went into
    every call of the next attempt. Each reason is cut to its head and tail, and there are a few of them."""
    from agents.llm import agents
    from agents.llm.agents import implementer_prompt
    from agents.llm.tools import MAX_FEEDBACK_LINE, MAX_FEEDBACK_LINES

    monkeypatch.setattr(agents.facts, "diff_stat", lambda workspace: "")  # the toolbox's workspace is no worktree
    feedback = ["system run failed: RuntimeError: " + "seen " * 200_000, *[f"reason {k}" for k in range(100)]]
    task = Task(id="t", title="t", rationale="r")
    prompt = implementer_prompt(tiny_spec, task, toolbox.workspace, feedback, [])
    quiet = implementer_prompt(tiny_spec, task, toolbox.workspace, ["one reason"], [])
    assert len(prompt) - len(quiet) < MAX_FEEDBACK_LINE + 30 * MAX_FEEDBACK_LINES + 2_000
    assert "characters cut from the middle" in prompt and f"and {101 - MAX_FEEDBACK_LINES} more reasons" in prompt


def test_file_system_errors_come_back_as_tool_errors(toolbox):
    assert _call(toolbox, "write_file", path="stack", content="x").startswith("error: 'stack' is there and is no")
    (toolbox.workspace / "stack" / "blob.bin").write_bytes(b"\xff\xfe\x00")
    assert _call(toolbox, "edit_file", path="stack/blob.bin", old="a", new="b").startswith("error: edit_file failed: ")
    (toolbox.workspace / "stack" / "empty.py").write_text("")
    assert _call(toolbox, "read_file", path="stack/empty.py") == "stack/empty.py is empty"


def test_a_fifo_or_a_link_loop_the_agent_made_is_an_error_never_a_hang(toolbox):
    """Planted by the agent's own command (``mkfifo stack/pipe.py``): writing to it, or expanding the stack's
    annotations, held the orchestrator for ever; a link loop ended the attempt with a RuntimeError. Each is
    an error the model reads, and the judge's tampering check names the FIFO."""
    import threading

    from agents import workspace_git
    from agents.llm.agents import expand_annotations

    stack = toolbox.workspace / "stack"
    os.mkfifo(stack / "pipe.py")
    (stack / "loop.py").symlink_to(stack / "loop.py")
    answers = {}

    def calls() -> None:
        answers["write"] = _call(toolbox, "write_file", path="stack/pipe.py", content="x = 1\n")
        answers["loop"] = _call(toolbox, "read_file", path="stack/loop.py")
        answers["expand"] = expand_annotations(toolbox.workspace)

    worker = threading.Thread(target=calls, daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "a tool call blocked on the FIFO"
    assert answers["write"].startswith("error: 'stack/pipe.py' is there and is no regular file"), answers
    assert answers["loop"].startswith("error: ") and "loop" in answers["loop"].lower(), answers
    assert any("stack/pipe.py: not a regular file" in p for p in answers["expand"]), answers
    assert any("stack/loop.py: a symbolic link loop" in p for p in answers["expand"]), answers
    assert any("stack/pipe.py: a FIFO, socket or device" in r for r in workspace_git.tampering(toolbox.workspace))


def test_the_benchmark_tool_refuses_a_workspace_the_judge_would(tmp_path, tiny_spec):
    """The tools' benchmark ran on the live workspace with no tampering check: a link there to a host file
    was scanned (its text quoted back in the reasons) as the judge's frozen copy never is. Refused before
    any run (no session is reached)."""
    from agents.factory import benchmark_tool

    write_starter(tmp_path / "ws", tiny_spec, "colocate")
    (tmp_path / "ws" / "stack" / "peek.py").symlink_to(Path(os.__file__))
    said = benchmark_tool(None, tmp_path / "ws")
    assert said.startswith("FAILED: stack/peek.py: a symbolic link in the candidate"), said


def test_the_benchmark_tool_runs_on_a_workload_the_twin_never_runs(tmp_path, tiny_spec):
    """The tools measured on seed 0, the twin's: what they quote back (a controller's exception, its
    metrics) taught a candidate the workload its pre-screen would be run on. They have a seed of their own."""
    from types import SimpleNamespace

    from agents.factory import benchmark_tool
    from orchestrator.prescreen import TWIN_SEED

    seeds = []

    def measure(workspace, out, seed):
        seeds.append(seed)
        return SimpleNamespace(ok=True, metrics={"goodput": 1.0})

    write_starter(tmp_path / "ws", tiny_spec, "colocate")
    assert benchmark_tool(SimpleNamespace(measure=measure), tmp_path / "ws") == "goodput: 1"
    assert seeds and TWIN_SEED not in seeds


def test_a_search_is_bounded_in_time_in_bytes_and_in_matches(toolbox, monkeypatch):
    """The model's pattern ran in the orchestrator with no limit (``(a|aa)+$`` backtracks for ever), kept every
    match before showing 200, and read a file once per hard link to it (a hundred links, a hundred reads)."""
    from agents.llm import tools

    monkeypatch.setattr(tools, "SEARCH_LIMIT_S", 0.5)
    stack = toolbox.workspace / "stack"
    (stack / "slow.txt").write_text("a" * 40 + "!\n")
    slow = _call(toolbox, "search_files", pattern="(a|aa)+$", path="stack")
    assert "[the search stopped after 0.5 s" in slow, slow
    (stack / "slow.txt").unlink()
    (stack / "many.txt").write_text("needle\n" * 300)
    for k in range(5):
        os.link(stack / "many.txt", stack / f"link{k}.txt")
    many = _call(toolbox, "search_files", pattern="needle", path="stack")
    assert many.count("needle") == 200 and "[the search more than 200 matches" in many, many[-300:]
    assert len({line.split(":")[0] for line in many.splitlines()[:200]}) == 1  # one file, read once


def test_an_unknown_tool_or_invalid_arguments_come_back_as_tool_errors(toolbox):
    unknown = toolbox.call(ToolCall("c", "delete_everything", "{}"))
    assert unknown.startswith("error: there is no tool 'delete_everything'; the tools are: list_files")
    missing = toolbox.call(ToolCall("c", "edit_file", '{"path": "stack/params.json"}'))
    assert missing.startswith("error: edit_file was called with invalid arguments") and "old" in missing
    assert "invalid arguments" in toolbox.call(ToolCall("c", "read_file", "{not json"))


def test_commands_run_in_the_sandbox_without_the_keys(toolbox, monkeypatch):
    """The command gets the harness's environment scrubbed as a candidate's run is (its PATH and Python,
    so the agent can run the stack's tests), never a key: an empty environment hid both."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-must-not-leak")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    result = _call(toolbox, "run_command", command="env; python -c 'import sys, yaml; print(sys.prefix)'")
    assert "exit code 0" in result and sys.prefix in result, result
    assert "sk-must-not-leak" not in result


def test_a_command_is_held_to_its_memory_and_file_limits_and_its_output_comes_back_in_part(toolbox):
    """run_command had no bound but time: a model-written command could fill the disk (a 20 GiB file),
    take the machine's memory, or print without end into a pipe the harness read whole into its own."""
    from agents.reaped_run import CommandLimits

    toolbox.limits = CommandLimits(memory_bytes=1 << 30, file_bytes=1 << 20, output_chars=1000)
    wrote = _call(toolbox, "run_command", command="head -c 2000000 /dev/zero > big; echo wrote $?")
    assert (toolbox.workspace / "big").stat().st_size == 1 << 20 and "wrote 0" not in wrote, wrote
    took = _call(toolbox, "run_command", command="python3 -c 'b = bytearray(1536 << 20)'")
    assert "exit code 1" in took and "MemoryError" in took, took
    printed = _call(toolbox, "run_command", command="seq 1 100000")  # 589 kB: the start and the end come back
    assert "\n1\n2\n" in printed and "\n100000\n" in printed and "bytes left out" in printed
    assert len(printed) < 3000
    endless = _call(toolbox, "run_command", command="yes", timeout_s=60)  # stopped at the output file's limit
    assert endless.startswith("exit code 153") and "y\ny\n" in endless  # 128 + SIGXFSZ
    (toolbox.workspace / "big").write_bytes(b"x\n" * (9 << 20))  # past what the host-side tools read whole
    assert "look into it with run_command" in _call(toolbox, "read_file", path="big")
    assert "not searched, over 8388608 bytes: big" in _call(toolbox, "search_files", pattern="x", path=".")


def test_a_limit_over_the_harness_own_is_held_at_it_and_a_container_gets_its_own(tmp_path):
    """The reaper set the limits as asked: under a lower hard limit (a ulimit the harness runs with)
    setrlimit raised, and every command failed. Under Docker the reaper's limits hold only the docker
    client: the container is given its own."""
    script = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 21, 1 << 21)); "
        "from pathlib import Path; from agents.reaped_run import CommandLimits, run_reaped; "
        "done = run_reaped(['sh', '-c', 'ulimit -f; echo ran'], '', cwd=Path('.'), env=None, timeout_s=30, "
        "limits=CommandLimits(memory_bytes=1 << 34, file_bytes=1 << 30)); print(done.returncode, done.stdout)"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).parent.parent
    )
    assert ran.returncode == 0 and ran.stdout.split() == ["0", str((1 << 21) // 512), "ran"], ran.stderr
    docker = Sandbox("docker", "an-image")
    command, _ = docker.wrap(["true"], {}, writable=[tmp_path], owner="me", memory_bytes=1 << 30, file_bytes=1 << 20)
    assert command[command.index("--memory") + 1] == str(1 << 30)
    assert command[command.index("--ulimit") + 1] == f"fsize={1 << 20}:{1 << 20}"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process command lines from /proc")
def test_a_command_past_its_time_leaves_nothing_running(tmp_path, tiny_spec):
    """subprocess.run's timeout killed only the direct child: under the subprocess (or Docker) sandbox a
    background, setsid'd process the model started ran on, writing into the workspace or loading the
    machine while the judge measured. The command runs under the reaper now, as a CLI's call does."""
    import uuid

    write_starter(tmp_path / "ws", tiny_spec, "colocate")
    toolbox = Toolbox(tmp_path / "ws", Sandbox("subprocess"))
    token = f"vt-left-running-{uuid.uuid4().hex[:8]}"
    command = f"setsid bash -c 'touch started; exec -a {token} sleep 300' & sleep 60"
    result = _call(toolbox, "run_command", command=command, timeout_s=2)
    assert "ran past 2s; it and every process it started were stopped" in result
    assert (tmp_path / "ws" / "started").exists(), "the background process never started: nothing was left to stop"

    def running(proc: Path) -> bool:
        try:
            return token in proc.joinpath("cmdline").read_bytes().decode(errors="replace") and (
                proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            )
        except (FileNotFoundError, ProcessLookupError):
            return False  # it ended while we looked

    assert not [proc for proc in Path("/proc").glob("[0-9]*") if running(proc)]


# -- full rounds through vibetrain generate ----------------------------------------------------------

EDIT = (
    "edit_file",
    {
        "path": "stack/params.json",
        "old": '"controller": "colocate"',
        "new": '"controller": "static_split",\n  "rollout_devices": 1,\n  "train_devices": 1',
    },
)


def _script_a_run(server, rounds: int, review: str = "accept") -> None:
    for _ in range(rounds + 1):  # round 0 (the starter) is judged and evaluated too
        server.script("judge", Reply(text=json.dumps({"verdict": "accept", "reasons": ["plain change"]})))
        server.script(
            "evaluator",
            Reply(text=json.dumps({"hints": [{"code": "llm_note", "message": "looks rollout-bound", "by": "rules"}]})),
        )
    for _ in range(rounds):
        server.script(
            "implementer",
            Reply(tool_calls=[("read_file", {"path": "stack/params.json"})]),
            Reply(text="switching", tool_calls=[EDIT]),
            Reply(
                text=json.dumps(
                    {"summary": "static_split: 1 rollout + 1 train device", "files_changed": ["stack/params.json"]}
                )
            ),
        )
    if review == "reject":
        server.scripts["judge"].pop()
        server.script(
            "judge",
            Reply(text=json.dumps({"verdict": "reject", "reasons": ["stack/report.py computes throughput itself"]})),
        )


@pytest.mark.slow
@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_an_llm_implementer_writes_a_validated_commit_through_tool_calls(server, tmp_path, fast_target, provider):
    _script_a_run(server, rounds=1)
    policy = []
    if provider == "openai":  # the LLM planner picks the round (for anthropic, the backlog does)
        policy = ["--policy", "llm"]
        server.script(
            "planner",
            Reply(
                text=json.dumps(
                    {
                        "parent_round": 0,
                        "plan": ["then try time_multiplex"],
                        "task": {
                            "id": "split-one-one",
                            "title": "split the two devices 1/1",
                            "rationale": "training blocks rollout",
                            "skills": ["static_split"],
                            "changes": {},
                            "acceptance": ["vibetrain check passes"],
                        },
                    }
                )
            ),
        )
    code, output, run = generate(server, tmp_path, fast_target, provider, "--rounds", "1", *policy)
    assert code == 0, output
    state = RunState.load(run)
    assert [r.verdict for r in state.rounds] == ["accepted", "accepted"], [r.reasons for r in state.rounds]
    repo = git.Repo(run)
    commit = repo.commit(state.record(1).commit)
    assert f"Agent-Backend: {provider}" in commit.message
    assert "Implementer: static_split: 1 rollout + 1 train device" in commit.message  # the agent's own account
    assert "Change: static_split: 1 rollout + 1 train device" in repo.git.show(f"{commit.hexsha}:DESIGN.md")
    assert json.loads(repo.git.show(f"{commit.hexsha}:stack/params.json"))["controller"] == "static_split"
    # the LLM's reading, said so wherever a person reads it (it claimed to be the rules')
    assert [h.by for h in state.record(1).hints if h.code == "llm_note"] == ["llm"]
    assert "looks rollout-bound (the LLM evaluator's reading)" in commit.message
    calls = 6 if provider == "openai" else 5  # implementer 3, judge, evaluator (+ the planner)
    assert state.record(1).llm["calls"] == calls and state.record(1).llm["input_tokens"] == 100 * calls
    if provider == "openai":
        assert state.record(1).task.id == "split-one-one" and state.record(1).task.source == "llm"
        assert any(t.title == "then try time_multiplex" for t in state.backlog)
    log = runner.invoke(app, ["log", str(run)], env={"COLUMNS": "160"}).output
    assert "tokens in/out" in log and f"{100 * calls}/{20 * calls}" in log and "LLM use: " in log
    roles = [r["role"] for r in server.requests]
    assert roles.count("implementer") == 3 and roles.count("judge") == 2
    assert not any(
        "sk-test-secret" in p.read_text(errors="ignore")
        for p in run.rglob("*")
        if p.is_file() and ".git" not in p.parts
    )


def test_a_backend_that_refuses_the_runs_key_stops_the_run_with_every_round_kept(server, tmp_path, fast_target):
    """A 401 (or a 403, a 404 for the model) would meet every later call: each round's attempts were
    rejected in turn, the run going on to its budget. The run stops now, naming what to fix, and
    --resume redoes the round."""
    _script_a_run(server, rounds=0)  # the starter's review and hints
    server.script("implementer", Fault(status=401))
    code, output, run = generate(server, tmp_path, fast_target, "openai", "--rounds", "2")
    assert code == 1, output
    assert "round 1 stopped: an agent's LLM backend refuses this run's configuration" in output
    assert "authentication failed (401)" in output and "--resume" in output and "Traceback" not in output
    state = RunState.load(run)
    assert [r.round for r in state.rounds] == [0] and state.next_round == 1 and state.best_round == 0
    assert [r["role"] for r in server.requests].count("implementer") == 1  # no second attempt, no second round


@pytest.mark.slow
def test_the_evaluator_is_told_the_spread_and_the_paired_comparison_with_the_best(server, tmp_path, tiny_spec):
    """Its prompt held the medians alone: its hints could not say whether the change helped or was noise."""
    from types import SimpleNamespace

    from agents.llm.agents import LLMEvaluator
    from agents.roles import Evaluation
    from targets.harness.measure.session import Paired

    measured = Evaluation(
        headline=1.3,
        metrics={"goodput": 1.3, "mean_step_time": 9.5},
        spread={"goodput": 0.07},
        repeats=[{}, {}, {}],
        hints=[],
        paired=Paired(ratio=1.084, low=1.021, high=1.151, pairs=3),
    )
    server.script("evaluator", Reply(text='{"hints": []}'))
    offline = SimpleNamespace(evaluate=lambda *args: measured)
    LLMEvaluator(tiny_spec, offline, _client(server, "openai")).evaluate(tmp_path, tmp_path, None, [0])
    prompt = server.requests[-1]["body"]["messages"][0]["content"]
    assert "- goodput: 1.3 (spread 0.07)" in prompt and "- mean_step_time: 9.5\n" in prompt
    assert "1.084x on the headline over 3 interleaved pairs, 95% interval [1.021, 1.151]" in prompt


def test_max_turns_sets_an_implementer_attempts_turns(server, monkeypatch):
    """The implementer's 40 turns were fixed: a large task's attempt could not be given more, nor a cheap
    run fewer."""
    from agents.factory import make_agents
    from agents.llm.agents import DEFAULT_MAX_TURNS
    from targets.harness.measure.session import Session
    from targets.harness.target import Target

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    session = Session.open(Target.load("tiny-qwen3-cpu"), "subprocess", None)
    llm = {"model": "gpt-4o", "base_url": server.url + "/v1"}
    made = [
        make_agents("openai", session, engine_devices=1, seed=0, repeat=1, llm={**llm, **more})
        for more in ({}, {"max_turns": 7})
    ]
    assert [agents.implementer.max_turns for agents in made] == [DEFAULT_MAX_TURNS, 7]


def test_the_llm_review_rejects_a_hack_the_gate_let_through(server, tmp_path, fast_target):
    _script_a_run(server, rounds=1, review="reject")
    code, output, run = generate(server, tmp_path, fast_target, "openai", "--rounds", "1", "--max-attempts", "1")
    state = RunState.load(run)
    assert state.record(1).verdict == "rejected"
    assert state.record(1).reasons == ["llm_review: stack/report.py computes throughput itself"]
    assert "llm_review" in runner.invoke(app, ["log", str(run)], env={"COLUMNS": "160"}).output
    assert state.best_round == 0


@pytest.mark.slow
def test_bad_tool_calls_go_back_to_the_model_and_a_budget_stops_the_run(server, tmp_path, fast_target):
    server.script("judge", Reply(text='{"verdict": "accept"}'))
    server.script("evaluator", Reply(text='{"hints": []}'))
    server.script(
        "implementer",
        Reply(tool_calls=[("rm_rf", {})]),  # an unknown tool
        Reply(tool_calls=[("edit_file", '{"path": 3')]),  # arguments that do not parse
    )
    code, output, run = generate(
        server, tmp_path, fast_target, "openai", "--rounds", "3", "--max-tokens", "400", "--max-attempts", "1"
    )
    state = RunState.load(run)
    assert [r.round for r in state.rounds] == [0] and state.record(0).verdict == "accepted", output
    second = server.requests[-1]["body"]["messages"]  # the attempt went on after the bad call
    assert second[-1]["role"] == "tool" and second[-1]["content"].startswith("error: there is no tool 'rm_rf'")
    # the budget ran out inside round 1: it stops the run cleanly, round 1 to be redone on --resume
    assert code == 0 and state.next_round == 1 and "round 1 stopped: token budget of 400 spent" in output
    assert state.llm_used["input_tokens"] + state.llm_used["output_tokens"] == 480


def test_max_cost_is_refused_for_a_model_without_a_price(server, tmp_path, fast_target):
    """Its calls would count $0 and the budget could never stop the run: refused before anything is
    written (exit 2, naming --prices); a price from the table or from --prices lets it through."""
    code, output, run = generate(
        server, tmp_path, fast_target, "openai", "--max-cost", "1", "--rounds", "0", model="my-local-model"
    )
    assert code == 2 and "no price known for model 'my-local-model'" in output and "--prices" in output
    assert not run.exists() and server.requests == []
    llm = LLMConfig(model="my-local-model", api_key_env=KEY)
    with pytest.raises(RunSetupError, match="give its price with --prices FILE"):
        _check_cost_counted("openai", llm, 1.0)
    prices = tmp_path / "prices.yaml"
    prices.write_text("my-local-model: [0.1, 0.2]\n")
    _check_cost_counted("openai", llm.model_copy(update={"prices": str(prices)}), 1.0)
    _check_cost_counted("openai", llm.model_copy(update={"model": "gpt-4o-2024-08-06"}), 1.0)
    _check_cost_counted("openai", llm, None)  # no cost budget: an unpriced model is only warned about
    missing = llm.model_copy(update={"prices": str(tmp_path / "nosuch.yaml")})  # read before the run, named
    with pytest.raises(RunSetupError, match=r"--prices: .*nosuch.yaml: No such file"):
        _check_cost_counted("openai", missing, None)


@pytest.mark.slow
def test_a_cost_budget_is_checked_before_each_call_not_only_between_rounds(server, tmp_path, fast_target):
    """$0.12 a call against $0.30: round 0's two calls leave $0.06, so round 1's implementer gets one
    call and the next is refused inside the round, which stops the run cleanly: round 1 is not recorded
    (it was, rejected, and its task counted as tried: never again on that best after a --resume with a
    larger budget). --max-output-tokens reaches every request."""
    prices = tmp_path / "prices.yaml"
    prices.write_text("my-local-model: [1000, 1000]\n")
    _script_a_run(server, rounds=1)
    code, output, run = generate(
        server,
        tmp_path,
        fast_target,
        "openai",
        "--rounds",
        "2",
        "--max-cost",
        "0.3",
        "--prices",
        str(prices),
        "--max-output-tokens",
        "1234",
        model="my-local-model",
    )
    assert code == 0, output
    assert [r["role"] for r in server.requests] == ["judge", "evaluator", "implementer"]
    state = RunState.load(run)
    assert [r.round for r in state.rounds] == [0] and state.llm_used["cost_usd"] == pytest.approx(0.36)
    assert state.next_round == 1 and History.open(run).rejected_commit(1) is None
    assert "round 1 stopped: cost budget of $0.3 spent" in " ".join(output.split())
    assert {r["body"]["max_tokens"] for r in server.requests} == {1234}
    assert load_llm_spend(run) == state.llm_used  # saved after each call too


def test_a_run_killed_mid_round_resumes_knowing_what_the_round_spent(tmp_path):
    """The run state saves LLM use between rounds; every call also saves it on its own. A run killed
    after a call and before its round ended resumes with that call counted, so ``--max-cost`` is not
    spent twice; a spend older than the state (fewer calls) never overrides it."""
    from orchestrator.state import RunConfig

    run = tmp_path / "run"
    (run / ".git").mkdir(parents=True)
    settings = dict(target="tiny-qwen3-cpu", target_id="tiny-qwen3-cpu", policy="backlog", agents="openai", seed=0)
    settings.update(rounds=1, max_minutes=None, max_attempts=1, repeat=1, starter="colocate", simulated=False)
    state = new_state(RunConfig(**settings, sandbox="subprocess", max_cost=1.0))
    state.llm_used = {"calls": 2, "input_tokens": 200, "output_tokens": 40, "cost_usd": 0.24}
    state.save(run)
    accounting = Accounting(spent_before=dict(state.llm_used))
    accounting.prices["m"] = (1000.0, 1000.0)

    def save():  # what generate wires in: the run's totals after each call
        used = {k: state.llm_used[k] + v for k, v in accounting.snapshot().items()}
        save_llm_spend(run, used)

    accounting.on_call = save
    accounting.add("m", 100, 20)  # the round's first call; then the process is killed
    resumed = RunState.load(run)
    assert resumed.llm_used == {"calls": 3, "input_tokens": 300, "output_tokens": 60, "cost_usd": pytest.approx(0.36)}
    save_llm_spend(run, {"calls": 1, "cost_usd": 0.12})
    assert RunState.load(run).llm_used["calls"] == 2
    (run / ".git" / "llm_spend.json").write_text("{not json")
    with pytest.raises(RunStateError, match="llm_spend.json is corrupt"):
        RunState.load(run)
    (run / ".git" / "llm_spend.json").write_text('{"calls": "5"}')
    with pytest.raises(RunStateError, match="not the run's LLM use"):
        RunState.load(run)


def test_pareto_selection_is_refused_for_a_policy_without_a_population(tmp_path):
    """--selection chooses evolve's parents: asked of the backlog or the llm policy, it is named, not ignored."""
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--selection", "pareto", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert "--selection pareto chooses the evolve policy's parents: add --policy evolve" in result.output
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--selection", "paretoo", "--out", str(tmp_path / "r")])
    assert "unknown parent selection 'paretoo' (did you mean 'pareto'?)" in result.output


def test_a_missing_key_or_llm_backend_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    result = runner.invoke(
        app, ["generate", "tiny-qwen3-cpu", "--agents", "openai", "--model", "gpt-4o", "--out", str(tmp_path / "b")]
    )
    assert result.exit_code == 2 and "no API key in $OPENAI_API_KEY" in result.output and not (tmp_path / "b").exists()
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--policy", "llm", "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and "--policy llm needs an LLM backend" in result.output
