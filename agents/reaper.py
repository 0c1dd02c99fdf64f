"""Runs a command and, when it ends, kills everything it started: ``python -I reaper.py COMMAND...``.

A coding-agent CLI runs model-written commands. A process one of them leaves running — even one that
left the process group with ``setsid``, which a signal to the group never reaches — could write into the
workspace after the harness took its copy, load the machine while the judge measures, or hold the CLI's
stdout open so that its caller waits for it. This wrapper is the command's *subreaper*
(``PR_SET_CHILD_SUBREAPER``): every orphan among its descendants is re-parented here instead of to init,
so when the command exits the whole tree is still below this process and is killed (SIGKILL) before the
wrapper exits with the command's status.

Unlike a PID namespace, this leaves process ids as they are: the checks the CLI runs read ``/proc`` to
watch their own children's memory and count, and must find them there under their own ids.

``--memory BYTES`` and ``--file-size BYTES`` set the command's address-space and file-size limits
(``RLIMIT_AS``, ``RLIMIT_FSIZE``; its output goes to files, so a command that prints without end is
stopped there rather than filling its caller's memory).

SIGTERM (a timeout, from the caller) is passed to the command; after ``--grace`` seconds, or as soon as
the command is gone, its whole tree is killed. If the caller dies, the wrapper gets SIGTERM too
(``PR_SET_PDEATHSIG``) and does the same; a caller already gone when it starts (``--caller PID``, the
caller's pid) gets nothing run.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl({option}, {value}): {os.strerror(error)}")


def descendants(root: int) -> set[int]:
    """Every process below ``root``, read from /proc (a process that ends meanwhile is skipped)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = set(), [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def kill_tree() -> None:
    """SIGKILL every descendant and reap them, until none is left (a process may fork while we look)."""
    me = os.getpid()
    while True:
        alive = descendants(me)
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it ended since the scan
        while True:  # reap what was re-parented here
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break  # no children left at all
            if pid == 0:
                break  # some still dying: scan again
        if not alive:
            return
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    grace, caller = 5.0, os.getppid()
    limits = {"--memory": resource.RLIMIT_AS, "--file-size": resource.RLIMIT_FSIZE}
    while argv[:1] in (["--grace"], ["--caller"], *([flag] for flag in limits)) and len(argv) > 1:
        if argv[0] == "--grace":
            grace = float(argv[1])
        elif argv[0] in limits:  # this process's own, soft and hard (the command cannot raise it), inherited
            _, hard = resource.getrlimit(limits[argv[0]])
            bound = int(argv[1]) if hard == resource.RLIM_INFINITY else min(int(argv[1]), hard)
            resource.setrlimit(limits[argv[0]], (bound, bound))
        else:  # named by the caller: one that died before this line ran has handed us to another already
            caller = int(argv[1])
        argv = argv[2:]
    if not argv:
        usage = "usage: python -I reaper.py [--grace S] [--caller PID] [--memory B] [--file-size B] COMMAND..."
        print(usage, file=sys.stderr)
        return 2
    stopping: list[float] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(time.monotonic()))
    try:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (AttributeError, OSError) as error:  # no prctl: not Linux
        print(f"reaper: cannot become the command's subreaper ({error}); this needs Linux", file=sys.stderr)
        return 2
    if os.getppid() != caller:  # the caller died before the death signal was armed
        return 1
    command = subprocess.Popen(argv)
    while command.poll() is None and not stopping:
        time.sleep(0.05)
    if command.poll() is None:  # asked to stop: the command has the grace to end itself, then all goes
        command.send_signal(signal.SIGTERM)
        while command.poll() is None and time.monotonic() < stopping[0] + grace:
            time.sleep(0.05)
        if command.poll() is None:
            command.kill()
    code = command.wait()  # before kill_tree reaps anything, so its status is the command's own
    kill_tree()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
