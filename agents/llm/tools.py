"""The tools an LLM agent gets: list/read (by line range, numbered)/search files, edit by exact
replacement, write a file, run a command in the sandbox, run the judge's checks, run the benchmark,
search and read skills, read DESIGN.md.

Reads stay inside the workspace, plus the contract, read-only: ``targets/api.py`` and the library's
recipes (``skills/recipes/*.py``), under the paths a candidate imports them by. Writes are limited to
``stack/`` and ``DESIGN.md``; an edit answers with the lines around it and whether the file still
compiles. A result longer than ``MAX_RESULT`` keeps its head and its tail (a traceback ends a long
output) with a note of what was cut. A bad call (an unknown tool, arguments that do not validate)
comes back to the model as a tool error: the loop goes on."""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import regex
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import targets
from agents.llm.client import ToolCall, ToolSpec
from agents.reaped_run import CommandLimits, run_reaped
from skills.library import load_skills, search_skills
from targets.harness.isolation.containers import owned_containers
from targets.harness.judge.integrity import MAX_SOURCE_BYTES

MAX_RESULT = 12_000
MAX_DESIGN = 40_000  # DESIGN.md's characters in a prompt: the agent writes it, and every later call carries it
# the judge's reasons in the next attempt's prompt: a controller's exception is the candidate's own text
MAX_FEEDBACK_LINE, MAX_FEEDBACK_LINES = 2_000, 30
MAX_READ_BYTES = 8 << 20  # read_file and search_files read a file on the host: one larger is not read whole
MAX_SEARCH_BYTES = 64 << 20  # what one search reads in all
MAX_MATCHES = 200
SEARCH_LIMIT_S = 10.0  # one search's time: the model's pattern runs in the orchestrator
VIEW_LINES = 250  # lines read_file shows when no end is given
REPO = Path(targets.__file__).resolve().parent.parent
CONTRACT = ("targets/api.py", "skills/recipes")  # read-only, outside the workspace
WRITABLE = ("stack", "DESIGN.md")


def inside(workspace: Path, path: Path) -> bool:
    """Whether ``path`` stays in ``workspace`` once its links are followed: a link the candidate made
    (to /proc/self/environ, to a home folder, to the library's recipes) must not let the host read or
    write outside it. The tools, the prompts and the annotations' expansion run on the host, unsandboxed."""
    resolved, root = path.resolve(), workspace.resolve()
    return resolved == root or root in resolved.parents


def read_design(workspace: Path) -> str | None:
    """The stack's DESIGN.md (None: it has none); a link out of the workspace is refused, not read."""
    path = workspace / "DESIGN.md"
    if not path.exists() and not path.is_symlink():
        return None
    if not inside(workspace, path) or not path.is_file():
        raise ToolResultError("DESIGN.md is a link out of the workspace, or no file: not read; write the file itself")
    return path.read_text()


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ListFiles(_Args):
    path: str = Field(default=".", description="directory, relative to the workspace")


class ReadFile(_Args):
    path: str = Field(
        description="relative to the workspace; the contract reads as targets/api.py, skills/recipes/*.py"
    )
    start_line: int = Field(default=1, ge=1, description="first line to show (1-based)")
    end_line: int | None = Field(default=None, ge=1, description=f"last line to show (default: {VIEW_LINES} lines on)")


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
    """``text`` cut to its head (a third of ``limit``) and tail (the rest): an error ends an output."""
    if len(text) <= limit:
        return text
    head, tail = limit // 3, limit - limit // 3
    return (
        text[:head]
        + f"\n[... {len(text) - limit} characters cut from the middle; narrow the request to see them ...]\n"
        + text[-tail:]
    )


def numbered(lines: list[str], first: int) -> str:
    """Lines with their numbers, as edits and errors cite them."""
    width = len(str(first + len(lines) - 1))
    return "\n".join(f"{number:>{width}}| {line}" for number, line in enumerate(lines, first))


def compile_note(path: Path, relative: str) -> str:
    """Whether a Python file still compiles after a change (empty for other files)."""
    if path.suffix != ".py":
        return ""
    if (size := path.stat().st_size) > MAX_SOURCE_BYTES:  # compiled here it would take ~600 times that in memory
        return f"\nWARNING: {relative} is {size} bytes, over the {MAX_SOURCE_BYTES} the integrity scan reads: refused."
    try:
        compile(path.read_text(), relative, "exec")
    except SyntaxError as error:
        return f"\nWARNING: {relative} no longer compiles: {error.msg} at line {error.lineno}; fix it."
    return f"\n{relative} compiles."


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
        self.limits = CommandLimits.half_the_machine()  # what run_command's command may take besides time
        self.tools: dict[str, tuple[type[_Args], Callable, str]] = {
            "list_files": (ListFiles, self.list_files, "List files under a directory of the workspace."),
            "read_file": (
                ReadFile,
                self.read_file,
                "Lines of a file, numbered (start_line, end_line); the contract too: targets/api.py, skills/recipes/.",
            ),
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
                "edit_file": (
                    EditFile,
                    self.edit_file,
                    "Replace text that occurs exactly once in a file of stack/ or DESIGN.md; answers with the "
                    "lines around the change and whether the file compiles.",
                ),
                "write_file": (WriteFile, self.write_file, "Create or overwrite a file of stack/, or DESIGN.md."),
                "run_command": (
                    RunCommand,
                    self.run_command,
                    "Run a bash command in the workspace, inside the sandbox (no network; git does not work "
                    "there: the round's repository is the harness's, not mounted).",
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
        """The tool's result, or an error the model can act on: a bad call does not end the attempt."""
        if call.name not in self.tools:
            return f"error: there is no tool {call.name!r}; the tools are: {', '.join(self.tools)}"
        model, handler, _ = self.tools[call.name]
        try:
            raw = json.loads(call.arguments or "{}")
            arguments = model.model_validate(raw)
        except (json.JSONDecodeError, ValidationError) as error:
            return f"error: {call.name} was called with invalid arguments ({call.arguments[:200]!r}): {error}"
        try:
            return truncated(handler(arguments))
        except ToolResultError as error:  # the tool ran and says what went wrong: the model reads it
            return f"error: {error}"
        except (OSError, UnicodeError, ValueError, RuntimeError) as error:  # a folder, binary, a NUL, a link loop
            return f"error: {call.name} failed: {type(error).__name__}: {error}"

    # -- paths -----------------------------------------------------------------------------------
    def _path(self, relative: str) -> Path:
        path = (self.workspace / relative).resolve()
        if not inside(self.workspace, path):
            raise ToolResultError(
                f"{relative!r} is outside the workspace (the contract reads as targets/api.py and skills/recipes/)"
            )
        if ".git" in path.relative_to(self.workspace).parts:
            raise ToolResultError(f"{relative!r} is git's, not the candidate's")
        return path

    def _readable(self, relative: str) -> Path:
        """A workspace file, or a contract file (read-only, from the installed vibetrain)."""
        clean = relative.strip().removeprefix("./")
        if clean == CONTRACT[0] or clean.startswith(CONTRACT[1] + "/"):
            path = (REPO / clean).resolve()
            if path == REPO / CONTRACT[0] or REPO / CONTRACT[1] in path.parents:
                return path
        return self._path(relative)

    def _writable(self, relative: str) -> Path:
        path = self._path(relative)
        parts = path.relative_to(self.workspace).parts
        if not parts or parts[0] not in WRITABLE or (parts[0] == "DESIGN.md" and len(parts) > 1):
            raise ToolResultError(f"{relative!r} is not writable: only stack/ and DESIGN.md are the candidate's")
        if path.exists() and not path.is_file():  # a FIFO would hold the write (and the orchestrator) for ever
            raise ToolResultError(f"{relative!r} is there and is no regular file (a folder, a FIFO, a device)")
        return path

    # -- the tools -------------------------------------------------------------------------------
    def list_files(self, a: ListFiles) -> str:
        root = self._path(a.path)
        if not root.is_dir():
            raise ToolResultError(f"{a.path!r} is not a directory")
        files = sorted(
            str(p.relative_to(self.workspace))
            for p in root.rglob("*")
            if inside(self.workspace, p) and p.is_file() and ".git" not in p.parts and "__pycache__" not in p.parts
        )
        return "\n".join(files) or "(empty)"

    def read_file(self, a: ReadFile) -> str:
        path = self._readable(a.path)
        if not path.is_file():
            raise ToolResultError(f"no file {a.path!r} (list_files shows what exists)")
        if (size := path.stat().st_size) > MAX_READ_BYTES:
            raise ToolResultError(
                f"{a.path} is {size} bytes, more than the {MAX_READ_BYTES} read_file reads; "
                "look into it with run_command (head, sed -n, grep)"
            )
        lines = path.read_text(errors="replace").splitlines()
        if not lines:
            return f"{a.path} is empty"
        if a.start_line > len(lines):
            raise ToolResultError(f"{a.path} has {len(lines)} lines; start_line {a.start_line} is past its end")
        end = min(a.end_line or a.start_line + VIEW_LINES - 1, len(lines))
        if end < a.start_line:
            raise ToolResultError(f"end_line {end} is before start_line {a.start_line}")
        view = numbered(lines[a.start_line - 1 : end], a.start_line)
        more = f"; read on with start_line={end + 1}" if end < len(lines) else ""
        return f"{a.path}, lines {a.start_line}-{end} of {len(lines)}{more}\n{view}"

    def search_files(self, a: SearchFiles) -> str:
        """The model's pattern runs in the orchestrator: by the ``regex`` engine, under a time limit (a
        pattern that backtracks without end is stopped), reading each file once (a hundred hard links to
        one file are one) and at most ``MAX_SEARCH_BYTES`` in all, keeping the first 200 matches."""
        try:
            pattern = regex.compile(a.pattern)
        except regex.error as error:
            raise ToolResultError(f"bad regular expression {a.pattern!r}: {error}") from None
        hits, large, seen, read, stopped = [], [], set(), 0, ""
        deadline = time.monotonic() + SEARCH_LIMIT_S
        for path in sorted(self._path(a.path).rglob("*")):
            hidden = ".git" in path.parts or "__pycache__" in path.parts
            if not inside(self.workspace, path) or not path.is_file() or hidden:
                continue
            status = path.stat()
            if (status.st_dev, status.st_ino) in seen:
                continue
            seen.add((status.st_dev, status.st_ino))
            if status.st_size > MAX_READ_BYTES:
                large.append(str(path.relative_to(self.workspace)))
                continue
            read += status.st_size
            if read > MAX_SEARCH_BYTES:
                stopped = f"stopped at {MAX_SEARCH_BYTES} bytes read"
                break
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                try:
                    matched = pattern.search(line, timeout=max(deadline - time.monotonic(), 0.001))
                except TimeoutError:
                    stopped = f"stopped after {SEARCH_LIMIT_S:g} s (a pattern that backtracks?)"
                    break
                if matched:
                    hits.append(f"{path.relative_to(self.workspace)}:{number}: {line.strip()}")
                if len(hits) > MAX_MATCHES:
                    stopped = f"more than {MAX_MATCHES} matches"
                    break
            if stopped:
                break
        found = "\n".join(hits[:MAX_MATCHES]) if hits else "(no match)"
        if stopped:
            found += f"\n[the search {stopped}: narrow the path or the pattern]"
        if large:
            names = ", ".join(large[:20])
            found += f"\n[not searched, over {MAX_READ_BYTES} bytes: {names}; grep them with run_command]"
        return found

    def edit_file(self, a: EditFile) -> str:
        path = self._writable(a.path)
        if not path.is_file():
            raise ToolResultError(f"no file {a.path!r} to edit (write_file creates one)")
        if (size := path.stat().st_size) > MAX_READ_BYTES:
            raise ToolResultError(f"{a.path} is {size} bytes, more than the {MAX_READ_BYTES} edit_file reads")
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
        start = text[: text.index(a.old)].count("\n") + 1
        path.write_text(text.replace(a.old, a.new, 1))
        lines = path.read_text().splitlines()
        first, last = max(start - 3, 1), min(start + a.new.count("\n") + 3, len(lines))
        snippet = numbered(lines[first - 1 : last], first)
        return f"edited {a.path}; lines {first}-{last} now read:\n{snippet}{compile_note(path, a.path)}"

    def write_file(self, a: WriteFile) -> str:
        path = self._writable(a.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(a.content)
        return f"wrote {a.path} ({len(a.content.splitlines())} lines){compile_note(path, a.path)}"

    def run_command(self, a: RunCommand) -> str:
        """Writable: the workspace alone (the sandbox's /tmp is its own). No folder inside it is named
        apart: the sandbox would mount what a link planted there points to."""
        with owned_containers(self.sandbox.backend) as owner:  # a Docker container outlives its killed client
            command, env = self.sandbox.wrap(  # the harness's environment, scrubbed of secrets (as for a candidate's
                # run): its PATH and virtualenv, so the agent runs the Python and the tests the judge will run
                ["bash", "-c", a.command],
                dict(os.environ),
                writable=[self.workspace],
                cwd=self.workspace,
                owner=owner,
                memory_bytes=self.limits.memory_bytes,  # the container's own, under Docker
                file_bytes=self.limits.file_bytes,
            )
            try:  # under the reaper: a background or setsid'd process ends with the command
                result = run_reaped(command, "", cwd=self.workspace, env=env, timeout_s=a.timeout_s, limits=self.limits)
            except subprocess.TimeoutExpired:
                raise ToolResultError(
                    f"the command ran past {a.timeout_s:g}s; it and every process it started were stopped"
                ) from None
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
        design = read_design(self.workspace)
        return "(this stack has no DESIGN.md yet)" if design is None else design


class ToolResultError(RuntimeError):
    """A tool that ran and failed in a way the model can act on (the message is returned to it)."""
