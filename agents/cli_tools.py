"""The coding-agent CLIs the ``cli`` backend drives (``agents/cli_agent.py`` says how and why): each
CLI's command line, environment and private configuration (``CLITool``, ``ClaudeCode``, ``Codex``),
the parsing of its documented output (``parse_claude``, ``parse_codex``), and running it under a
reaper so nothing it starts outlives it (``run_cli``)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agents.reaped_run import KILL_GRACE_S, run_reaped
from agents.roles import AgentError
from targets.cache import cache_home

log = logging.getLogger("vibetrain.cli_agent")

MAX_ATTEMPT_USD = 5.0  # Claude Code's --max-budget-usd when the run has no --max-cost (per call)

# What any program needs to start and find its tools and files.
BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "TMPDIR", "USER")
# What the judge's checks read when the CLI runs them (`vibetrain check`): the model cache they load
# the target's model from, the image of the Docker sandbox, and the GPUs a GPU target's checks use. Not
# $VIBETRAIN_SCRATCH: a CLI's own sandbox (Codex's workspace-write) lets its checks write only in the
# workspace and the temporary directory, where their logs then go.
CHECK_ENV = ("VIBETRAIN_CACHE", "VIBETRAIN_DOCKER_IMAGE", "CUDA_VISIBLE_DEVICES")


class CLIOutputError(AgentError):
    """The CLI printed nothing that its output schema describes (no result object, no event)."""


@dataclass
class CLIResult:
    """What one CLI call reported. ``cost_usd`` is None when the CLI reports none (Codex): the caller
    prices the tokens. ``failure`` says why the call did not succeed (None when it did). ``usage_reported``:
    False when the call ended with no usage to read (a failed Codex turn): its tokens are not known."""

    text: str
    input_tokens: int
    output_tokens: int
    cost_usd: float | None
    failure: str | None = None
    derailed: bool = False  # it stopped at its turn or cost limit: content can cause that, an outage cannot
    usage_reported: bool = True


def _json_lines(stdout: str) -> list[dict]:
    """The JSON objects among stdout's lines (a CLI may print a stray non-JSON line; a line that starts
    like JSON and does not parse is a broken stream and says so)."""
    events = []
    for number, line in enumerate(stdout.splitlines(), 1):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise CLIOutputError(
                f"line {number} of the CLI's output is not valid JSON ({error}): {line[:200]!r}"
            ) from None
    return events


def parse_claude(stdout: str) -> CLIResult:
    """Claude Code's ``--output-format json``: one ``{"type": "result"}`` object. ``subtype`` is
    ``success`` or an ``error_*`` (``error_max_turns``, ``error_max_budget_usd``,
    ``error_during_execution``, ...) — an error even where ``is_error`` is false; a failed API call comes
    as ``success`` with ``is_error`` true and the message in ``result``. Input tokens count the cached
    ones too (Anthropic reports ``cache_read_input_tokens`` and ``cache_creation_input_tokens`` apart)."""
    results = [e for e in _json_lines(stdout) if e.get("type") == "result"]
    if not results:
        raise CLIOutputError(f"the claude CLI printed no result object: {stdout[-300:]!r}")
    final = results[-1]
    usage = final.get("usage") or {}
    input_tokens = sum(
        int(usage.get(k) or 0) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    )
    subtype = final.get("subtype", "(none)")
    text = str(final.get("result") or "")
    failure = None
    if subtype != "success":
        details = "; ".join(str(e) for e in final.get("errors") or []) or text
        turns = f" after {final['num_turns']} turns" if "num_turns" in final else ""
        failure = f"the claude CLI stopped with {subtype}{turns}" + (f": {details[:400]}" if details else "")
    elif final.get("is_error"):
        failure = f"the claude CLI reported an error: {text[:400] or '(no message)'}"
    return CLIResult(
        text,
        input_tokens,
        int(usage.get("output_tokens") or 0),
        None if final.get("total_cost_usd") is None else float(final["total_cost_usd"]),  # None: priced by model
        failure,
        derailed=subtype in ("error_max_turns", "error_max_budget_usd"),
    )


def parse_codex(stdout: str) -> CLIResult:
    """Codex's ``exec --json`` events, one per line. The answer is the last ``item.completed`` whose item
    is an ``agent_message``; usage comes with ``turn.completed`` (``input_tokens`` includes
    ``cached_input_tokens``; Codex sends the thread's running total, so the last one counts); a
    ``turn.failed`` is a failure with its ``error.message``. An ``error`` event is failure only when no
    ``turn.completed`` follows it (Codex reports errors it then retries the same way). No cost is
    reported: ``cost_usd`` is None."""
    events = _json_lines(stdout)
    if not events:
        raise CLIOutputError(f"the codex CLI printed no JSON events: {stdout[-300:]!r}")
    text, usage, failure, last_error = "", {}, None, None
    for event in events:
        kind = event.get("type")
        item = event.get("item") or {}
        if kind == "item.completed" and item.get("type") == "agent_message":
            text = str(item.get("text") or "")
        elif kind == "turn.completed":
            usage, last_error = event.get("usage") or {}, None
        elif kind == "turn.failed":
            failure = f"the codex CLI's turn failed: {(event.get('error') or {}).get('message', '(no message)')}"
        elif kind == "error":
            last_error = str(event.get("message") or "(no message)")
    if failure is None and last_error is not None:
        failure = f"the codex CLI reported an error: {last_error}"
    if failure is None and not any(e.get("type") == "turn.completed" for e in events):
        failure = "the codex CLI ended without completing its turn (no turn.completed event)"
    return CLIResult(  # the usage counted is the last turn.completed's: reported only where it had one
        text,
        int(usage.get("input_tokens") or 0),
        int(usage.get("output_tokens") or 0),
        None,
        failure,
        False,
        bool(usage),
    )


class CLITool:
    """One coding-agent CLI: its name, the variables of ours it may see, its command lines, its parser."""

    name: str
    KEYS: tuple[str, ...]  # the provider key(s) the CLI authenticates with, passed when set
    CONFIG: tuple[str, ...]  # the CLI's own configuration variables, passed when set
    SHELL_RULE: str  # what the prompt says about running commands
    CAPS_COST: bool  # whether a call's spend is capped by what it is given (budget_usd)

    def executable(self) -> str:
        """The CLI's path; a missing CLI is refused here, before the run writes anything."""
        found = shutil.which(self.name)
        if found is None:
            raise AgentError(
                f"the {self.name} CLI is not installed (no `{self.name}` on PATH); install it, or use --agents "
                "openai/anthropic/offline"
            )
        return found

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Our environment, allowlisted (see the module docstring), plus ``extra`` (settings we give)."""
        names = BASE_ENV + CHECK_ENV + self.KEYS + self.CONFIG
        kept = {k: os.environ[k] for k in names if k in os.environ}
        if "VIBETRAIN_CACHE" in kept:  # absolute: the CLI runs its checks in the workspace (a relative cache
            kept["VIBETRAIN_CACHE"] = str(cache_home(kept))  # would build models there, into the judged copy)
        return kept | (extra or {})

    @contextmanager
    def private_home(self) -> Iterator[dict[str, str]]:
        """Variables that give one call a configuration home of its own (none: the CLI's flags already
        keep the user's configuration out)."""
        yield {}

    def edit_argv(self, exe: str, *, model: str | None, max_turns: int, budget_usd: float, check: str) -> list[str]:
        raise NotImplementedError

    def budget_text(self, max_turns: int, budget_usd: float) -> str:
        """The limits of one attempt, as the implementer prompt states them."""
        raise NotImplementedError

    def review_argv(self, exe: str, *, model: str | None, budget_usd: float) -> list[str]:
        raise NotImplementedError

    def parse(self, stdout: str) -> CLIResult:
        raise NotImplementedError


class ClaudeCode(CLITool):
    """``claude -p`` (the prompt read from stdin) with ``--output-format json``.

    Tools: ``--allowedTools`` pre-approves what the implementer needs — reading and searching (Read,
    Glob, Grep), editing ``stack/`` and ``DESIGN.md`` (nothing else: the harness and the contract stay
    as they are), and in Bash exactly the check command (an exact rule, not a prefix: a prefix would let
    ``--sandbox subprocess`` be appended and run candidate code unisolated) plus ``git status``, ``git
    diff`` and ``git diff --stat`` to see its own change, each exact too (``git diff --output=PATH``
    writes any file). Under ``-p`` nothing can be approved interactively, so any other edit or command
    is denied; web access is removed outright. No settings file is read (``--setting-sources ""``: a
    user's ``~/.claude/settings.json`` or a ``.claude/settings.json`` in the workspace would merge their
    own allow rules, hooks and MCP servers into these) and no MCP server is started. It authenticates with
    ``ANTHROPIC_API_KEY`` or the login kept in ``CLAUDE_CONFIG_DIR`` (not a setting); an ``apiKeyHelper``
    or an ``env`` block in a settings file is not read. The candidate code itself only ever runs inside
    the check, in the harness's sandbox."""

    name = "claude"
    KEYS = ("ANTHROPIC_API_KEY",)  # used whenever set under -p; without it, the login in CLAUDE_CONFIG_DIR
    CONFIG = ("CLAUDE_CONFIG_DIR",)  # where its settings and login live (default ~/.claude)
    CAPS_COST = True  # --max-budget-usd
    # Edit rules cover every tool that edits files (Edit, MultiEdit, Write); paths are relative to the
    # workspace, the CLI's working directory.
    EDIT_TOOLS = (
        "Read",
        "Glob",
        "Grep",
        "Edit(./stack/**)",
        "Edit(./DESIGN.md)",
        "Bash(git status)",
        "Bash(git diff)",
        "Bash(git diff --stat)",
    )
    READ_TOOLS = ("Read", "Glob", "Grep")
    NO_WEB = ("WebFetch", "WebSearch")
    NO_CHANGE = ("Bash", "Edit", "MultiEdit", "Write", "NotebookEdit") + NO_WEB
    REVIEW_TURNS = 3
    SHELL_RULE = (
        "Shell commands other than this one (run alone: no pipes, no `&&`, nothing appended), `git status`, "
        "`git diff` and `git diff --stat` are not permitted."
    )

    def edit_argv(self, exe: str, *, model: str | None, max_turns: int, budget_usd: float, check: str) -> list[str]:
        allowed = self.EDIT_TOOLS + (f"Bash({check})",)
        return self._argv(exe, model, max_turns, budget_usd, allowed, self.NO_WEB)

    def budget_text(self, max_turns: int, budget_usd: float) -> str:
        return f"{max_turns} turns and ${budget_usd:.2f} for this attempt"

    def review_argv(self, exe: str, *, model: str | None, budget_usd: float) -> list[str]:
        return self._argv(exe, model, self.REVIEW_TURNS, budget_usd, self.READ_TOOLS, self.NO_CHANGE)

    @staticmethod
    def _argv(exe: str, model: str | None, max_turns: int, budget_usd: float, allowed, denied) -> list[str]:
        """``claude -p`` with its caps and permissions (the prompt goes on stdin)."""
        argv = [exe, "-p", "--output-format", "json", "--max-turns", str(max_turns)]
        argv += ["--max-budget-usd", f"{budget_usd:.4f}"]
        argv += ["--allowedTools", ",".join(allowed), "--disallowedTools", ",".join(denied)]
        argv += ["--setting-sources", "", "--strict-mcp-config", "--mcp-config", '{"mcpServers": {}}']
        return argv + (["--model", model] if model else [])

    def parse(self, stdout: str) -> CLIResult:
        return parse_claude(stdout)


class Codex(CLITool):
    """``codex exec --json -`` (``-``: the prompt is read from stdin). The implementer runs with
    ``--sandbox workspace-write`` (its commands may write only in the workspace and temp), the review
    with ``--sandbox read-only`` in a scratch directory that is no git repository (hence
    ``--skip-git-repo-check``). ``codex exec`` has no turn or cost limit to give it: ``max_turns`` and
    ``budget_usd`` are not passed (the budget is checked before each call; the timeout bounds it)."""

    name = "codex"
    KEYS = ("CODEX_API_KEY", "OPENAI_API_KEY")  # exec's own key variable; the OpenAI provider's key
    CONFIG = ()  # CODEX_HOME is a scratch one per call (private_home), never the user's
    CAPS_COST = False  # codex exec takes no cost limit
    LOGIN = "auth.json"  # the login `codex login` keeps in CODEX_HOME
    SHELL_RULE = "Your commands may write only inside the workspace."

    @contextmanager
    def private_home(self) -> Iterator[dict[str, str]]:
        """A scratch ``CODEX_HOME`` with a copy of the user's login and nothing else: ``codex exec`` has no
        flag that skips ``config.toml``, whose MCP servers, ``notify`` program, provider or trusted projects
        would otherwise shape the call. If the CLI refreshed the login, the fresh one is copied back (a
        rotated refresh token would otherwise leave the user's copy dead), but only a login of the same
        account. The scratch home is made under vibetrain's cache, not the temp folder, which the CLI's
        ``workspace-write`` commands may write: there an agent's command could leave its own login for the
        copy back to keep in the user's home."""
        user_home = Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")
        homes = cache_home() / "codex-homes"
        homes.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="home-", dir=homes) as scratch:
            login, copy = user_home / self.LOGIN, Path(scratch) / self.LOGIN
            if login.is_file():
                shutil.copyfile(login, copy)
                copy.chmod(0o600)
            before = copy.read_bytes() if copy.is_file() else None
            yield {"CODEX_HOME": scratch}
            after = copy.read_bytes() if copy.is_file() and not copy.is_symlink() else None
            if before is not None and after is not None and after != before:
                account = _codex_account(after)
                if account is None or account != _codex_account(before):
                    log.warning("the codex CLI left a login of another account (or none) in its home: not kept")
                    return
                fresh = login.with_name(f".{self.LOGIN}.vibetrain")
                fresh.write_bytes(after)
                fresh.chmod(0o600)
                fresh.replace(login)

    def edit_argv(self, exe: str, *, model: str | None, max_turns: int, budget_usd: float, check: str) -> list[str]:
        return [exe, "exec", "--json", "--sandbox", "workspace-write"] + (["--model", model] if model else []) + ["-"]

    def budget_text(self, max_turns: int, budget_usd: float) -> str:
        return "no turn or cost limit within the attempt: finish as soon as the checks pass"

    def review_argv(self, exe: str, *, model: str | None, budget_usd: float) -> list[str]:
        model_args = ["--model", model] if model else []
        return [exe, "exec", "--json", "--sandbox", "read-only", "--skip-git-repo-check"] + model_args + ["-"]

    def parse(self, stdout: str) -> CLIResult:
        return parse_codex(stdout)


def _codex_account(login: bytes) -> str | None:
    """The account a Codex login belongs to (``tokens.account_id``; an API-key login: its key), None when
    the file is no login."""
    try:
        data = json.loads(login)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    tokens = data.get("tokens")
    account = tokens.get("account_id") if isinstance(tokens, dict) else None
    return str(account or data.get("OPENAI_API_KEY") or "") or None


TOOLS: dict[str, CLITool] = {"claude": ClaudeCode(), "codex": Codex()}


def cli_tool(name: str) -> CLITool:
    if name not in TOOLS:
        raise AgentError(f"unknown coding-agent CLI {name!r}; known: {', '.join(TOOLS)}")
    return TOOLS[name]


def run_cli(
    tool: CLITool,
    argv: list[str],
    prompt: str,
    *,
    cwd: Path,
    env: dict,
    timeout_s: float,
    grace_s: float = KILL_GRACE_S,
) -> CLIResult:
    """Run one CLI call: ``prompt`` on stdin, under the reaper, its output parsed. Whatever it started and
    left running is killed when it ends (so nothing holds its pipes open); past ``timeout_s`` it gets
    SIGTERM and ``grace_s`` to end, then it and everything it started are killed, and the call raises."""
    with tool.private_home() as home:
        return _run_reaped(tool, argv, prompt, cwd=cwd, env=env | home, timeout_s=timeout_s, grace_s=grace_s)


def _run_reaped(
    tool: CLITool, argv: list[str], prompt: str, *, cwd: Path, env: dict, timeout_s: float, grace_s: float
) -> CLIResult:
    try:
        done = run_reaped(argv, prompt, cwd=cwd, env=env, timeout_s=timeout_s, grace_s=grace_s)
    except subprocess.TimeoutExpired:
        raise AgentError(
            f"the {tool.name} CLI ran past {timeout_s:g}s; it and every process it started were stopped"
        ) from None
    code, stdout, stderr = done.returncode, done.stdout, done.stderr
    try:
        result = tool.parse(stdout)
    except CLIOutputError:
        if code != 0:
            raise AgentError(f"the {tool.name} CLI exited with {code}: {(stderr or stdout)[-400:]}") from None
        raise
    if code != 0 and result.failure is None:
        result.failure = f"the {tool.name} CLI exited with {code}: {(stderr or stdout)[-400:]}"
    return result
