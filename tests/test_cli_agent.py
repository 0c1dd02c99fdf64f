"""The coding-agent CLI backend without a real CLI: recorded output streams of Claude Code and Codex
(tests/fake_cli/, written from their documented schemas) parsed into answer, usage, cost and failure;
a fake `claude`/`codex` on PATH that records what it received (the prompt on stdin, only allowlisted
variables, the provider key), edits the workspace and prints a recorded stream; a timeout that stops the
CLI's whole process group; and the read-only LLM review of a CLI round."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import git
import pytest
from typer.testing import CliRunner

from agents.cli_agent import CLIChatClient, CLIImplementer, account, budget_usd
from agents.cli_tools import BASE_ENV, CHECK_ENV, TOOLS, cli_tool, parse_claude, parse_codex, run_cli
from agents.llm.accounting import Accounting
from agents.llm.client import ToolSpec
from agents.llm.errors import BudgetSpent
from agents.llm.judge import LLMJudge
from agents.roles import AgentError, Task, Verdict
from orchestrator.cli import app
from orchestrator.state import RunState
from skills.starter import write_starter
from targets.harness.isolation.launch import Limits
from targets.harness.isolation.sandbox import Sandbox
from targets.harness.judge.check_result import CheckResult
from targets.harness.measure.session import Session
from targets.harness.target import Target

FAKE = Path(__file__).parent / "fake_cli"
sys.path.insert(0, str(FAKE))
from fake_cli import install  # noqa: E402

runner = CliRunner()
TASK = Task(id="static-split", title="Split the devices", rationale="rollout and training contend")
CLAUDE_SUMMARY = "switched to static_split: 1 rollout + 1 train device; the checks pass"


def _stream(name: str) -> str:
    return (FAKE / name).read_text()


def _fake(tmp_path: Path, monkeypatch, name: str, scenario: str) -> Path:
    """Put a fake `name` CLI first on PATH, plant two secrets it must never see; its record file."""
    record = tmp_path / f"{name}-calls.jsonl"
    bin_dir = install(tmp_path / "bin", name, scenario, record)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SECRET_TOKEN", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    return record


def _calls(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def _option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture
def session():
    return Session(Target.load("tiny-qwen3-cpu", simulate=True), Sandbox("subprocess"), Limits(time_s=120))


@pytest.fixture
def workspace(tmp_path, tiny_spec):
    """A starter candidate committed as the parent, as a round's worktree is."""
    directory = write_starter(tmp_path / "ws", tiny_spec, "colocate")
    repo = git.Repo.init(directory)
    repo.git.add("-A")
    repo.index.commit("parent")
    return directory


# -- recorded streams ------------------------------------------------------------------------------


def test_claude_success_stream_gives_the_answer_usage_and_reported_cost():
    result = parse_claude(_stream("claude_success.json"))
    assert result.failure is None and json.loads(result.text)["summary"] == CLAUDE_SUMMARY
    # input counts the cache reads and writes Anthropic reports apart: 1234 + 2000 + 10000
    assert (result.input_tokens, result.output_tokens, result.cost_usd) == (13234, 56, 0.0123)


def test_claude_max_turns_stream_is_a_failure_naming_the_subtype_and_still_costs():
    result = parse_claude(_stream("claude_max_turns.json"))  # is_error is false: the subtype decides
    assert result.failure == "the claude CLI stopped with error_max_turns after 41 turns"
    assert (result.input_tokens, result.output_tokens, result.cost_usd) == (645120, 9100, 0.4821)
    assert result.derailed  # a limit the content can drive it to
    budget = json.loads(_stream("claude_max_turns.json")) | {"subtype": "error_max_budget_usd"}
    assert parse_claude(json.dumps(budget)).derailed and not parse_claude(_stream("claude_success.json")).derailed


def test_codex_success_stream_answers_with_its_last_agent_message_priced_by_model():
    result = parse_codex(_stream("codex_success.jsonl"))
    assert result.failure is None and json.loads(result.text)["files_changed"] == ["stack/params.json"]
    assert (result.input_tokens, result.output_tokens, result.cost_usd) == (24763, 1220, None)
    priced = Accounting()
    account(priced, TOOLS["codex"], result, "o4-mini")  # (1.1, 4.4) USD per Mtok in the price table
    assert priced.cost_usd == pytest.approx((24763 * 1.1 + 1220 * 4.4) / 1e6)
    unpriced = Accounting()
    account(unpriced, TOOLS["codex"], result, None)  # no model: tokens recorded, $0
    assert unpriced.snapshot() == {"calls": 1, "input_tokens": 24763, "output_tokens": 1220, "cost_usd": 0.0}


def test_codex_failed_stream_is_a_failure_with_the_turns_message():
    result = parse_codex(_stream("codex_failed.jsonl"))
    assert result.failure == "the codex CLI's turn failed: exceeded retry limit, last status: 429 Too Many Requests"
    retried = "\n".join(
        json.dumps(e)
        for e in [
            {"type": "error", "message": "stream disconnected; retrying 1/5"},
            {"type": "item.completed", "item": {"id": "item_0", "type": "agent_message", "text": "done"}},
            {"type": "turn.completed", "usage": {"input_tokens": 10, "cached_input_tokens": 0, "output_tokens": 2}},
        ]
    )
    assert parse_codex(retried).failure is None  # an error that a completed turn follows was retried
    assert parse_codex(retried).usage_reported


def test_a_call_that_reports_no_spend_says_so_instead_of_counting_it_free(caplog):
    """A failed Codex turn has no usage, and a Claude result without total_cost_usd counted $0: both were
    silent. The failed turn is said each time; the Claude call is priced by its model like Codex's."""
    failed = parse_codex(_stream("codex_failed.jsonl"))
    assert not failed.usage_reported
    accounting = Accounting()
    account(accounting, cli_tool("codex"), failed, "gpt-4.1")
    assert "the codex call reported no token usage (the codex CLI's turn failed" in caplog.text
    unpriced = json.dumps({"type": "result", "subtype": "success", "result": "ok", "usage": {"input_tokens": 1000}})
    result = parse_claude(unpriced)
    assert result.cost_usd is None
    account(accounting, cli_tool("claude"), result, "claude-sonnet-4-5")
    assert accounting.cost_usd == pytest.approx(1000 * 3.0 / 1e6)


# -- the implementer through a fake CLI ------------------------------------------------------------


def test_fake_claude_gets_the_prompt_on_stdin_and_only_allowlisted_variables(tmp_path, monkeypatch, session, workspace):
    record = _fake(tmp_path, monkeypatch, "claude", "success")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-test")  # another CLI's key: not for claude
    accounting = Accounting()
    implementer = CLIImplementer(session, cli_tool("claude"), accounting, None, max_turns=12)
    attempt = implementer.implement(TASK, workspace, ["check 2 failed: weights differ"])
    assert attempt.summary == CLAUDE_SUMMARY and attempt.files_changed == ["stack/params.json"]
    assert json.loads((workspace / "stack/params.json").read_text())["controller"] == "static_split"
    [call] = _calls(record)
    assert "ROLE: implementer" in call["stdin"] and "check 2 failed: weights differ" in call["stdin"]
    assert not any("ROLE: implementer" in arg or "weights differ" in arg for arg in call["argv"])
    env = call["env"]
    assert env["ANTHROPIC_API_KEY"] == "sk-ant-test"
    assert not {"SECRET_TOKEN", "AWS_SECRET_ACCESS_KEY", "OPENAI_API_KEY"} & env.keys()
    allowed = set(BASE_ENV + CHECK_ENV + TOOLS["claude"].KEYS + TOOLS["claude"].CONFIG)
    assert set(env) <= allowed | {"BASH_DEFAULT_TIMEOUT_MS", "BASH_MAX_TIMEOUT_MS"}
    # process ids are the machine's: the checks the CLI runs watch their children's memory in /proc
    assert call["pid"] == call["proc_self"]
    argv = call["argv"]
    assert _option(argv, "--max-turns") == "12" and _option(argv, "--max-budget-usd") == "5.0000"
    # no settings file widens these permissions or adds hooks, and no MCP server is started
    assert _option(argv, "--setting-sources") == "" and "--strict-mcp-config" in argv
    assert json.loads(_option(argv, "--mcp-config")) == {"mcpServers": {}}
    check = f"check tiny-qwen3-cpu --stack {workspace} --sandbox subprocess --time-limit 120 --simulate"
    tools = _option(argv, "--allowedTools").split(",")
    [bash_check] = [t for t in tools if t.startswith("Bash(") and "vibetrain" in t]
    assert bash_check.endswith(f"vibetrain {check})")
    assert {"Edit(./stack/**)", "Edit(./DESIGN.md)"} <= set(tools) and not {"Edit", "Write", "Bash"} & set(tools)
    # every shell rule exact: a prefix rule lets options be appended (`git diff --output=PATH` writes anywhere)
    assert not [t for t in tools if t.startswith("Bash(") and ":*" in t]
    assert f"vibetrain {check}\n" in call["stdin"] and call["cwd"] == str(workspace)
    assert accounting.snapshot() == {"calls": 1, "input_tokens": 13234, "output_tokens": 56, "cost_usd": 0.0123}


def test_claude_gets_the_runs_remaining_budget_and_none_once_it_is_spent(tmp_path, monkeypatch, session, workspace):
    record = _fake(tmp_path, monkeypatch, "claude", "success")
    accounting = Accounting(max_cost=0.02)
    implementer = CLIImplementer(session, cli_tool("claude"), accounting, None)
    implementer.implement(TASK, workspace, [])
    assert _option(_calls(record)[0]["argv"], "--max-budget-usd") == "0.0200"
    assert budget_usd(accounting, 5.0) == pytest.approx(0.02 - 0.0123)
    accounting.cost_usd = 0.03
    with pytest.raises(BudgetSpent, match="cost budget of \\$0.02 spent"):
        implementer.implement(TASK, workspace, [])
    assert len(_calls(record)) == 1  # refused before the CLI started


def test_claude_stopping_at_its_turn_limit_is_feedback_and_its_cost_counts(tmp_path, monkeypatch, session, workspace):
    _fake(tmp_path, monkeypatch, "claude", "max_turns")
    accounting = Accounting()
    with pytest.raises(AgentError, match="^the claude CLI stopped with error_max_turns after 41 turns$"):
        CLIImplementer(session, cli_tool("claude"), accounting, None).implement(TASK, workspace, [])
    assert accounting.cost_usd == pytest.approx(0.4821)


def test_an_annotation_the_cli_left_broken_is_feedback_not_a_crash(tmp_path, monkeypatch, session, workspace):
    _fake(tmp_path, monkeypatch, "claude", "bad_annotation")
    with pytest.raises(AgentError, match="left a validation annotation that cannot be expanded: .*missing \\['max'\\]"):
        CLIImplementer(session, cli_tool("claude"), Accounting(), None).implement(TASK, workspace, [])


def test_a_final_message_with_braces_in_its_prose_keeps_its_json_summary(tmp_path, monkeypatch, session):
    """A greedy match from the prose's first brace to the JSON's last failed to parse, so the summary became
    the raw prose and ``files_changed`` was lost; the last JSON object is the answer."""
    _fake(tmp_path, monkeypatch, "claude", "success")
    implementer = CLIImplementer(session, cli_tool("claude"), Accounting(), None)
    text = (
        "I set {async_ratio} in params.json (a dict like {'a': 1} is no JSON).\n"
        '{"summary": "raised async_ratio", "files_changed": ["stack/params.json"]}'
    )
    attempt = implementer._attempt(text)
    assert (attempt.summary, attempt.files_changed) == ("raised async_ratio", ["stack/params.json"])
    assert implementer._attempt("no JSON {here}").summary == "no JSON {here}"  # prose alone is the summary


def test_fake_codex_reads_the_prompt_from_stdin_and_sees_only_its_own_keys(tmp_path, monkeypatch, session, workspace):
    record = _fake(tmp_path, monkeypatch, "codex", "success")
    monkeypatch.setenv("CODEX_API_KEY", "sk-codex-test")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-test")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")  # another CLI's key: not for codex
    accounting = Accounting()
    attempt = CLIImplementer(session, cli_tool("codex"), accounting, None, model="o4-mini").implement(
        TASK, workspace, []
    )
    assert attempt.summary.startswith("switched to static_split") and attempt.files_changed == ["stack/params.json"]
    [call] = _calls(record)
    argv = call["argv"]
    assert argv[:2] == ["exec", "--json"] and argv[-1] == "-" and _option(argv, "--sandbox") == "workspace-write"
    assert _option(argv, "--model") == "o4-mini"
    assert "ROLE: implementer" in call["stdin"] and not any("ROLE: implementer" in arg for arg in argv)
    env = call["env"]
    assert env["CODEX_API_KEY"] == "sk-codex-test" and env["OPENAI_API_KEY"] == "sk-openai-test"
    assert not {"SECRET_TOKEN", "AWS_SECRET_ACCESS_KEY", "ANTHROPIC_API_KEY"} & env.keys()
    assert accounting.cost_usd == pytest.approx((24763 * 1.1 + 1220 * 4.4) / 1e6)


@pytest.mark.parametrize("scenario", ["success", "refresh_login", "other_login"])
def test_codex_reads_no_config_of_the_users_only_a_copy_of_its_login(
    tmp_path, monkeypatch, session, workspace, scenario
):
    """``codex exec`` has no flag that skips config.toml: a user's MCP servers or ``notify`` program would
    run in every call. Each call gets a scratch CODEX_HOME with the login alone; a login the CLI refreshed
    is kept, one of another account (the scratch home is writable by the CLI's commands) is not."""
    record = _fake(tmp_path, monkeypatch, "codex", scenario)
    user_home = tmp_path / "codex-home"
    user_home.mkdir()
    (user_home / "config.toml").write_text('notify = ["/bin/sh", "-c", "touch /tmp/pwned"]\n')
    login = {"tokens": {"account_id": "acct-1", "refresh_token": "r1"}, "last_refresh": "2026-11-01"}
    (user_home / "auth.json").write_text(json.dumps(login))
    monkeypatch.setenv("CODEX_HOME", str(user_home))
    CLIImplementer(session, cli_tool("codex"), Accounting(), None, model="o4-mini").implement(TASK, workspace, [])
    [call] = _calls(record)
    seen = Path(call["env"]["CODEX_HOME"])
    assert seen != user_home and not seen.exists()  # a scratch home, gone after the call
    # under vibetrain's cache, not the temp folder the CLI's workspace-write commands may write (one could leave
    # a login of its own there for the copy back to keep)
    assert seen.parent == Path(os.environ["VIBETRAIN_CACHE"]) / "codex-homes"
    assert call["codex_home"] == {"auth.json": json.dumps(login)}  # the login, not config.toml
    kept = json.loads((user_home / "auth.json").read_text())
    assert kept["tokens"]["refresh_token"] == ("rotated" if scenario == "refresh_login" else "r1")
    assert kept["tokens"]["account_id"] == "acct-1"


def test_a_failed_codex_turn_is_an_agent_error_with_its_message(tmp_path, monkeypatch, session, workspace):
    _fake(tmp_path, monkeypatch, "codex", "failed")  # prints the failed stream and exits 1
    with pytest.raises(AgentError, match="^the codex CLI's turn failed: exceeded retry limit, last status: 429"):
        CLIImplementer(session, cli_tool("codex"), Accounting(), None).implement(TASK, workspace, [])


def _alive(token: str) -> bool:
    """A running process has ``token`` on its command line (a zombie, dead but not yet reaped by whoever
    inherited it, counts as gone)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if token in proc.joinpath("cmdline").read_bytes().decode(errors="replace"):
                return proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # it ended while we looked, or is not ours to read
    return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_timeout_stops_the_cli_and_every_process_it_started(tmp_path, monkeypatch, workspace):
    record = _fake(tmp_path, monkeypatch, "claude", "hang")  # starts a sleeping grandchild, then sleeps itself
    tool = cli_tool("claude")
    with pytest.raises(AgentError, match="ran past 5s; it and every process it started were stopped"):
        run_cli(tool, [tool.executable(), "-p"], "go", cwd=workspace, env=tool.environment(), timeout_s=5, grace_s=1)
    [call] = _calls(record)
    assert not _alive(call["grandchild"])
    assert record.with_suffix(".terminated").exists()  # the CLI was asked first (SIGTERM), and could clean up


def test_a_call_past_its_time_counts_at_its_cap_not_at_nothing(tmp_path, monkeypatch, session, workspace, caplog):
    """A CLI call stopped at its timeout (or whose output could not be read) reports no spend: it was
    counted as $0 and 0 tokens, and the next attempt got the whole remaining budget again."""
    _fake(tmp_path, monkeypatch, "claude", "hang")
    accounting = Accounting()
    implementer = CLIImplementer(session, cli_tool("claude"), accounting, None, max_attempt_usd=0.5, timeout_s=3)
    with pytest.raises(AgentError, match="ran past 3s"):
        implementer.implement(TASK, workspace, [])
    assert accounting.calls == 1 and accounting.cost_usd == pytest.approx(0.5)
    assert "ended without reporting its spend: it counts at its cap, $0.5000" in caplog.text


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process command lines from /proc")
def test_a_process_the_cli_leaves_behind_with_setsid_ends_with_it(tmp_path, monkeypatch, workspace):
    """A grandchild that leaves the CLI's process group (setsid) and holds its stdout: the call neither
    waits for it (the pipe would keep it open past the timeout) nor leaves it running to write into the
    workspace or load the machine while the judge measures."""
    record = _fake(tmp_path, monkeypatch, "claude", "daemon")
    tool = cli_tool("claude")
    result = run_cli(tool, [tool.executable(), "-p"], "go", cwd=workspace, env=tool.environment(), timeout_s=20)
    assert result.failure is None and result.text
    [call] = _calls(record)
    assert not _alive(call["grandchild"])


CALLER = """import subprocess, sys
from agents.reaped_run import reaped_argv
reaper = subprocess.Popen(reaped_argv(["sleep", sys.argv[1]], 1.0))
print(reaper.pid, flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process command lines from /proc")
def test_a_reaper_whose_caller_died_before_it_started_leaves_nothing_running(tmp_path):
    """The caller killed while the reaper is still starting (held there: Python's start-up takes tens of ms,
    seconds on a busy machine), before it could arm its parent-death signal: it must not run the command
    for a caller that is gone. It used to take whoever adopted it for its caller, and ran it."""
    token = "1234.5"  # the command: `sleep 1234.5`, found by its command line
    root = Path(__file__).parents[1]
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, token], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root
    )
    try:
        reaper = int(caller.stdout.readline())
        os.kill(reaper, signal.SIGSTOP)
        caller.kill()
        caller.wait()
        os.kill(reaper, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(f"sleep\0{token}"):
            time.sleep(0.1)
        assert not _alive(f"sleep\0{token}"), "the command ran for a caller that had died"
    finally:
        subprocess.run(["pkill", "-KILL", "-f", f"sleep {token}"], check=False)


def test_a_missing_or_unknown_cli_is_refused_before_anything_runs(tmp_path, monkeypatch, session):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(AgentError, match="the codex CLI is not installed \\(no `codex` on PATH\\)"):
        CLIImplementer(session, cli_tool("codex"), Accounting(), None)
    with pytest.raises(AgentError, match="unknown coding-agent CLI 'aider'; known: claude, codex"):
        cli_tool("aider")


def test_generate_refuses_a_missing_cli_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--agents", "cli:codex", "--out", str(tmp_path / "a")])
    assert result.exit_code == 2 and "the codex CLI is not installed" in result.output and not (tmp_path / "a").exists()


def test_a_codex_cost_budget_needs_a_priced_model(tmp_path, monkeypatch):
    """Codex reports tokens, never dollars: --max-cost without a priced --model could never stop a run."""
    _fake(tmp_path, monkeypatch, "codex", "success")
    out = tmp_path / "a"
    base = ["generate", "tiny-qwen3-cpu", "--agents", "cli:codex", "--max-cost", "1", "--out", str(out)]
    result = runner.invoke(app, base)
    assert result.exit_code == 2 and "Codex reports no cost" in result.output and not out.exists()
    result = runner.invoke(app, [*base, "--model", "codex-unknown-model"])
    assert result.exit_code == 2 and "no price known for model 'codex-unknown-model'" in result.output
    assert not out.exists()


def test_a_codex_cost_budget_set_on_resume_needs_a_priced_model_too(tmp_path, monkeypatch):
    """A Codex run started without --max-cost and resumed with one was let through unpriced (the check on
    resume asked only the LLM backends): every call then counted $0 and the budget never stopped it."""
    from orchestrator.history import History
    from orchestrator.state import new_state
    from tests.review_run import run_config

    _fake(tmp_path, monkeypatch, "codex", "success")
    run = tmp_path / "run"
    History.create(run, "vibetrain run: test")
    new_state(run_config(agents="cli:codex")).save(run)
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--resume", "--out", str(run), "--max-cost", "1"])
    assert result.exit_code == 2 and "Codex reports no cost" in result.output, result.output


# -- the LLM review of a CLI round -----------------------------------------------------------------


class PassingGate:
    """The deterministic gate, passing: the review decides."""

    def judge(self, workspace, out, task=None, seed=0, context=None) -> Verdict:
        return Verdict([CheckResult("integrity", True)])


@pytest.mark.parametrize("scenario, passed", [("reject", False), ("success", True)])
def test_the_llm_review_of_a_cli_round_asks_the_cli_read_only(tmp_path, monkeypatch, workspace, scenario, passed):
    record = _fake(tmp_path, monkeypatch, "claude", scenario)
    params = workspace / "stack/params.json"
    params.write_text(params.read_text().replace('"colocate"', '"static_split"'))
    accounting = Accounting()
    judge = LLMJudge(PassingGate(), CLIChatClient(cli_tool("claude"), accounting), file_access=False)
    verdict = judge.judge(workspace, tmp_path / "out", TASK)
    assert verdict.passed is passed and [c.name for c in verdict.checks] == ["integrity", "llm_review"]
    if not passed:
        assert verdict.reasons == ["llm_review: stack/params.json: sleeps less when the trace is on"]
        assert verdict.checks[-1] == CheckResult(
            "llm_review", False, ["stack/params.json: sleeps less when the trace is on"]
        )
    [call] = _calls(record)
    assert "ROLE: judge" in call["stdin"] and '+  "controller": "static_split"' in call["stdin"]
    assert call["cwd"] != str(workspace) and _option(call["argv"], "--allowedTools") == "Read,Glob,Grep"
    assert {"Bash", "Edit", "Write"} <= set(_option(call["argv"], "--disallowedTools").split(","))
    assert accounting.snapshot() == {"calls": 1, "input_tokens": 900, "output_tokens": 40, "cost_usd": 0.002}


def test_a_cli_review_that_runs_out_of_turns_rejects_never_falls_back_to_the_gate(tmp_path, monkeypatch, workspace):
    """A candidate can be built to keep its reviewer busy: running out of turns is no outage."""
    _fake(tmp_path, monkeypatch, "claude", "max_turns")
    judge = LLMJudge(PassingGate(), CLIChatClient(cli_tool("claude"), Accounting()), file_access=False)
    verdict = judge.judge(workspace, tmp_path / "out", TASK)
    assert not verdict.passed and verdict.reasons == [
        "llm_review: reached no verdict: StuckError: the claude CLI stopped with error_max_turns after 41 turns"
    ]


def test_a_cli_review_refused_for_its_prompt_rejects_never_falls_back_to_the_gate(tmp_path, monkeypatch, workspace):
    """A red team's ignored files, each listed in the review's prompt, pushed it past Claude's window: the
    API clients' refusal rejects, the CLI's was an outage that left the candidate to the gate alone."""
    _fake(tmp_path, monkeypatch, "claude", "too_long")
    judge = LLMJudge(PassingGate(), CLIChatClient(cli_tool("claude"), Accounting()), file_access=False)
    verdict = judge.judge(workspace, tmp_path / "out", TASK)
    assert not verdict.passed and "Prompt is too long" in verdict.reasons[0], verdict.reasons


def test_the_cli_review_client_takes_no_tools(tmp_path, monkeypatch):
    _fake(tmp_path, monkeypatch, "codex", "success")
    client = CLIChatClient(cli_tool("codex"), Accounting())
    with pytest.raises(ValueError, match="answers in text only; it was given tools: read_file"):
        client.chat("ROLE: judge", [{"role": "user", "content": "x"}], [ToolSpec("read_file", "", {})])


# -- a whole round ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_coding_agent_cli_implements_a_round(tmp_path, fast_target, monkeypatch):
    record = _fake(tmp_path, monkeypatch, "claude", "success")
    run = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "generate",
            str(fast_target),
            "--agents",
            "cli:claude",
            "--rounds",
            "1",
            "--simulate",
            "--repeat",
            "1",
            "--held-out",
            "0",
            "--out",
            str(run),
            "--workspaces",
            str(tmp_path / "ws"),
            "--sandbox",  # its candidates start warm; the agent's own sandbox is its CLI's (tested above)
            "subprocess",
        ],
        env={"COLUMNS": "140"},
    )
    assert result.exit_code == 0, result.output
    state = RunState.load(run)
    # the implementer's $0.0123 and the review's $0.002
    assert state.record(1).verdict == "accepted" and state.record(1).llm["cost_usd"] == pytest.approx(0.0143)
    assert (
        json.loads(git.Repo(run).git.show(f"{state.record(1).commit}:stack/params.json"))["controller"]
        == "static_split"
    )
    # round 0's starter is reviewed too; round 1 is implemented, then reviewed
    assert ["ROLE: implementer" in c["stdin"] for c in _calls(record)] == [False, True, False]
