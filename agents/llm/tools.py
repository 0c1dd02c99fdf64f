"""The tools an LLM agent gets: list/read/search files, edit by exact replacement, write a file, run a
command in the sandbox, run the judge's checks, run the benchmark, search and read skills, read
DESIGN.md. Every path stays inside the workspace; every result longer than ``MAX_RESULT`` is cut with
a note that says so. A call naming an unknown tool, or with arguments that do not validate, raises
``ToolCallError``: the attempt ends with that message (and the next attempt is told why)."""

from __future__ import annotations

import difflib
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agents.llm.client import ToolCall, ToolSpec
from agents.roles import AgentError
from skills.library import load_skills, search_skills

MAX_RESULT = 12_000


class ToolCallError(AgentError):
    """The model called a tool that does not exist, or with arguments that do not validate."""


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ListFiles(_Args):
    path: str = Field(default=".", description="directory, relative to the workspace")


class ReadFile(_Args):
    path: str
    offset: int = Field(default=0, ge=0, description="first character to return")
    limit: int = Field(default=MAX_RESULT - 2000, gt=0, le=MAX_RESULT - 2000)


class SearchFiles(_Args):
    pattern: str = Field(description="a Python regular expression")
    path: str = "."


class EditFile(_Args):
    path: str
    old: str = Field(description="text that occurs exactly once in the file")
    new: str


class WriteFile(_Args):
    path: str
    content: str


class RunCommand(_Args):
    command: str = Field(description="a bash command, run in the workspace inside the sandbox")
    timeout_s: float = Field(default=120, gt=0, le=900)


class NoArgs(_Args):
    pass


class SearchSkills(_Args):
    query: str


class ReadSkill(_Args):
    name: str


def truncated(text: str, limit: int = MAX_RESULT) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... truncated: {len(text) - limit} more characters not shown; narrow the request]"


class Toolbox:
    """The tools of one role in one workspace. ``checks`` and ``benchmark`` are the judge's gate and
    the evaluator's benchmark, given by the backend (None: the role does not get that tool)."""

    def __init__(
        self,
        workspace: Path,
        sandbox,
        checks: Callable[[], str] | None = None,
        benchmark: Callable[[], str] | None = None,
        writable: bool = True,
    ) -> None:
        self.workspace, self.sandbox, self.checks, self.benchmark = workspace.resolve(), sandbox, checks, benchmark
        self.tools: dict[str, tuple[type[_Args], Callable, str]] = {
            "list_files": (ListFiles, self.list_files, "List files under a directory of the workspace."),
            "read_file": (ReadFile, self.read_file, "Read a file of the workspace (a window of it: offset, limit)."),
            "search_files": (
                SearchFiles,
                self.search_files,
                "Lines matching a regular expression, as file:line: text.",
            ),
            "search_skills": (
                SearchSkills,
                self.search_skills_tool,
                "Skills of the library whose text mentions every word.",
            ),
            "read_skill": (
                ReadSkill,
                self.read_skill,
                "A skill's SKILL.md: what it does, when it helps, parameters, evidence.",
            ),
            "read_design": (NoArgs, self.read_design, "The stack's DESIGN.md: decisions, plan, findings."),
        }
        if writable:
            self.tools |= {
                "edit_file": (EditFile, self.edit_file, "Replace text that occurs exactly once in a file."),
                "write_file": (WriteFile, self.write_file, "Create or overwrite a file of the workspace."),
                "run_command": (
                    RunCommand,
                    self.run_command,
                    "Run a bash command in the workspace, inside the sandbox.",
                ),
            }
        if checks is not None:
            self.tools["run_checks"] = (
                NoArgs,
                lambda _: self.checks(),
                "Run the judge's deterministic checks on the workspace now.",
            )
        if benchmark is not None:
            self.tools["run_benchmark"] = (
                NoArgs,
                lambda _: self.benchmark(),
                "Benchmark the workspace's stack (one run).",
            )

    def specs(self) -> list[ToolSpec]:
        return [ToolSpec(name, doc, model.model_json_schema()) for name, (model, _, doc) in self.tools.items()]

    def call(self, call: ToolCall) -> str:
        if call.name not in self.tools:
            raise ToolCallError(f"the model called an unknown tool {call.name!r}; available: {', '.join(self.tools)}")
        model, handler, _ = self.tools[call.name]
        try:
            raw = json.loads(call.arguments or "{}")
            arguments = model.model_validate(raw)
        except (json.JSONDecodeError, ValidationError) as error:
            raise ToolCallError(
                f"the model called {call.name} with invalid arguments ({call.arguments[:200]!r}): {error}"
            ) from None
        try:
            return truncated(handler(arguments))
        except ToolResultError as error:  # the tool ran and says what went wrong: the model reads it
            return f"error: {error}"

    # -- paths -----------------------------------------------------------------------------------
    def _path(self, relative: str) -> Path:
        path = (self.workspace / relative).resolve()
        if path != self.workspace and self.workspace not in path.parents:
            raise ToolResultError(f"{relative!r} is outside the workspace")
        if ".git" in path.relative_to(self.workspace).parts:
            raise ToolResultError(f"{relative!r} is git's, not the candidate's")
        return path

    # -- the tools -------------------------------------------------------------------------------
    def list_files(self, a: ListFiles) -> str:
        root = self._path(a.path)
        if not root.is_dir():
            raise ToolResultError(f"{a.path!r} is not a directory")
        files = sorted(
            str(p.relative_to(self.workspace))
            for p in root.rglob("*")
            if p.is_file() and ".git" not in p.parts and "__pycache__" not in p.parts
        )
        return "\n".join(files) or "(empty)"

    def read_file(self, a: ReadFile) -> str:
        path = self._path(a.path)
        if not path.is_file():
            raise ToolResultError(f"no file {a.path!r} (list_files shows what exists)")
        text = path.read_text()
        window = text[a.offset : a.offset + a.limit]
        more = len(text) - a.offset - len(window)
        return window + (
            f"\n[... {more} more characters: read again with offset={a.offset + len(window)}]" if more > 0 else ""
        )

    def search_files(self, a: SearchFiles) -> str:
        try:
            regex = re.compile(a.pattern)
        except re.error as error:
            raise ToolResultError(f"bad regular expression {a.pattern!r}: {error}") from None
        hits = []
        for path in sorted(self._path(a.path).rglob("*")):
            if not path.is_file() or ".git" in path.parts or "__pycache__" in path.parts:
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if regex.search(line):
                    hits.append(f"{path.relative_to(self.workspace)}:{number}: {line.strip()}")
        return (
            "\n".join(hits[:200]) + (f"\n[... {len(hits) - 200} more matches]" if len(hits) > 200 else "")
            if hits
            else "(no match)"
        )

    def edit_file(self, a: EditFile) -> str:
        path = self._path(a.path)
        if not path.is_file():
            raise ToolResultError(f"no file {a.path!r} to edit (write_file creates one)")
        text = path.read_text()
        count = text.count(a.old)
        if count == 0:
            lines = text.splitlines()
            first = a.old.strip().splitlines()[0] if a.old.strip() else ""
            close = difflib.get_close_matches(first, lines, n=1, cutoff=0.5)
            hint = f"; the closest line is {lines.index(close[0]) + 1}: {close[0].strip()!r}" if close else ""
            raise ToolResultError(
                f"the old text is not in {a.path} (whitespace and indentation must match exactly){hint}"
            )
        if count > 1:
            starts = [text[: m.start()].count("\n") + 1 for m in re.finditer(re.escape(a.old), text)]
            raise ToolResultError(
                f"the old text occurs {count} times in {a.path} (lines {starts[:10]}); include more context to pick one"
            )
        path.write_text(text.replace(a.old, a.new, 1))
        return f"edited {a.path}"

    def write_file(self, a: WriteFile) -> str:
        path = self._path(a.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(a.content)
        return f"wrote {a.path} ({len(a.content)} characters)"

    def run_command(self, a: RunCommand) -> str:
        out = self.workspace / ".vibetrain-tmp"
        out.mkdir(exist_ok=True)
        command, env = self.sandbox.wrap(
            ["bash", "-c", a.command], {}, writable=[self.workspace, out], cwd=self.workspace
        )
        try:
            result = subprocess.run(
                command, env=env or None, cwd=self.workspace, capture_output=True, text=True, timeout=a.timeout_s
            )
        except subprocess.TimeoutExpired:
            raise ToolResultError(f"the command ran past {a.timeout_s:g}s and was killed") from None
        finally:
            shutil.rmtree(out, ignore_errors=True)
        return f"exit code {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"

    def search_skills_tool(self, a: SearchSkills) -> str:
        found = search_skills(a.query)
        return (
            "\n".join(
                f"{s.name} ({s.kind}, recipe {s.recipe}): triggers {s.triggers}, params {list(s.params)}" for s in found
            )
            or "(no skill)"
        )

    def read_skill(self, a: ReadSkill) -> str:
        skills = load_skills()
        if a.name not in skills:
            raise ToolResultError(f"no skill {a.name!r}; known: {', '.join(skills)}")
        return skills[a.name].path.read_text()

    def read_design(self, _: NoArgs) -> str:
        path = self.workspace / "DESIGN.md"
        return path.read_text() if path.exists() else "(this stack has no DESIGN.md yet)"


class ToolResultError(RuntimeError):
    """A tool that ran and failed in a way the model can act on (the message is returned to it)."""
