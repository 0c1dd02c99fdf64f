"""The ``cli`` backend's implementer: an installed coding-agent CLI driven non-interactively in the
workspace — Claude Code (``claude -p ... --output-format json``) or Codex (``codex exec --json``) — with
the implementer prompt, its JSON output parsed for the summary and the usage it reports. The other
roles are the offline ones (the deterministic gate and benchmark)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from agents.llm.agents import implementer_prompt
from agents.roles import AgentError, Attempt, Task
from skills.validation import expand_file
from targets.spec import TargetSpec

COMMANDS = {
    "claude": lambda prompt: ["claude", "-p", prompt, "--output-format", "json", "--permission-mode", "acceptEdits"],
    "codex": lambda prompt: ["codex", "exec", "--json", "--full-auto", prompt],
}


class CLIImplementer:
    def __init__(self, spec: TargetSpec, tool: str, accounting, offline, timeout_s: float = 1800.0) -> None:
        """``offline``: the offline implementer, which writes round 0's starter from the library."""
        if tool not in COMMANDS:
            raise AgentError(f"unknown coding-agent CLI {tool!r}; known: {', '.join(COMMANDS)}")
        if shutil.which(tool) is None:
            raise AgentError(
                f"the {tool} CLI is not installed (no `{tool}` on PATH); install it, or use --agents "
                "openai/anthropic/offline"
            )
        self.spec, self.tool, self.accounting, self.timeout_s = spec, tool, accounting, timeout_s
        self.offline = offline

    def starter(self, workspace: Path, controller: str) -> Attempt:
        return self.offline.starter(workspace, controller)

    def implement(self, task: Task, workspace: Path, feedback: list[str], hints: list[dict] = ()) -> Attempt:
        prompt = implementer_prompt(self.spec, task, workspace, feedback, hints)
        try:
            result = subprocess.run(
                COMMANDS[self.tool](prompt), cwd=workspace, capture_output=True, text=True, timeout=self.timeout_s
            )
        except subprocess.TimeoutExpired:
            raise AgentError(f"the {self.tool} CLI ran past {self.timeout_s:g}s") from None
        if result.returncode != 0:
            raise AgentError(
                f"the {self.tool} CLI exited with {result.returncode}: {(result.stderr or result.stdout)[-400:]}"
            )
        summary = self._summary(result.stdout)
        for path in sorted((workspace / "stack").rglob("*.py")):
            expand_file(path)
        return Attempt(summary)

    def _summary(self, stdout: str) -> str:
        """The last JSON object (Claude Code prints one; Codex prints a JSON line per event)."""
        events = []
        for line in stdout.strip().splitlines() or [stdout]:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        if not events:
            try:
                events = [json.loads(stdout)]
            except json.JSONDecodeError:
                raise AgentError(f"the {self.tool} CLI printed no JSON: {stdout[-300:]!r}") from None
        final = events[-1]
        usage = final.get("usage") or {}
        self.accounting.add_reported(
            usage.get("input_tokens", 0), usage.get("output_tokens", 0), final.get("total_cost_usd", 0.0)
        )
        if final.get("is_error"):
            raise AgentError(f"the {self.tool} CLI reported an error: {final.get('result', final)!r}")
        text = final.get("result") or final.get("message") or final.get("text") or json.dumps(final)
        return str(text)[:2000]
