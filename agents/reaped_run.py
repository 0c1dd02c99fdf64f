"""Running a command under the reaper (``agents/reaper.py``) so that nothing it starts outlives it: a
coding-agent CLI's call, an LLM agent's ``run_command``. Killing only the direct child at a timeout
(``subprocess.run``'s way) leaves a background or ``setsid`` process running, writing into the
workspace or loading the machine while the judge measures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

KILL_GRACE_S = 5.0  # after SIGTERM, how long the command has to end before it and all it started are killed
REAPER_MARGIN_S = 5.0  # how much longer the reaper has to kill them before its own group is killed


def reaped_argv(argv: list[str], grace_s: float) -> list[str]:
    """``argv`` under ``agents/reaper.py`` (see there: it kills whatever the command leaves running, a
    setsid'd process too, and keeps process ids as they are). Run by its path in isolated mode: it runs
    in the workspace, where a planted ``agents/reaper.py`` would otherwise be the one imported."""
    reaper = str(Path(__file__).with_name("reaper.py"))
    return [sys.executable, "-I", reaper, "--grace", f"{grace_s:g}", "--caller", str(os.getpid()), *argv]


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
) -> subprocess.CompletedProcess:
    """``argv`` with ``input`` on stdin, its output captured as text; whatever it left running is killed
    when it ends. Past ``timeout_s`` it gets SIGTERM and ``grace_s`` to end, then it and everything it
    started are killed, and ``subprocess.TimeoutExpired`` is raised."""
    process = subprocess.Popen(
        reaped_argv(argv, grace_s),
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(input, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(process, grace_s)
        raise
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
