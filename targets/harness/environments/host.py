"""The process a user's environment runs in, started by the harness (``hosted.py``) and spoken to in
messages (``wire.py``): it makes, resets, steps and closes environments through their adapter
(``adapters.py``) as the harness asks, and answers with what they said.

Why a process of its own: the actions are text a candidate's engine produced, and an environment or
scorer that evaluates its action as code (a sympy parse, an ``eval``, a tool call) runs that text. In
the harness's process it could reach the trace, the clock and the weights before the audit read them;
here it reaches this process alone, and under bubblewrap it sees no harness process and no run folder
(``Sandbox.wrap_environment``).

The protocol (``wire.py``'s messages, one a line): ``Started`` first; a ``Load`` of the entry, answered
``Loaded``; then
``Request``s: ``make`` (unanswered: an episode's environment made, what the factory raised raised by its
first call), ``reset``, ``step``, ``close``, ``check`` (make one and close it: what checking an entry
does), each answered by an ``Answer`` under its number, and ``cancel`` (a call the harness stopped waiting
for). The process ends when the harness closes its input."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import sys
import threading
from typing import Any, BinaryIO

from targets.api import TextStep
from targets.harness.environments.adapters import UserEnvironmentError, environment_factory
from targets.harness.environments.wire import Answer, Load, Loaded, Request, Started, Step, encode, parse, to_wire


class Host:
    """The environments of one entry, each by the number the harness gave it."""

    def __init__(self, answers: BinaryIO, factory) -> None:
        self.answers, self.factory = answers, factory
        self.environments: dict[int, Any] = {}
        self.unmade: dict[int, BaseException] = {}  # what the factory raised making an environment
        self.calls: dict[int, asyncio.Task] = {}
        self.running: dict[int, set[asyncio.Task]] = {}  # an environment's calls under way (a cancelled one too)
        self.writing = threading.Lock()

    def send(self, message: Answer) -> None:
        with self.writing:
            self.answers.write(encode(message))
            self.answers.flush()

    def take(self, request: Request) -> None:
        """One request, on the event loop: a call runs as a task of its own (an environment's calls run
        beside another's), a cancel stops the call it names."""
        if request.op == "cancel":
            call = self.calls.get(request.call)
            if call is not None:
                call.cancel()
            return
        if request.op == "make":  # unanswered: what the factory raised is raised by the environment's calls
            try:
                self.environments[request.env] = self.factory()
            except BaseException as error:  # noqa: BLE001 - raised again by the first call of that environment
                self.unmade[request.env] = error
            return
        call = self.calls[request.id] = asyncio.get_running_loop().create_task(self.serve(request))
        if request.env is not None:
            running = self.running.setdefault(request.env, set())
            running.add(call)
            call.add_done_callback(running.discard)

    async def serve(self, request: Request) -> None:
        number = request.id
        try:
            value = await self.run(request)
            answer = Answer(number, step=value) if isinstance(value, Step) else Answer(number, ok=value)
        except asyncio.CancelledError:  # the harness stopped waiting, or the user's coroutine cancelled itself
            answer = Answer(number, cancelled=True)
        except UserEnvironmentError as error:
            answer = Answer(number, user=str(error))
        except SystemExit as error:  # named as the harness named it in its own loop: it never ends this one
            answer = Answer(number, raised=("RuntimeError", f"SystemExit: {error}"))
        except BaseException as error:  # noqa: BLE001 - the user's code raised: sent to the harness, which names it
            answer = Answer(number, raised=(type(error).__name__, str(error)))
        finally:
            self.calls.pop(number, None)
        self.send(answer)

    async def run(self, request: Request) -> Any:
        op, number = request.op, request.env
        if op == "check":
            environment = self.factory()
            close = getattr(environment, "close", None)
            if callable(close):
                try:
                    await close()
                except Exception as error:  # noqa: BLE001 - the user's code: named, as a run names it
                    raise UserEnvironmentError(f"close() raised {type(error).__name__}: {error}") from None
            return None
        if op == "close":
            # never under a call of its own still under way, a cancelled one's cleanup included (a thread's call
            # cannot be stopped: an adapter's close queues behind it on the environment's thread)
            others = self.running.get(number, set()) - {asyncio.current_task()}
            if others:
                await asyncio.wait(others)
            environment = self.environments.pop(number, None)
            close = getattr(environment, "close", None)
            if callable(close):
                await close()
            return None
        if number in self.unmade:
            raise self.unmade[number]
        if op == "reset":
            return to_wire(await self.environments[number].reset(request.task))
        if op == "step":
            answer = await self.environments[number].step(request.action)
            if not isinstance(answer, TextStep):
                return Step(not_a_step=to_wire(answer))
            fields = (answer.observation, answer.reward, answer.done, answer.truncated)
            return Step(fields=[to_wire(value) for value in fields])
        raise ValueError(f"the environment host has no operation {op!r}")


def load(message: Load):
    """The entry's factory (an environment made to check it), or the error that says why it cannot be."""
    params = pickle.loads(base64.b64decode(message.params))  # the harness's own message: the user's params
    try:
        return environment_factory(message.entry, message.adapter, params), None
    except UserEnvironmentError as error:
        return None, str(error)
    except SystemExit as error:
        return None, f"environment {message.entry}: called sys.exit({error.code!r}) when made or closed"


def main() -> int:
    # the protocol keeps the process's own stdin and stdout; what the user's code prints goes to stderr
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    answers.write(encode(Started()))
    answers.flush()
    first = requests.readline()
    if not first:
        return 0
    factory, error = load(parse(first, Load))
    answers.write(encode(Loaded(loaded=error is None, error=error)))
    answers.flush()
    if factory is None:
        return 0
    loop = asyncio.new_event_loop()
    host = Host(answers, factory)

    def read() -> None:
        for line in requests:
            loop.call_soon_threadsafe(host.take, parse(line, Request))
        loop.call_soon_threadsafe(loop.stop)  # the harness closed its end: the run is over

    threading.Thread(target=read, name="requests", daemon=True).start()
    loop.run_forever()
    sys.stderr.flush()
    os._exit(0)  # a user's call still running on a thread of its own is not waited for


if __name__ == "__main__":
    sys.exit(main())
