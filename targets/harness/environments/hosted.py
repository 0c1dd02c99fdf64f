"""The harness's side of a user's environment run in a process of its own (``host.py`` says why):
``EnvironmentHost`` starts the process and carries its calls, ``HostedEnvironment`` is one episode's
environment there, behind the contract's ``TextEnvironment``. Calls are answered by a reader thread, so
they may be awaited on any event loop (a test's ``asyncio.run`` each) or waited for outside one (the
check of an entry). A host that exits fails every call with what it last wrote."""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import itertools
import os
import pickle
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from targets.api import TextStep
from targets.harness.environments import host as host_module
from targets.harness.environments.adapters import UserEnvironmentError
from targets.harness.environments.wire import Answer, Load, Loaded, Request, Started, Step, encode, from_wire, parse
from targets.printable import printable

if TYPE_CHECKING:
    from targets.harness.isolation.sandbox import Sandbox
    from targets.spec import EnvironmentRef

CHECK_LIMIT_S = 60.0  # making and closing one environment to check an entry: a hung factory is named, not waited on
START_LIMIT_S = 300.0  # the host's interpreter and the harness's modules coming up, before any user code runs
STOP_LIMIT_S = 5.0  # how long a host has to end once its input is closed, before it is killed
STDERR_LINES = 20  # what a host that exits is named with
LINE_LIMIT = 64 << 20  # an answer's line: a long observation's text, far short of filling the harness's memory
STDERR_CHUNK = 8192  # what it prints is relayed in pieces of at most this: a line with no end fills nothing


@dataclass(frozen=True)
class Confinement:
    """How a run confines the process its user's environment runs in: under bubblewrap wherever the run's
    ``sandbox`` isolates at all (Docker's too: its containers hold the candidate), with ``hidden`` (the run's
    folder) out of sight and its tmpfs sized at ``memory_bytes``."""

    sandbox: Sandbox
    hidden: tuple[Path, ...] = ()
    memory_bytes: int | None = None


class EnvironmentHost:
    """One process running one entry's environments (started by ``start``)."""

    def __init__(self, entry: str, process: subprocess.Popen) -> None:
        self.entry, self.process = entry, process
        self.numbers = itertools.count()
        self.waiting: dict[int, concurrent.futures.Future] = {}
        self.sending = threading.Lock()  # one message written at a time
        self.answering = threading.Lock()  # ``waiting`` and ``gone``, between the callers and the reader
        self.gone: str | None = None  # why calls can no longer be answered
        self.said: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self.relay = threading.Thread(target=self._relay_stderr, name="environment-host stderr", daemon=True)
        self.relay.start()

    @classmethod
    def start(cls, environment: EnvironmentRef, confinement: Confinement | None = None) -> EnvironmentHost:
        """The host of ``environment``'s entry, its entry loaded and one environment made to check it.
        ``confinement``: a run's (``Sandbox.wrap_environment``); none, or the ``subprocess`` sandbox, runs it as
        a plain process, no isolation (the check of an entry and the reference loop read no candidate's text)."""
        entry = str(environment.entry)
        missing = [str(folder) for folder in environment.writable if not folder.is_dir()]
        if missing:  # on the machine that runs it (a spec may be written elsewhere): said before it starts
            raise UserEnvironmentError(f"environment {entry}: writable {', '.join(missing)} is no folder here")
        command = [sys.executable, "-m", host_module.__name__]  # imported for its name: an export renames it
        paths = [p for p in sys.path if p and Path(p).is_dir()]  # what the harness imports, the host imports
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        if confinement is not None and confinement.sandbox.backend != "subprocess":
            command = _confined(command, environment, confinement, paths)
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        host = cls(entry, process)
        params = base64.b64encode(pickle.dumps(environment.params)).decode()  # the user's: any YAML value
        loaded = host._first(Load(entry=entry, adapter=str(environment.adapter), params=params))
        if not loaded.loaded:
            host.stop()
            raise UserEnvironmentError(str(loaded.error))
        threading.Thread(target=host._read, name="environment-host answers", daemon=True).start()
        return host

    def _first(self, message: Load) -> Loaded:
        """The answer to loading the entry, within ``CHECK_LIMIT_S`` of the host's start (a factory that never
        returns is named)."""
        assert self.process.stdin is not None
        started = f"did not start within {START_LIMIT_S:g} s"
        self._line(Started, START_LIMIT_S, f"the process running environment {self.entry} {started}")
        try:
            self.process.stdin.write(encode(message))
            self.process.stdin.flush()
        except BrokenPipeError:  # it ended before it read a word
            raise UserEnvironmentError(self._exited()) from None
        return self._line(Loaded, CHECK_LIMIT_S, self._not_made())

    def _line(self, kind: type, limit: float, late: str):
        """The host's next line, a ``kind`` message, within ``limit`` seconds (else it is killed and ``late``
        raised)."""
        assert self.process.stdout is not None
        answer: concurrent.futures.Future = concurrent.futures.Future()
        reading = threading.Thread(
            target=lambda: answer.set_result(self.process.stdout.readline(LINE_LIMIT)), daemon=True
        )
        reading.start()
        try:
            line = answer.result(limit)
        except concurrent.futures.TimeoutError:
            self.process.kill()  # its factory holds it: it would not end on its own
            self.stop()
            raise UserEnvironmentError(late) from None
        if not line:  # it ended (bwrap refused its mounts, an import failed, the user's code exited)
            raise UserEnvironmentError(self._exited())
        try:
            return parse(line, kind)
        except (ValueError, RecursionError):
            self.stop()
            raise UserEnvironmentError(
                f"the process running environment {self.entry} answered out of protocol: {line[:200]!r}"
            ) from None

    def environment(self) -> HostedEnvironment:
        """A new episode's environment, made in the host (unwaited: what making it raised, its first call raises)."""
        number = next(self.numbers)
        self._write(Request(op="make", env=number))
        return HostedEnvironment(self, number)

    def check(self) -> None:
        """One environment made and closed, as a run makes and closes each (an entry's check)."""
        try:
            self._answer(self._send("check")[1].result(CHECK_LIMIT_S))
        except concurrent.futures.TimeoutError:
            raise UserEnvironmentError(self._not_made()) from None
        except UserEnvironmentError as error:
            raise UserEnvironmentError(f"environment {self.entry}: {error}") from None
        except Exception as error:  # noqa: BLE001 - what the user's close raised in the host: named, no traceback
            raise UserEnvironmentError(f"environment {self.entry}: {type(error).__name__}: {error}") from None

    def _not_made(self) -> str:
        return (
            f"environment {self.entry}: making one and closing it did not finish within {CHECK_LIMIT_S:g} s (a "
            "factory, a task set's __len__ or a close() that never returns?)"
        )

    async def call(self, op: str, **fields: Any) -> Any:
        """The host's answer to one call, awaited on the running loop; a caller that stops waiting (the call
        timed out) tells the host to cancel it."""
        number, answer = self._send(op, **fields)
        try:
            return self._answer(await asyncio.wrap_future(answer))
        except asyncio.CancelledError:
            with contextlib.suppress(UserEnvironmentError):  # a host already gone has nothing to cancel
                self._write(Request(op="cancel", call=number))
            raise

    def _send(self, op: str, **fields: Any) -> tuple[int, concurrent.futures.Future]:
        """A call numbered and sent, with the future its answer will settle."""
        number = next(self.numbers)
        answer: concurrent.futures.Future = concurrent.futures.Future()
        with self.answering:  # never added after the reader failed what was waiting: it would wait forever
            if self.gone is not None:
                raise UserEnvironmentError(self.gone)
            self.waiting[number] = answer
        self._write(Request(op=op, id=number, **fields))
        return number, answer

    def _write(self, message: Request) -> None:
        if self.gone is not None:
            raise UserEnvironmentError(self.gone)
        assert self.process.stdin is not None
        try:
            with self.sending:
                self.process.stdin.write(encode(message))
                self.process.stdin.flush()
        except (BrokenPipeError, ValueError):  # it exited (the reader names why, when it has read all), or was stopped
            raise UserEnvironmentError(
                self.gone or f"the process running environment {self.entry} exited (code {self.process.poll()})"
            ) from None

    @staticmethod
    def _answer(answer: Answer) -> Any:
        if answer.cancelled:
            raise asyncio.CancelledError
        if answer.user is not None:
            raise UserEnvironmentError(answer.user)
        if answer.raised is not None:
            name, message = answer.raised
            raise type(printable(name), (Exception,), {})(message)  # named as the user's code named it (a NUL: no type)
        return answer.step if answer.step is not None else answer.ok

    def _read(self) -> None:
        """Answers handed to their callers; a line out of protocol ends the host (its code runs the candidate's
        text: what it says is checked, never trusted to be well formed)."""
        assert self.process.stdout is not None
        for line in iter(lambda: self.process.stdout.readline(LINE_LIMIT), b""):
            try:
                if not line.endswith(b"\n"):  # longer than any answer, or cut off as it exited
                    raise ValueError(f"a line of {len(line)} bytes with no end")
                message = parse(line, Answer)
                answer = self.waiting.pop(message.id, None)
            except (ValueError, RecursionError) as error:  # a JSON nested past Python's stack raises the latter
                breach = (
                    f"the process running environment {self.entry} answered out of protocol ({error}): {line[:200]!r}"
                )
                self.process.kill()
                self._fail_waiting(breach)
                return
            if answer is not None:
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # its waiter was cancelled
                    answer.set_result(message)
        self._fail_waiting(self._exited())

    def _fail_waiting(self, why: str) -> None:
        """No call is answered from now on: those waiting fail with ``why``, and later ones at once."""
        with self.answering:
            self.gone = self.gone or why
            waiting, self.waiting = list(self.waiting.values()), {}
        for answer in waiting:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # its waiter was cancelled
                answer.set_exception(UserEnvironmentError(self.gone))

    def _exited(self) -> str:
        try:
            code = self.process.wait(STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            code = None
        self.relay.join(STOP_LIMIT_S)  # its last words are read before they are named
        said = "; it said: " + " | ".join(self.said) if self.said else ""
        return f"the process running environment {self.entry} exited (code {code}){said}"

    def _relay_stderr(self) -> None:
        """What the user's code prints, passed on to the harness's stderr (the run's log), the last lines kept."""
        assert self.process.stderr is not None
        for raw in iter(lambda: self.process.stderr.readline(STDERR_CHUNK), b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.said.append(line)
            print(line, file=sys.stderr, flush=True)

    def stop(self) -> None:
        """The host ended: its input closed (it ends on its own), killed if it has not within ``STOP_LIMIT_S``."""
        if self.gone is None:
            self.gone = f"the process running environment {self.entry} was stopped (the run is over)"
        with contextlib.suppress(BrokenPipeError, ValueError):  # it is gone already
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _confined(command: list[str], environment: EnvironmentRef, confinement: Confinement, paths: list[str]) -> list[str]:
    from targets.harness.isolation.sandbox import Sandbox, SandboxUnavailable

    try:
        bubblewrap = Sandbox.detect("bubblewrap")
    except SandboxUnavailable:
        raise UserEnvironmentError(
            f"environment {environment.entry} reads the candidate's text, so it runs under bubblewrap, which cannot "
            f"run here (the {confinement.sandbox.backend} sandbox holds the candidate alone): install bubblewrap, or "
            "pass --sandbox subprocess to accept no isolation"
        ) from None
    return bubblewrap.wrap_environment(
        command,
        readable=[Path(p) for p in paths],
        writable=environment.writable,
        hidden=confinement.hidden,
        network=environment.network,
        memory_bytes=confinement.memory_bytes,
    )


class HostedEnvironment:
    """``TextEnvironment`` for one episode, run by its host; what it answers is rebuilt as the harness reads
    it (``wire.from_wire``: a value that could not travel keeps its type's name and repr)."""

    def __init__(self, host: EnvironmentHost, number: int) -> None:
        self.host, self.number = host, number

    async def reset(self, task: int) -> Any:
        return from_wire(await self.host.call("reset", env=self.number, task=task))

    async def step(self, action: str) -> Any:
        answer = await self.host.call("step", env=self.number, action=action)
        if not isinstance(answer, Step):
            raise UserEnvironmentError(f"its process answered a step out of protocol: {answer!r:.200}")
        if answer.fields is None:
            return from_wire(answer.not_a_step)
        return TextStep(*(from_wire(value) for value in answer.fields))

    async def close(self) -> None:
        await self.host.call("close", env=self.number)


def check_environment(environment: EnvironmentRef) -> None:
    """A user's environment (none to check for a harness one): one made through its adapter and closed in a
    host, as a run makes and closes each, so what the entry does with its params is known before a run starts
    (or a spec is called valid)."""
    if environment.entry is None:
        return
    host = EnvironmentHost.start(environment)
    try:
        host.check()
    finally:
        host.stop()
