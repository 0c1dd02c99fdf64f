"""The process a user's environment runs in, started by the harness (``hosted.py``) and spoken to in
messages (``wire.py``): it makes, resets, steps and closes environments through their adapter
(``adapters.py``) as the harness asks, and answers with what they said.

Why a process of its own: the actions are text a candidate's engine produced, and an environment or
scorer that evaluates its action as code (a sympy parse, an ``eval``, a tool call) runs that text. In
the harness's process it could reach the trace, the clock and the weights before the audit read them;
here it reaches this process alone, and under bubblewrap it sees no harness process and no run folder
(``Sandbox.wrap_environment``).

The protocol, one JSON object a line: the first message loads the entry (``{"entry", "adapter",
"params"}``, the params pickled: the user's own values; the answer says whether it could be made); then
``{"op": "make", "env"}`` (unanswered: an episode's environment made, what the factory raised raised by
its first call) and ``{"id", "op", "env", ...}`` with ``op`` ``reset`` (``task``), ``step``
(``action``), ``close``, ``check`` (make one and close it: what checking an entry does) and ``cancel``
(``call``: the id of a call the harness stopped waiting for). Each call is answered ``{"id", "ok":
value}``, ``{"id", "error": {"user": message}}`` (the adapter's word), ``{"id", "error": {"type",
"message"}}`` (what the user's code raised) or ``{"id", "cancelled": true}``. The process ends when the
harness closes its input."""

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
from targets.harness.environments.wire import decode, encode, to_wire


class Host:
    """The environments of one entry, each by the number the harness gave it."""

    def __init__(self, answers: BinaryIO, factory) -> None:
        self.answers, self.factory = answers, factory
        self.environments: dict[int, Any] = {}
        self.unmade: dict[int, BaseException] = {}  # what the factory raised making an environment
        self.calls: dict[int, asyncio.Task] = {}
        self.running: dict[int, set[asyncio.Task]] = {}  # an environment's calls under way (a cancelled one too)
        self.writing = threading.Lock()

    def send(self, message: dict) -> None:
        with self.writing:
            self.answers.write(encode(message))
            self.answers.flush()

    def take(self, message: dict) -> None:
        """One request, on the event loop: a call runs as a task of its own (an environment's calls run
        beside another's), a cancel stops the call it names."""
        if message["op"] == "cancel":
            call = self.calls.get(message["call"])
            if call is not None:
                call.cancel()
            return
        if message["op"] == "make":  # unanswered: what the factory raised is raised by the environment's calls
            try:
                self.environments[message["env"]] = self.factory()
            except BaseException as error:  # noqa: BLE001 - raised again by the first call of that environment
                self.unmade[message["env"]] = error
            return
        call = self.calls[message["id"]] = asyncio.get_running_loop().create_task(self.serve(message))
        if "env" in message:
            running = self.running.setdefault(message["env"], set())
            running.add(call)
            call.add_done_callback(running.discard)

    async def serve(self, message: dict) -> None:
        number = message["id"]
        try:
            answer: dict = {"id": number, "ok": await self.run(message)}
        except asyncio.CancelledError:  # the harness stopped waiting, or the user's coroutine cancelled itself
            answer = {"id": number, "cancelled": True}
        except UserEnvironmentError as error:
            answer = {"id": number, "error": {"user": str(error)}}
        except SystemExit as error:  # named as the harness named it in its own loop: it never ends this one
            answer = {"id": number, "error": {"type": "RuntimeError", "message": f"SystemExit: {error}"}}
        except BaseException as error:  # noqa: BLE001 - the user's code raised: sent to the harness, which names it
            answer = {"id": number, "error": {"type": type(error).__name__, "message": str(error)}}
        finally:
            self.calls.pop(number, None)
        self.send(answer)

    async def run(self, message: dict) -> Any:
        op, number = message["op"], message.get("env")
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
            return to_wire(await self.environments[number].reset(message["task"]))
        if op == "step":
            answer = await self.environments[number].step(message["action"])
            if not isinstance(answer, TextStep):
                return {"not_a_step": to_wire(answer)}
            return {
                "step": [
                    to_wire(answer.observation),
                    to_wire(answer.reward),
                    to_wire(answer.done),
                    to_wire(answer.truncated),
                ]
            }
        raise ValueError(f"the environment host has no operation {op!r}")


def load(message: dict):
    """The entry's factory (an environment made to check it), or the error that says why it cannot be."""
    params = pickle.loads(base64.b64decode(message["params"]))  # the harness's own message: the user's params
    try:
        return environment_factory(message["entry"], message["adapter"], params), None
    except UserEnvironmentError as error:
        return None, str(error)
    except SystemExit as error:
        return None, f"environment {message['entry']}: called sys.exit({error.code!r}) when made or closed"


def main() -> int:
    # the protocol keeps the process's own stdin and stdout; what the user's code prints goes to stderr
    requests, answers = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    first = requests.readline()
    if not first:
        return 0
    factory, error = load(decode(first))
    answers.write(encode({"loaded": error is None, "error": error}))
    answers.flush()
    if factory is None:
        return 0
    loop = asyncio.new_event_loop()
    host = Host(answers, factory)

    def read() -> None:
        for line in requests:
            loop.call_soon_threadsafe(host.take, decode(line))
        loop.call_soon_threadsafe(loop.stop)  # the harness closed its end: the run is over

    threading.Thread(target=read, name="requests", daemon=True).start()
    loop.run_forever()
    sys.stderr.flush()
    os._exit(0)  # a user's call still running on a thread of its own is not waited for


if __name__ == "__main__":
    sys.exit(main())
