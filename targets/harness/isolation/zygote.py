"""Warm starts: a process that has imported what its children need forks a child per request, instead
of a fresh interpreter paying those imports every time. Two kinds, one process of each per
orchestrator process, started on first use:

* ``harness``: forks each run's harness child (``child.py``), warm with torch, transformers and the
  harness's checks and drivers (3-4 CPU-seconds a run), and, asked by a harness child, the reward
  model's judge processes of its run (``reward_model/judge_process.py``: ~5 CPU-seconds each fresh);
* ``candidate``: forks the candidate processes (``candidate_process.py``) of runs in the
  ``subprocess`` sandbox, warm with torch, its FSDP2 and the contract's wire (~4 CPU-seconds each for
  the components process, ~2 for the cluster's, every run). It is started with the scrubbed
  environment a candidate gets, so nothing secret is in its memory to inherit, and it never imports
  a candidate's code: that happens in the fork. (A sandbox with namespaces starts its processes
  fresh inside them.)

A zygote trusts nothing new: a fork runs the same program ``python -m <module>`` would, in its own
session, with the environment, working directory, descriptors and arguments of the request. It forks
only while it runs no Python thread but its own (checked before each fork; the native threads that
importing torch leaves waiting do not follow a fork, and no parallel region has run, so a child's
thread pools start fresh), reaps its children and reports each one's exit code and CPU time to the
connection that asked for it.

Connections are ``SOCK_SEQPACKET`` sockets; messages are single JSON datagrams, descriptors passed
alongside. The orchestrator holds the first connection; ``connect`` hands a further one to someone
else (a harness child asks the candidate zygote for its run's processes over one, the harness zygote
for its judges over another). Requests: ``{"argv", "env", "cwd"}`` (and ``"main"``, one of the kind's
``MAINS``; the first by default) with the log descriptor and any extra ones (they become 3, 4, ... in
the child) -> ``{"pid"}`` or ``{"error"}``, later ``{"exit": pid, "code", "cpu_s"}`` (a negative code:
killed by that signal); ``{"connect": true}`` with a socket -> a new connection. When a connection
closes, the children it asked for are killed; when the first one closes, the zygote kills all of its
children and exits (a harness child also watches its parent, and a candidate process dies with it).
This module is the zygote's side; the requesting side is ``zygote_client.py``.
"""

from __future__ import annotations

import ctypes
import fcntl
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback

from targets import PROJECT_ROOT
from targets.harness.isolation.process_tree import kill_forked
from targets.harness.isolation.zygote_client import MESSAGE_BYTES, passed_fd

MAINS = {  # the modules a zygote's children may run, by kind: the first unless a request names another
    "harness": ("targets.harness.isolation.child", "targets.harness.reward_model.judge_process"),
    "candidate": ("targets.harness.isolation.candidate_process",),
}
_PR_SET_PDEATHSIG = 1


# -- the zygote's side -----------------------------------------------------------------------------------


def _warm(kind: str) -> None:
    """What every child of ``kind`` imports, loaded once here. CUDA must stay untouched (a process that
    initialised it cannot hand it to a fork): an availability check at import time asks NVML instead,
    and a zygote that finds CUDA initialised anyway stops, saying so."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # the zygote's own; a child gets the request's environment
    import torch

    if kind == "harness":
        import transformers.models.qwen3.modeling_qwen3  # noqa: F401
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: F401 - how models load

        import targets.harness.ipc.remote  # noqa: F401
        import targets.harness.isolation.child  # noqa: F401
        import targets.harness.isolation.drive  # noqa: F401
        import targets.harness.judge.accuracy  # noqa: F401
        import targets.harness.judge.audit  # noqa: F401
        import targets.harness.reward_model.judge_process  # noqa: F401
        import targets.harness.sim.virtual_time  # noqa: F401
    else:  # what the contract's side of the wire and a stack's engine and trainer import, never a stack itself
        import safetensors.torch  # noqa: F401
        import torch._dynamo  # noqa: F401 - torch imports it on a module's first random init (~1-2 CPU-s a trainer)
        import torch.distributed.fsdp  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401

        import targets.harness.ipc.weight_export  # noqa: F401
        import targets.harness.isolation.candidate_process  # noqa: F401

    if torch.cuda.is_initialized():
        raise RuntimeError(f"importing the {kind} zygote's modules initialised CUDA: its forks could not use the GPU")


def _place(fds: list[int]) -> None:
    """The request's descriptors where the child expects them: the log on 1 and 2, the rest on 3, 4, ...;
    every other descriptor closed (moved out of the way first: a received one may sit on 3 or 4)."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 256) for fd in fds]
    os.dup2(high[0], 1)
    os.dup2(high[0], 2)
    for position, fd in enumerate(high[1:]):
        os.dup2(fd, passed_fd(position))
    os.closerange(passed_fd(len(high) - 1), os.sysconf("SC_OPEN_MAX"))


def child_path(env: dict[str, str], base_path: list[str]) -> list[str]:
    """A child's import path: the project, the request's ``PYTHONPATH`` (where a user's environment is
    found), then the interpreter's; never the working folder, which ``python -m`` would put first: a
    module there named like one the harness child imports after the fork (``pynvml`` on a GPU target)
    would run in the judge's process, unsandboxed, whenever vibetrain is started from a candidate's folder."""
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [str(PROJECT_ROOT), *extra, *base_path]


def _become_child(kind: str, request: dict, fds: list[int], base_path: list[str], zygote_pid: int) -> None:
    """In the forked process: the child's session, descriptors, environment and path, then its main."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if kind == "candidate":  # killed with the zygote; a harness child watches its parent itself
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != zygote_pid:  # it died before the signal was asked for
                os._exit(1)
        _place(fds)
        for stream in (sys.stdout, sys.stderr):  # as PYTHONUNBUFFERED gives a fresh child: a killed run's log is whole
            stream.reconfigure(line_buffering=True, write_through=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = child_path(request["env"], base_path)
        importlib.invalidate_caches()
        module = importlib.import_module(request.get("main") or MAINS[kind][0])
        sys.argv = [module.__file__, *request["argv"]]
        code = module.main(request["argv"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed to the child's log, then its exit code says so
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _Server:
    """The zygote's loop: connections, forks, and who asked for which child."""

    def __init__(self, kind: str, first: socket.socket, base_path: list[str]) -> None:
        self.kind, self.first, self.base_path = kind, first, base_path
        self.connections: dict[int, socket.socket] = {first.fileno(): first}
        self.asked_by: dict[int, socket.socket] = {}  # running child pid -> the connection that asked for it
        self.forked_for: dict[int, list[int]] = {}  # connection's descriptor -> every child forked for it

    def reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.asked_by.pop(pid, None)
            message = {"exit": pid, "code": os.waitstatus_to_exitcode(status), "cpu_s": usage.ru_utime + usage.ru_stime}
            if connection is not None and connection.fileno() in self.connections:
                try:
                    connection.send(json.dumps(message).encode())
                except OSError:
                    pass  # it closed meanwhile: its children are killed below, nobody waits for this one

    def serve(self, connection: socket.socket) -> bool:
        """One request on ``connection``; False once the first connection closed (the zygote ends)."""
        try:
            data, fds, _, _ = socket.recv_fds(connection, MESSAGE_BYTES, 4)
        except ConnectionResetError:  # its holder was killed with a message of ours unread: closed all the same
            data, fds = b"", []
        if not data:
            del self.connections[connection.fileno()]
            kill_forked(self.forked_for.pop(connection.fileno(), []), self.asked_by)
            connection.close()
            return connection is not self.first
        request = json.loads(data)
        if request.get("connect"):
            added = socket.socket(fileno=fds[0])
            self.connections[added.fileno()] = added
            connection.send(json.dumps({"connected": True}).encode())
            return True
        if request.get("main", MAINS[self.kind][0]) not in MAINS[self.kind]:
            connection.send(json.dumps({"error": f"a {self.kind} zygote runs none of {request['main']!r}"}).encode())
        elif threading.active_count() != 1:
            names = [t.name for t in threading.enumerate()]
            connection.send(json.dumps({"error": f"the zygote runs Python threads {names}: it cannot fork"}).encode())
        else:
            zygote_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                for open_connection in self.connections.values():
                    open_connection.close()
                _become_child(self.kind, request, fds, self.base_path, zygote_pid)
            self.asked_by[pid] = connection
            self.forked_for.setdefault(connection.fileno(), []).append(pid)
            connection.send(json.dumps({"pid": pid}).encode())
        for descriptor in fds:
            os.close(descriptor)
        return True


def child_exit_wakeup() -> int:
    """A descriptor a ``select`` loop can wait on: readable whenever a child exits (SIGCHLD)."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return wake_read


def _end_with_parent_while(parent: int, warming: threading.Event) -> None:
    """Until ``warming`` is cleared, poll the zygote's parent: the imports take seconds (more on a busy
    machine) before the zygote first reads its connection, and an orchestrator killed meanwhile must not
    leave it importing on. Once it serves, the connection's close ends it."""
    while warming.is_set():
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(0.1)


def main(fd: int, kind: str, parent: int) -> None:
    """``parent``: the pid of the process that started the zygote, named by it (read here, a parent
    that died before this line would already be init or a subreaper, and the zygote would warm on)."""
    first = socket.socket(fileno=fd)
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in own]  # without the zygote's cwd and PYTHONPATH
    warming = threading.Event()
    warming.set()
    watcher = threading.Thread(target=_end_with_parent_while, args=(parent, warming), daemon=True)
    watcher.start()
    _warm(kind)
    warming.clear()
    watcher.join()  # no Python thread but the zygote's own when it forks
    server = _Server(kind, first, base_path)
    wake_read = child_exit_wakeup()
    try:
        while True:
            readable, _, _ = select.select([*server.connections.values(), wake_read], [], [])
            if wake_read in readable:
                os.read(wake_read, 4096)
            server.reap()
            for connection in readable:
                if connection is not wake_read and connection.fileno() in server.connections:
                    if not server.serve(connection):
                        return  # the orchestrator went away: so does the zygote, and its children with it
            server.reap()
    finally:
        kill_forked([pid for pids in server.forked_for.values() for pid in pids], server.asked_by)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))  # as ``zygote_client.Zygote`` starts it
