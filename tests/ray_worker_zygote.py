"""Warm Ray workers for the test session's shared cluster (``ray_session.py``): the raylet starts each
Python worker through a launcher (``write_launcher``) that asks this process to fork one instead of a
fresh interpreter importing torch again. Each real run of the suite starts two device actors in fresh
workers of its own job, and those imports were a fifth of the suite's CPU (measured: the stack kit's
eight planted-cheat checks 91-95 s -> 60 s of wall time, 146-158 -> 89 busy core-seconds).

Only the tests' shared cluster starts its workers this way; a candidate's own Ray cluster (bubblewrap,
or no ``RAY_ADDRESS``) starts them as Ray does. A fork runs what ``python default_worker.py <args>``
would: Ray's own worker script, with the launcher's arguments, environment, working directory and
standard descriptors; torch is imported here once, Ray in each worker.

Protocol: one ``SOCK_SEQPACKET`` connection per worker; the launcher sends ``{"argv", "env", "cwd"}`` with
its descriptors 0, 1, 2, and gets ``{"pid"}`` (or ``{"error"}``), later ``{"exit": code}``. A launcher that
goes away (the raylet killed it) takes its worker's process group with it; so does this process.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import traceback

from targets.harness.isolation.zygote import child_exit_wakeup

_PR_SET_PDEATHSIG = 1

LAUNCHER = '''#!{python} -S
"""Starts a Ray Python worker as a fork of the warm process at {path!r} (tests/ray_worker_zygote.py);
anything else, or a worker it cannot fork, as the real interpreter would."""
import json, os, socket, sys
PYTHON, ZYGOTE = {python!r}, {path!r}
argv = sys.argv[1:]
if not argv or not argv[0].endswith("default_worker.py"):
    os.execv(PYTHON, [PYTHON, *argv])
connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    connection.connect(ZYGOTE)
    request = {{"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}}
    socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
    answer = json.loads(connection.recv(1 << 16) or b"{{}}")
except OSError as error:
    answer = {{"error": str(error)}}
if "pid" not in answer:
    print("warm worker refused, starting a fresh one:", answer.get("error", "no answer"), file=sys.stderr)
    os.execv(PYTHON, [PYTHON, *argv])
while True:
    data = connection.recv(1 << 16)
    if not data:
        os._exit(1)
    code = json.loads(data).get("exit")
    if code is not None:
        os._exit(code if code >= 0 else 128 - code)
'''


def write_launcher(path: str, zygote_socket: str) -> str:
    """The launcher, as an executable file at ``path`` (the raylet runs it as its Python)."""
    with open(path, "w") as file:
        file.write(LAUNCHER.format(python=sys.executable, path=zygote_socket))
    os.chmod(path, 0o755)
    return path


def _warm() -> None:
    """What a device actor of the tests' stacks imports, once: torch, its FSDP2, safetensors. Not Ray:
    a worker forked from a process that imported ``ray._raylet`` crashes in its native start-up (tried)."""
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # never initialise CUDA in a process that forks
    # A fresh worker imports torch after Ray set its OMP_NUM_THREADS from the actor's CPUs (1 for every
    # actor of the tests' stacks), and torch's thread pool keeps what it read then: so 1 here too.
    os.environ["OMP_NUM_THREADS"] = "1"
    import safetensors.torch  # noqa: F401
    import torch._dynamo  # noqa: F401 - imported by a module's first random init
    import torch.distributed.fsdp  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401


def _run_worker(request: dict, fds: list[int], base_path: list[str]) -> None:
    """In the fork: the launcher's descriptors, session, environment and path, then Ray's worker script."""
    code = 1
    try:
        os.setsid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = request["argv"][0]
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(script), *extra, *base_path]  # as ``python script`` there would have it
        sys.argv = list(request["argv"])
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed to the worker's log; its exit code says so
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # it ended meanwhile: reaped below


def serve(temp_dir: str, launcher: str) -> None:
    """Warm up, write the launcher, say so on stdout, then fork a worker per connection until the
    parent goes away."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in own]
    _warm()
    path = os.path.join(temp_dir, "warm-workers.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    write_launcher(launcher, path)
    print("ready", flush=True)
    connections: dict[int, socket.socket] = {}
    worker_of: dict[int, int] = {}  # connection descriptor -> its worker's pid
    wake_read = child_exit_wakeup()
    try:
        while True:
            readable, _, _ = select.select([listener, wake_read, *connections.values()], [], [])
            if wake_read in readable:
                os.read(wake_read, 4096)
            if listener in readable:
                connection, _ = listener.accept()
                connections[connection.fileno()] = connection
            for connection in [c for c in readable if c not in (listener, wake_read)]:
                data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
                if not data:  # the launcher went away: so does its worker
                    if (pid := worker_of.pop(connection.fileno(), None)) is not None:
                        _kill_group(pid)
                    del connections[connection.fileno()]
                    connection.close()
                elif threading.active_count() != 1:
                    connection.send(json.dumps({"error": "the zygote runs Python threads: it cannot fork"}).encode())
                else:
                    pid = os.fork()
                    if pid == 0:
                        listener.close()
                        for open_connection in connections.values():
                            open_connection.close()
                        _run_worker(json.loads(data), fds, base_path)
                    worker_of[connection.fileno()] = pid
                    connection.send(json.dumps({"pid": pid}).encode())
                for fd in fds:
                    os.close(fd)
            _reap(connections, worker_of)
    finally:
        for pid in worker_of.values():
            _kill_group(pid)


def _reap(connections: dict[int, socket.socket], worker_of: dict[int, int]) -> None:
    """Each ended worker's exit code to its launcher."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for fd, worker in list(worker_of.items()):
            if worker == pid:
                del worker_of[fd]
                try:
                    connections[fd].send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass  # the launcher went away meanwhile: nobody waits for this exit


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
