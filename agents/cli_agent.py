"""The ``cli`` backend: an installed coding-agent CLI — Claude Code (``claude -p``) or Codex (``codex
exec``) — as the implementer, and the same CLI, read-only, as the client of the LLM review on top of the
deterministic judge. The planner and the evaluator stay offline.

How the CLI is run, and why:

* the prompt goes on **stdin**, never on the command line: argv is visible to every user in ``ps`` and
  capped (128 KiB per argument on Linux) while DESIGN.md grows;
* the CLI gets an **allowlisted environment** (``CLITool.environment``): the basics a program needs, the few
  variables the judge's checks read, the provider key of that CLI, and its own config directory —
  nothing else from ours is passed to a process that runs model-written commands. It runs as the user,
  not in the sandbox (it needs its provider's network): what the user can read, it can read too (their
  files, and ``/proc/<pid>/environ`` of their processes, vibetrain's and its shell's among them), so run
  a CLI backend where that is acceptable, or run vibetrain in a container holding only that CLI's key;
* it reads **no configuration of the user's** (``CLITool.private_home``): Claude Code is told to read no
  settings file; Codex, which has no such flag, gets a scratch ``CODEX_HOME`` holding only a copy of the
  user's login (``auth.json``), so the user's ``config.toml`` (its MCP servers, ``notify`` program,
  provider, shell-environment policy, trusted projects) shapes no call; a login the CLI refreshed is
  copied back;
* it runs under **a reaper** (``agents/reaper.py``, the CLI's subreaper): when the CLI exits, or a timeout
  stops it (SIGTERM, then SIGKILL after a grace), every process it started is killed, even one that left
  its process group with ``setsid``. Nothing it launched lives on to write into the workspace after the
  harness copied it, to load the machine while the judge measures, or to hold the CLI's stdout open;
* its output is parsed per the CLI's documented schema (``parse_claude``, ``parse_codex``), its usage
  and cost go to the run's ``Accounting``, and a failure it reports becomes an ``AgentError`` whose
  message is the next attempt's feedback.

Claude Code runs with ``--max-turns`` and ``--max-budget-usd`` (the run's remaining ``--max-cost``, at
most ``MAX_ATTEMPT_USD`` per call) and may use only the tools listed in ``ClaudeCode.EDIT_TOOLS``: read,
search and edit files, and run exactly the check command it is told (``check_command``). Codex has no
turn or cost flag: its budget is checked before each call, the timeout bounds it, and its sandbox
(``--sandbox workspace-write``) confines what its commands may write to the workspace.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import skills as skills_package
import targets.api
from agents.cli_tools import MAX_ATTEMPT_USD, CLIResult, CLITool, run_cli
from agents.llm.accounting import Accounting
from agents.llm.agents import ImplementerOutput, expand_annotations, implementer_prompt
from agents.llm.client import CONTENT_REFUSAL, AssistantTurn, ToolSpec
from agents.llm.errors import LLMRefused
from agents.llm.loop import StuckError, parse_answer
from agents.roles import AgentError, Attempt, Hint, Task

log = logging.getLogger("vibetrain.cli_agent")


def account(accounting: Accounting, tool: CLITool, result: CLIResult, model: str | None) -> None:
    """Record one call's tokens and cost. A CLI that reports no cost (Codex) is priced from the price
    table when the model is known (--model; cached input tokens at the full input price, so the figure
    errs high); without a model its tokens are recorded at $0, with a warning. A call that reported no
    usage at all (a failed Codex turn) counts nothing, said each time."""
    if not result.usage_reported:
        log.warning(
            "the %s call reported no token usage (%s): what it spent is not known and counts nothing",
            tool.name,
            result.failure or "no usage in its output",
        )
    if result.cost_usd is not None:
        accounting.add_reported(result.input_tokens, result.output_tokens, result.cost_usd)
    elif model:
        accounting.add(model, result.input_tokens, result.output_tokens)
    else:
        log.warning(
            "the %s CLI reports no cost and no --model names its model: its tokens count $0 (give --model to "
            "price them)",
            tool.name,
        )
        accounting.add_reported(result.input_tokens, result.output_tokens, 0.0)


def run_counted(
    accounting: Accounting, tool: CLITool, argv: list[str], prompt: str, *, cap_usd: float, model: str | None, **run
) -> CLIResult:
    """One CLI call (``run_cli``), counted. A call that ended with no report to read (past its time, its
    output unreadable) spent what nobody knows: it counts as its cap where the CLI has one (Claude's
    ``--max-budget-usd``, ``cap_usd``), else as nothing; either way it is said."""
    try:
        result = run_cli(tool, argv, prompt, **run)
    except AgentError:
        if tool.CAPS_COST:
            log.warning(
                "the %s call ended without reporting its spend: it counts at its cap, $%.4f", tool.name, cap_usd
            )
        else:
            log.warning("the %s call ended without reporting its spend, and it has no cap: it counts $0", tool.name)
        accounting.add_reported(0, 0, cap_usd if tool.CAPS_COST else 0.0)
        raise
    account(accounting, tool, result, model)
    return result


def budget_usd(accounting: Accounting, cap: float) -> float:
    """What one call may spend: the run's remaining ``--max-cost``, at most ``cap``."""
    if accounting.max_cost is None:
        return cap
    return max(min(accounting.max_cost - accounting.run_cost(), cap), 0.0)


def vibetrain_executable() -> str:
    """The ``vibetrain`` command installed beside this Python (so the checks run this very install),
    else the one on PATH."""
    beside = Path(sys.executable).with_name("vibetrain")
    exe = str(beside) if beside.exists() else shutil.which("vibetrain")
    if exe is None:
        raise AgentError(
            f"no `vibetrain` command beside {sys.executable} or on PATH: the coding-agent CLI could not run the "
            "checks (install vibetrain with pip into this environment)"
        )
    return exe


def check_command(exe: str, session, workspace: Path) -> str:
    """The exact shell command that runs the judge's checks on ``workspace`` as this run runs them: the
    same target, sandbox, time limit and execution mode."""
    target = session.target
    parts = [exe, "check", target.ref, "--stack", str(workspace), "--sandbox", session.sandbox.backend]
    parts += ["--time-limit", f"{session.limits.time_s:g}"] + (["--simulate"] if target.simulated else [])
    return shlex.join(parts)


def cli_instructions(tool: CLITool, check: str, time_s: float) -> str:
    """What the implementer prompt adds for a CLI: the prompt names the tool-loop driver's tools, so
    this says what stands for each (the CLI's own tools, the exact check command, a final JSON message
    instead of ``finish``)."""
    api, skills = Path(targets.api.__file__), Path(skills_package.__file__).parent
    return (
        "\n## You are running as a coding-agent CLI\n"
        "The tools named above belong to another driver; here they are:\n"
        "- read_file, search_files, read_skill: your own read and search tools. The contract is "
        f"{api}; a skill is {skills}/<name>/SKILL.md, its recipe {skills}/recipes/<name>.py (all read-only).\n"
        "- edits: your own edit tools, in `stack/` and `DESIGN.md` only.\n"
        "- run_checks: this command, exactly as written:\n\n"
        f"      {check}\n\n"
        f"  {tool.SHELL_RULE} It prints each check with pass or FAIL and its reasons, then PASS or FAIL (exit "
        f"status 1 on FAIL). Each run it makes may take up to {time_s:g} s, so give the command a timeout of at "
        f"least {int(3 * time_s)} s. `# VAL:` annotations are expanded after you finish, so until then the "
        "checks report them as unexpanded; keep them well-formed.\n"
        "- run_benchmark: not available.\n"
        "- finish: instead of calling it, end with a final message that is only this JSON object, nothing "
        'around it: {"summary": "<what you changed and why>", "files_changed": ["stack/..."]}\n'
    )


class CLIImplementer:
    """The implementer: one CLI call per attempt in the workspace. Round 0's starter comes from the
    offline implementer (the library writes it)."""

    def __init__(
        self,
        session,
        tool: CLITool,
        accounting: Accounting,
        offline,
        *,
        model: str | None = None,
        max_turns: int = 40,
        max_attempt_usd: float = MAX_ATTEMPT_USD,
        timeout_s: float = 1800.0,
    ) -> None:
        self.exe = tool.executable()
        self.vibetrain = vibetrain_executable()  # refused now, not mid-run, when missing
        self.session, self.tool, self.accounting, self.offline = session, tool, accounting, offline
        self.model, self.max_turns, self.max_attempt_usd, self.timeout_s = model, max_turns, max_attempt_usd, timeout_s

    def implement(
        self, task: Task, workspace: Path, feedback: list[str], hints: list[Hint] = (), context=None
    ) -> Attempt:
        if task.source == "starter":  # the library writes starters
            return self.offline.implement(task, workspace, feedback)
        self.accounting.check_budget()
        check = check_command(self.vibetrain, self.session, workspace)
        budget = budget_usd(self.accounting, self.max_attempt_usd)
        spec = self.session.target.spec
        prompt = implementer_prompt(
            spec, task, workspace, feedback, hints, context, self.tool.budget_text(self.max_turns, budget)
        )
        prompt += cli_instructions(self.tool, check, self.session.limits.time_s)
        argv = self.tool.edit_argv(self.exe, model=self.model, max_turns=self.max_turns, budget_usd=budget, check=check)
        # Claude Code's Bash tool stops a command after 2 minutes unless told otherwise; the checks
        # take longer, and may take as long as the whole call.
        timeout_ms = str(int(self.timeout_s * 1000))
        env = self.tool.environment({"BASH_DEFAULT_TIMEOUT_MS": timeout_ms, "BASH_MAX_TIMEOUT_MS": timeout_ms})
        result = run_counted(
            self.accounting,
            self.tool,
            argv,
            prompt,
            cap_usd=budget,
            model=self.model,
            cwd=workspace,
            env=env,
            timeout_s=self.timeout_s,
        )
        if result.failure:
            raise AgentError(result.failure)
        attempt = self._attempt(result.text)
        problems = expand_annotations(workspace)
        if problems:
            raise AgentError(
                f"the {self.tool.name} CLI left a validation annotation that cannot be expanded: {'; '.join(problems)}"
            )
        return attempt

    def _attempt(self, text: str) -> Attempt:
        """The CLI's final message: the JSON summary the prompt asks for, or, when it answered in prose,
        that prose as the summary (the change is in the workspace either way; the judge decides)."""
        if not text.strip():
            raise AgentError(f"the {self.tool.name} CLI finished without a final message")
        try:  # its last JSON object: braces in the prose before it do not matter
            output = parse_answer(text, ImplementerOutput)
        except ValueError:  # no JSON object, or none of the summary's shape (a ValidationError): the prose is it
            return Attempt(text.strip()[:2000])
        return Attempt(output.summary, output.files_changed)


class CLIChatClient:
    """A ``ChatClient`` that asks the CLI, read-only, for a text answer: the LLM review of CLI rounds
    (``LLMJudge(gate, CLIChatClient(...), file_access=False)``). Each ``chat`` is one CLI call whose
    prompt (on stdin) is the system text and the conversation so far; the whole question, the diff
    included, is in it, so the CLI runs in an empty scratch directory with no tool that edits or runs
    anything. No tools: the review answers in text."""

    def __init__(
        self,
        tool: CLITool,
        accounting: Accounting,
        *,
        model: str | None = None,
        max_call_usd: float = 1.0,
        timeout_s: float = 600.0,
    ) -> None:
        self.exe = tool.executable()
        self.tool, self.accounting, self.model = tool, accounting, model
        self.max_call_usd, self.timeout_s = max_call_usd, timeout_s

    def chat(self, system: str, messages: list[dict], tools: list[ToolSpec]) -> AssistantTurn:
        if tools:
            raise ValueError(
                f"the {self.tool.name} CLI review client answers in text only; it was given tools: "
                f"{', '.join(t.name for t in tools)}"
            )
        self.accounting.check_budget()
        budget = budget_usd(self.accounting, self.max_call_usd)
        argv = self.tool.review_argv(self.exe, model=self.model, budget_usd=budget)
        with tempfile.TemporaryDirectory(prefix="vibetrain-review-") as scratch, _refusals():
            result = run_counted(
                self.accounting,
                self.tool,
                argv,
                conversation(system, messages),
                cap_usd=budget,
                model=self.model,
                cwd=Path(scratch),
                env=self.tool.environment(),
                timeout_s=self.timeout_s,
            )
        if result.failure:  # out of turns or budget: the judge rejects (a candidate can derail its reviewer)
            with _refusals():
                raise (StuckError if result.derailed else AgentError)(result.failure)
        return AssistantTurn(result.text, [], result.input_tokens, result.output_tokens)


@contextlib.contextmanager
def _refusals():
    """A CLI failure that says the prompt's content was the reason (past the window, flagged) raised as the API
    clients raise it, ``LLMRefused``, which the review rejects: a red team's ignored files, listed in the
    prompt, pushed a review past Claude's window, and the outage left the candidate to the gate alone."""
    try:
        yield
    except AgentError as error:
        if not isinstance(error, StuckError) and CONTENT_REFUSAL.search(str(error)):
            raise LLMRefused(str(error)) from None
        raise


def conversation(system: str, messages: list[dict]) -> str:
    """One prompt from a system text and a conversation of user and assistant turns (a CLI call is
    stateless, so a repair request carries the earlier answer with it)."""
    if len(messages) == 1 and messages[0].get("role") == "user":
        return f"{system}\n\n{messages[0]['content']}\n"
    parts = [system, "\n## The conversation so far"]
    for message in messages:
        role = message.get("role")
        if role == "user":
            parts.append(f"\n### User\n{message['content']}")
        elif role == "assistant":
            parts.append(f"\n### You answered\n{message.get('text') or ''}")
        else:
            raise ValueError(f"a CLI review conversation has user and assistant turns only, got role {role!r}")
    parts.append("\nAnswer the last user message.")
    return "\n".join(parts) + "\n"
