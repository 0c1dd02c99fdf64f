"""A code round carried by an LLM implementer through the fake provider, end to end: the model reads
the contract, views a file by lines, makes a malformed call and recovers, edits, calls ``finish``, gets
a failing check back, fixes it, and is validated; the commit carries its account. Also the loop's
own recoveries: a turn without a tool call is nudged, a model that repeats one call is stopped with a
reason, old tool results are masked, and an answer is the last JSON object of a reply."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import git
import pytest
from pydantic import BaseModel

from agents.llm.accounting import Accounting
from agents.llm.client import ClientConfig, ToolCall, make_client
from agents.llm.loop import MASKED, StuckError, last_json_object, masked, run_loop
from agents.llm.tools import Toolbox
from agents.roles import AgentError
from orchestrator.state import RunState
from skills.starter import write_starter
from targets.harness.isolation.sandbox import Sandbox

sys.path.insert(0, str(Path(__file__).parent))
from fake_llm import KEY, FakeLLMServer, Reply, generate  # noqa: E402

CHEAT = "from targets.harness import clock\n\nSTART = clock\n"
SUMMARY = "static_split 1/1: training no longer blocks rollout; notes.py keeps the split's rationale"


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(KEY, "sk-test-secret")
    with FakeLLMServer() as fake:
        yield fake


def _finish(summary: str) -> tuple[str, dict]:
    return ("finish", {"summary": summary, "files_changed": ["stack/params.json", "stack/notes.py"]})


@pytest.mark.slow
def test_a_scripted_code_round_recovers_fixes_a_failing_check_and_is_validated(server, tmp_path, fast_target):
    for _ in range(2):  # round 0 (the starter) and round 1 are reviewed and evaluated
        server.script("judge", Reply(text=json.dumps({"verdict": "accept", "reasons": ["plain change"]})))
        server.script("evaluator", Reply(text=json.dumps({"hints": []})))
    server.script(
        "implementer",
        Reply(text="First the contract.", tool_calls=[("read_file", {"path": "targets/api.py", "end_line": 40})]),
        Reply(tool_calls=[("read_file", {"path": "stack/params.json", "start_line": 1, "end_line": 4})]),
        Reply(tool_calls=[("edit_file", '{"path": "stack/params.json", "old": ')]),  # malformed: cut JSON
        Reply(
            tool_calls=[
                (
                    "edit_file",
                    {
                        "path": "stack/params.json",
                        "old": '"controller": "colocate"',
                        "new": '"controller": "static_split",\n  "rollout_devices": 1,\n  "train_devices": 1',
                    },
                ),
                ("write_file", {"path": "stack/notes.py", "content": CHEAT}),
            ]
        ),
        Reply(tool_calls=[_finish(SUMMARY)]),  # the integrity check fails: the import comes back to the model
        Reply(tool_calls=[("write_file", {"path": "stack/notes.py", "content": '"""Why the split is 1/1."""\n'})]),
        Reply(tool_calls=[_finish(SUMMARY)]),
    )
    code, output, run = generate(server, tmp_path, fast_target, "openai", "--rounds", "1", "--max-attempts", "1")
    assert code == 0, output
    state = RunState.load(run)
    assert [r.verdict for r in state.rounds] == ["accepted", "accepted"], [r.reasons for r in state.rounds]

    implementer = [r["body"] for r in server.requests if r["role"] == "implementer"]
    assert len(implementer) == 7  # every scripted turn was asked for: nothing ended the attempt early
    results = [m for m in implementer[-1]["messages"] if m["role"] == "tool"]
    contract, view, malformed, edit, write, failed, fixed, *_ = (m["content"] for m in results)
    assert contract.startswith("targets/api.py, lines 1-40 of ") and "|" in contract.splitlines()[1]
    assert view.splitlines()[1:] == [
        "1| {",
        '2|   "controller": "colocate",',
        *view.splitlines()[3:],
    ] and view.startswith("stack/params.json, lines 1-4 of ")
    assert malformed.startswith("error: edit_file was called with invalid arguments")
    assert edit.startswith("edited stack/params.json; lines ") and write.endswith("stack/notes.py compiles.")
    assert failed.startswith("Not finished yet:\nFAILED") and "imports harness internals (targets.harness)" in failed
    assert fixed.endswith("stack/notes.py compiles.")

    system = implementer[0]["messages"][0]["content"]  # the context pack
    for fact in ("targets/api.py", "stack/params.json (", "noise threshold", "simulated: ", "40 turns"):
        assert fact in system, fact

    commit = git.Repo(run).commit(state.record(1).commit)
    assert f"Implementer: {SUMMARY}" in commit.message
    assert json.loads(git.Repo(run).git.show(f"{commit.hexsha}:stack/params.json"))["controller"] == "static_split"
    assert "targets.harness" not in git.Repo(run).git.show(f"{commit.hexsha}:stack/notes.py")


# -- the loop's recoveries, on one workspace ---------------------------------------------------------


class Answer(BaseModel):
    summary: str


@pytest.fixture
def loop_parts(server, tmp_path, tiny_spec):
    write_starter(tmp_path / "ws", tiny_spec, "colocate")
    config = ClientConfig("openai", "gpt-4o", KEY, server.url + "/v1", backoff_s=0.01)
    return make_client(config, Accounting()), Toolbox(tmp_path / "ws", Sandbox.detect("auto"))


def _loop(client, toolbox, **options):
    first = [{"role": "user", "content": "go"}]
    return run_loop(client, "ROLE: implementer", first, toolbox, Answer, finish_description="done", **options)


def test_a_turn_without_a_tool_call_is_nudged_and_a_text_answer_counts_as_finish(server, loop_parts):
    server.script(
        "implementer",
        Reply(text="Let me think about this."),
        Reply(text='Done. The {braces} in prose do not matter: {"summary": "ok"}'),
    )
    result = _loop(*loop_parts)
    assert result.output.summary == "ok" and result.turns == 2
    nudge = server.requests[-1]["body"]["messages"][-1]
    assert "No tool was called" in nudge["content"] and "turns left" in nudge["content"]


def test_nudges_in_a_row_stop_the_loop_with_a_reason(server, loop_parts):
    server.script("implementer", *[Reply(text="thinking...") for _ in range(3)])
    with pytest.raises(StuckError, match="3 turns in a row without a tool call"):
        _loop(*loop_parts)


def test_the_same_call_over_and_over_stops_the_loop_with_a_reason(server, loop_parts):
    view = ("read_file", {"path": "stack/params.json"})
    server.script("implementer", *[Reply(tool_calls=[view]) for _ in range(3)])
    with pytest.raises(StuckError, match="called read_file with the same arguments 3 times in a row"):
        _loop(*loop_parts)


def test_measuring_again_is_never_taken_for_being_stuck(server, loop_parts, tmp_path):
    client, toolbox = loop_parts
    measuring = Toolbox(toolbox.workspace, toolbox.sandbox, checks=lambda: "PASSED", benchmark=lambda: "goodput: 1")
    server.script(
        "implementer",
        *[Reply(tool_calls=[("run_benchmark", {})]) for _ in range(3)],
        *[Reply(tool_calls=[("run_checks", {})]) for _ in range(3)],
        Reply(tool_calls=[("finish", {"summary": "compared three runs"})]),
    )
    assert _loop(client, measuring).output.summary == "compared three runs"


def test_turns_run_out_with_a_reason_and_a_warning_before(server, loop_parts):
    server.script("implementer", *[Reply(tool_calls=[("list_files", {"path": p})]) for p in ("stack", ".", "stack")])
    with pytest.raises(AgentError, match="used its 3 turns without finishing"):
        _loop(*loop_parts, max_turns=3)
    assert "turns left: finish soon" in server.requests[-1]["body"]["messages"][-1]["content"]


def test_a_finish_with_bad_arguments_or_refused_by_the_checks_goes_on(server, loop_parts):
    server.script(
        "implementer",
        Reply(tool_calls=[("finish", {"summry": "typo"})]),
        Reply(tool_calls=[("finish", {"summary": "first"})]),
        Reply(tool_calls=[("finish", {"summary": "second"})]),
    )
    seen = []
    result = _loop(
        *loop_parts, on_finish=lambda out: seen.append(out.summary) or ("FAILED x" if len(seen) == 1 else None)
    )
    assert result.output.summary == "second" and seen == ["first", "second"]
    messages = server.requests[-1]["body"]["messages"]
    tool_results = [m["content"] for m in messages if m["role"] == "tool"]
    assert tool_results[0].startswith("error: finish was called with invalid arguments")
    assert tool_results[1].startswith("Not finished yet:\nFAILED x")


def test_old_tool_results_are_masked_past_the_budget_and_the_newest_kept():
    messages = []
    for n in range(5):
        messages.append({"role": "assistant", "text": "", "tool_calls": []})
        messages.append({"role": "tool", "tool_call_id": str(n), "name": "read_file", "content": "x" * 100})
    out = [m for m in masked(messages, budget=250) if m["role"] == "tool"]
    assert [m["content"] == MASKED for m in out] == [True, True, True, False, False]
    assert [m["tool_call_id"] for m in out] == ["0", "1", "2", "3", "4"] and messages[1]["content"] == "x" * 100


def test_old_results_are_masked_a_chunk_at_a_time_so_the_conversation_start_holds_still():
    """Forty turns of 7,000-character results under a 60,000 budget: before, each turn past the budget
    masked one more result, rewriting the conversation's start every turn (no prompt cache could read
    it); now the masked set grows half a budget at a time, and what is kept stays within the budget."""
    messages: list[dict] = [{"role": "user", "content": "go"}]
    before, rewritten = None, 0
    for turn in range(40):
        messages.append({"role": "assistant", "text": "", "tool_calls": []})
        messages.append({"role": "tool", "tool_call_id": str(turn), "name": "read_file", "content": "x" * 7000})
        out = masked(messages)
        assert sum(len(m["content"]) for m in out if m["role"] == "tool" and m["content"] != MASKED) <= 60_000
        assert out[-1]["content"] != MASKED  # the newest is whole
        if before is not None and out[: len(before)] != before:
            rewritten += 1
        before = out
    assert 0 < rewritten <= 8  # 40 x 7,000 characters: (280,000 - 60,000) / 30,000 chunks, rounded up
    messages.append({"role": "assistant", "text": "", "tool_calls": []})
    messages.append({"role": "tool", "tool_call_id": "checks", "name": "finish", "content": "F" * 40_000})
    assert masked(messages)[-1]["content"] == "F" * 40_000  # the last turn's, however long, is read whole


def test_anthropic_turns_mark_the_conversation_so_each_reads_what_the_last_wrote(server, tmp_path, tiny_spec):
    """The tools, the system prompt and the last two user messages carry a cache breakpoint (four, the
    limit the fake refuses past, as Anthropic does), and each turn's conversation begins with the last
    turn's, so the turn before's breakpoint is a prefix of this one's."""
    write_starter(tmp_path / "ws", tiny_spec, "colocate")
    config = ClientConfig("anthropic", "claude-sonnet-4", KEY, server.url, backoff_s=0.01)
    client = make_client(config, Accounting())
    server.script(
        "implementer",
        *[Reply(tool_calls=[("read_file", {"path": "stack/params.json", "end_line": n})]) for n in (1, 2, 3)],
        Reply(tool_calls=[("finish", {"summary": "ok"})]),
    )
    _loop(client, Toolbox(tmp_path / "ws", Sandbox.detect("auto")))
    bodies = [r["body"] for r in server.requests if r["role"] == "implementer"]
    assert len(bodies) == 4
    for body in bodies:
        users = [m for m in body["messages"] if m["role"] == "user"]
        assert all("cache_control" in m["content"][-1] for m in users[-2:])
        assert not any("cache_control" in b for m in users[:-2] for b in m["content"])

    def unmarked(messages):
        return json.loads(json.dumps(messages).replace(', "cache_control": {"type": "ephemeral"}', ""))

    for earlier, later in zip(bodies, bodies[1:]):
        assert unmarked(later["messages"][: len(earlier["messages"])]) == unmarked(earlier["messages"])


def test_the_answer_is_the_last_balanced_json_object():
    assert last_json_object('I set {a} then {"x": {"y": 1}} and finally {"summary": "s"} done') == {"summary": "s"}
    assert last_json_object('```json\n{"verdict": "accept", "reasons": ["a {b}"]}\n```') == {
        "verdict": "accept",
        "reasons": ["a {b}"],
    }
    assert last_json_object('{"hints": [{"code": "a", "message": "b"}]}') == {"hints": [{"code": "a", "message": "b"}]}
    with pytest.raises(ValueError, match="no JSON object"):
        last_json_object("no braces {here")


def test_a_tool_call_object_round_trips_through_the_toolbox(loop_parts):
    _, toolbox = loop_parts
    assert toolbox.call(ToolCall("c", "list_files", '{"path": "stack"}')).startswith("stack/")


def test_anthropic_requests_mark_the_system_prompt_and_tools_for_caching(server, tmp_path, tiny_spec):
    write_starter(tmp_path / "ws", tiny_spec, "colocate")
    config = ClientConfig("anthropic", "claude-sonnet-4", KEY, server.url, backoff_s=0.01)
    server.script("implementer", Reply(tool_calls=[("finish", {"summary": "ok"})]))
    _loop(make_client(config, Accounting()), Toolbox(tmp_path / "ws", Sandbox.detect("auto")))
    body = server.requests[-1]["body"]
    assert (
        body["system"][-1]["cache_control"] == {"type": "ephemeral"}
        and "ROLE: implementer" in body["system"][0]["text"]
    )
    assert body["tools"][-1]["cache_control"] == {"type": "ephemeral"} and body["tools"][-1]["name"] == "finish"
    assert all("cache_control" not in tool for tool in body["tools"][:-1])
