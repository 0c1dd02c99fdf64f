"""A process and all its descendants, read from /proc: what the watchdog measures and kills, so a
candidate cannot escape a limit by forking or by leaving its process group."""

from __future__ import annotations

import os
import signal
import time


def _process_table() -> list[tuple[int, str, int, int]]:
    """Every process as (pid, state, parent, process group), from /proc: one read of the table."""
    table = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, parent, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process ended while we looked (a table we cannot read is an error, not a smaller tree)
        table.append((int(entry), state, int(parent), int(group)))
    return table


def children_of() -> dict[int, list[int]]:
    """Every process's children, from /proc (parent links): one read of the process table."""
    children: dict[int, list[int]] = {}
    for pid, _, parent, _ in _process_table():
        children.setdefault(parent, []).append(pid)
    return children


def wait_exited(pids: list[int], groups: list[int], timeout_s: float) -> list[int]:
    """Waits until each of ``pids`` and every member of the process groups ``groups`` has exited (a
    zombie has: it holds no memory and runs nothing); returns those still running after ``timeout_s``.
    A SIGKILL is delivered when its process next runs, so a killed storm is not gone the moment the
    signal is sent: the next run must not start beside it."""
    pids_, groups_ = set(pids), set(groups)
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p, state, _, g in _process_table() if state not in "ZX" and (p in pids_ or g in groups_)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


def process_tree(root: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """``root`` and every descendant (``children``: a table ``children_of`` read, else a fresh one)."""
    children = children_of() if children is None else children
    tree, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        tree.append(pid)
        frontier += children.get(pid, [])
    return tree


def resident_mb(pids: list[int]) -> float:
    """Resident memory of ``pids`` together: their proportional set sizes, so pages several of them
    share (the CUDA and torch libraries every GPU process maps, ~1 GB each) count once, not per process."""
    total_kb = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total_kb += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process ended while we looked (a file we may not read is an error, not zero)
    return total_kb / 1024


def resident_bound_mb(pids: list[int]) -> float:
    """An upper bound on ``resident_mb``, a hundred times cheaper: the resident set sizes, which count
    shared pages once per process (a proportional share is never more than the whole page). Reading a
    torch process's ``smaps_rollup`` takes ~2 ms of kernel time, its ``statm`` ~15 µs."""
    page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
    total_kb = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total_kb += int(f.read().split()[1]) * page_kb
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process ended while we looked
    return total_kb / 1024


def thread_count(pids: list[int]) -> int:
    """The threads of ``pids`` together (a thread storm takes the host's pid space as a fork storm does,
    and a process count never sees it)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                total += int(f.read().rsplit(")", 1)[1].split()[17])  # num_threads, the stat's 20th field
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process ended while we looked
    return total


def kill_tree(root: int, sig: int = signal.SIGKILL) -> None:
    """Signal ``root``'s process group and every descendant (also those that left the group)."""
    pids = process_tree(root)
    try:
        os.killpg(root, sig)
    except (ProcessLookupError, PermissionError):
        pass  # not a group leader, or already gone: the descendants below are signalled one by one
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_group(leader: int, sig: int = signal.SIGKILL) -> None:
    """Signal the process group ``leader`` led, if any of it is left: what a session leader that ended
    left running (re-parented away from it, so no tree reaches it) is still there."""
    try:
        os.killpg(leader, sig)
    except ProcessLookupError:
        pass  # it left nothing behind


def kill_forked(pids: list[int], running) -> None:
    """Each forked child's tree while it runs (``running``: still its forker's child, so its pid is its
    own), else its process group (it led one: what it left running, re-parented away, is there)."""
    for pid in pids:
        if pid in running:
            kill_tree(pid)
        else:
            kill_group(pid)
