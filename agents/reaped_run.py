"""Running a command under the reaper (``agents/reaper.py``) so that nothing it starts outlives it: a
coding-agent CLI's call, an LLM agent's ``run_command``. Killing only the direct child at a timeout
(``subprocess.run``'s way) leaves a background or ``setsid`` process running, writing into the
workspace or loading the machine while the judge measures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

KILL_GRACE_S = 5.0  # after SIGTERM, how long the command has to end before it and all it started are killed
REAPER_MARGIN_S = 5.0  # how much longer the reaper has to kill them before its own group is killed


@dataclass(frozen=True)
class CommandLimits:
    """What a model-written command may take besides time: its address space, the size of any file it
    writes (its output too, which goes to files: printing without end fills no memory of the harness's),
    and how many characters of each stream come back (its start and its end)."""

    memory_bytes: int
    file_bytes: int = 1 << 30
    output_chars: int = 64_000

    @classmethod
    def half_the_machine(cls) -> CommandLimits:
        """Half this machine's physical memory: the harness and the judge keep the rest."""
        return cls(memory_bytes=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2)


def reaped_argv(argv: list[str], grace_s: float, limits: CommandLimits | None = None) -> list[str]:
    """``argv`` under ``agents/reaper.py`` (see there: it kills whatever the command leaves running, a
    setsid'd process too, and keeps process ids as they are). Run by its path in isolated mode: it runs
    in the workspace, where a planted ``agents/reaper.py`` would otherwise be the one imported."""
    reaper = str(Path(__file__).with_name("reaper.py"))
    bounds = ["--memory", str(limits.memory_bytes), "--file-size", str(limits.file_bytes)] if limits else []
    return [sys.executable, "-I", reaper, "--grace", f"{grace_s:g}", "--caller", str(os.getpid()), *bounds, *argv]


def _ends_of(stream, chars: int | None) -> str:
    """A captured stream's text: whole (``chars`` None, or within it), else its start and its end, with
    what was left out."""
    size = stream.seek(0, os.SEEK_END)
    stream.seek(0)
    if chars is None:
        return stream.read().decode()
    if size <= chars:
        return stream.read().decode(errors="replace")
    head = stream.read(chars // 2).decode(errors="replace")
    stream.seek(size - chars // 2)
    tail = stream.read().decode(errors="replace")
    return f"{head}\n[... {size - chars} bytes left out ...]\n{tail}"


def stop(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the reaper, which passes it to the command and kills its whole tree after ``grace_s``;
    SIGKILL to the process group should the reaper itself not be gone by then."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s + REAPER_MARGIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # start_new_session: the reaper leads its own group
    process.communicate()  # reap it and close its pipes


def run_reaped(
    argv: list[str],
    input: str,
    *,
    cwd: Path,
    env: dict | None,
    timeout_s: float,
    grace_s: float = KILL_GRACE_S,
    limits: CommandLimits | None = None,
) -> subprocess.CompletedProcess:
    """``argv`` with ``input`` on stdin, its output captured as text; whatever it left running is killed
    when it ends. Past ``timeout_s`` it gets SIGTERM and ``grace_s`` to end, then it and everything it
    started are killed, and ``subprocess.TimeoutExpired`` is raised. Its output goes to files (a pipe the
    caller read whole); with ``limits`` (a model-written command), its memory and file sizes are bounded
    and the start and the end of each stream come back."""
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(
            reaped_argv(argv, grace_s, limits),
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            process.communicate(input.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(process, grace_s)
            raise
        chars = limits.output_chars if limits is not None else None
        out, err = _ends_of(stdout, chars), _ends_of(stderr, chars)
    return subprocess.CompletedProcess(argv, process.returncode, out, err)
