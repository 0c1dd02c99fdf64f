"""The environments users already have, behind the contract's ``TextEnvironment`` (one instance an
episode, in a process the harness starts: ``host.py``), loaded from the spec's ``entry`` (``package.module:callable``,
called with ``params``) and spoken to as its ``adapter`` says:

* ``gymnasium``: a text environment with gymnasium's interface, as GEM's environments have it:
  ``reset(seed=...) -> (observation, info)`` and ``step(text) -> (observation, reward, terminated,
  truncated, info)``. ``entry`` makes one (``gem:make`` with ``{env_id: ...}``). (TextArena's own
  environments speak another interface, ``reset(num_players)``, ``get_observation()``, ``step(action) ->
  (done, info)``: a small ``text`` wrapper, or GEM's ports of its games.)
* ``tasks``: a set of verifiable single-turn tasks with its scoring function, as reasoning-gym
  generates them offline: ``len(tasks)``, ``tasks[i]`` a dict with the ``question``, and
  ``tasks.score_answer(answer, entry) -> float``. ``entry`` makes the set, once
  (``reasoning_gym:create_dataset`` with ``{name: ..., size: ..., seed: ...}``); an episode's task seed
  picks ``tasks[seed % len(tasks)]``, and the score is the reward.
* ``text``: ``entry`` makes an object that is a ``TextEnvironment`` itself (async ``reset``/``step``).

A user's environment runs in a process of its own (``host.py``, started by ``hosted.py``: its actions are
text a candidate produced), there in threads, so a slow step never stalls that process's loop: a
gymnasium environment on one thread of its own from its making to its close (``UserThread``: some belong
to the thread that made them), a task set's calls each on a fresh one (``in_user_thread``: its tasks are
shared and read-only). Every failure to load, make or run one names the entry (``UserEnvironmentError``):
a user's mistake is a message, never a traceback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import inspect
import numbers
import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy

from targets.api import TextEnvironment, TextStep
from targets.errors import UserError

ADAPTERS = ("gymnasium", "tasks", "text")


MAX_RUNNING = 1024  # calls at once: more than any batch runs, fewer than a process's thread limit
RUNNING = threading.BoundedSemaphore(MAX_RUNNING)


async def in_user_thread(function: Callable, *args, **kwargs) -> Any:
    """``function``'s result, computed in a daemon thread of its own: apart from the pool the harness
    saves weights on (a slow step never queues the harness's work, nor is queued behind it and timed),
    and never joined, so a call that does not return is abandoned when its episode times out instead of
    holding the process open at its exit (a pool's threads are joined then)."""
    return await _answer(
        lambda call: threading.Thread(target=call, name="user-environment", daemon=True).start(), function, args, kwargs
    )


class UserThread:
    """The one thread an environment lives on: made, reset, stepped and closed there, in order. Some
    environments belong to the thread that made them (a sqlite connection, a sync Playwright browser),
    and a slow factory then keeps the harness's loop waiting no more than a slow step does. A daemon,
    never joined (a hung call abandons it, as ``in_user_thread``'s); ``stop`` ends it once the
    environment is closed."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    async def run(self, function: Callable, *args, **kwargs) -> Any:
        return await _answer(self._submit, function, args, kwargs)

    def _submit(self, call: Callable[[], None]) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, name="user-environment", daemon=True)
            self.thread.start()
        self.calls.put(call)

    def _serve(self) -> None:
        while (call := self.calls.get()) is not None:
            call()

    def call_blocking(self, function: Callable, *args) -> Any:
        """``function(*args)`` on this thread, waited for here (outside any event loop: the check of an entry)."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def call() -> None:
            try:
                done.set_result(function(*args))
            except BaseException as error:  # noqa: BLE001 - raised again below, in the caller's thread
                done.set_exception(error)

        self._submit(call)
        return done.result()

    def stop(self) -> None:
        if self.thread is not None:
            self.calls.put(None)


async def _answer(start: Callable[[Callable[[], None]], None], function: Callable, args: tuple, kwargs: dict) -> Any:
    """``function(*args, **kwargs)`` run by ``start`` on a thread, awaited on the harness's loop."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not answer.done():  # an abandoned call's answer goes nowhere
            answer.set_exception(error) if error is not None else answer.set_result(result)

    def call() -> None:
        try:
            result, error = function(*args, **kwargs), None
        except BaseException as raised:  # noqa: BLE001 - handed to whoever awaits it, never lost
            # as an Exception the step names: a future cannot hold a StopIteration, and a SystemExit,
            # KeyboardInterrupt or CancelledError of the user's code must not stop the harness's loop
            plain = isinstance(raised, Exception) and not isinstance(raised, StopIteration)
            result, error = None, raised if plain else RuntimeError(f"{type(raised).__name__}: {raised}")
        finally:
            RUNNING.release()
        with contextlib.suppress(RuntimeError):  # the loop closed while the call ran: no one waits
            loop.call_soon_threadsafe(settle, result, error)

    if not RUNNING.acquire(blocking=False):
        raise RuntimeError(
            f"{MAX_RUNNING} calls of the environment are still running (slow, or abandoned when their "
            "episodes timed out): it hangs"
        )
    start(call)
    return await answer


class UserEnvironmentError(UserError, ValueError):
    """A user environment that cannot be loaded, made or run (the message names its entry)."""


NOT_INSTALLED = "is not installed here"  # what a catalog listing shows as unavailable, not as broken
ENVS_EXTRA = ("gem", "reasoning_gym")  # the ecosystems' packages the envs extra installs (pyproject.toml)


def load_entry(entry: str) -> Callable:
    """The callable ``package.module:attribute`` names, imported here."""
    module_name, sep, attribute = entry.partition(":")
    if not sep or not module_name or not attribute:
        raise UserEnvironmentError(f"environment entry {entry!r}: write it as package.module:callable")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - the user's module (missing, or raising as it imports): named
        raise UserEnvironmentError(_import_failure(entry, module_name, error)) from None
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UserEnvironmentError(f"environment entry {entry!r}: {module_name} has no attribute {attribute}")
        target = getattr(target, part)
    if not callable(target):
        raise UserEnvironmentError(f"environment entry {entry!r}: {attribute} is not callable")
    return target


def _import_failure(entry: str, module_name: str, error: Exception) -> str:
    """Why the entry's module did not import: a package it needs that is not installed here (with the
    extra that installs it, for the ecosystems' own), or the module's own error."""
    if isinstance(error, ModuleNotFoundError):
        top, missing = module_name.partition(".")[0], error.name or module_name
        own = missing != top and (module_name + ".").startswith(missing + ".")  # the entry's own module is not there
        if not own:
            needed = "" if missing == top else f" (imported by {module_name})"
            extra = "; the envs extra installs it: pip install -e '.[envs]'" if top in ENVS_EXTRA else ""
            return f"environment entry {entry!r}: {missing} {NOT_INSTALLED}{needed}{extra}{_beside(missing)}"
    return f"environment entry {entry!r}: cannot import {module_name} ({type(error).__name__}: {error})"


def _beside(missing: str) -> str:
    """A module the user wrote in the folder they run in is no installed package: say how to import it."""
    top = missing.partition(".")[0]
    here = next((p for p in (Path(f"{top}.py"), Path(top) / "__init__.py") if p.is_file()), None)
    if here is None:
        return ""
    return (
        f"; {here} is in the working folder, which vibetrain does not import from: put that folder on "
        f"PYTHONPATH (PYTHONPATH=$PWD vibetrain ...) or install your package"
    )


def _gymnasium_factory(entry: str, factory: Callable, params: dict) -> Callable[[], GymnasiumText]:
    """Each episode's environment made on the thread it lives on; the one made to check the entry (on a
    thread of its own, as every later one) is the first episode's, with its thread."""
    thread = UserThread()
    try:
        made = thread.call_blocking(_make, entry, factory, params)
        _needs(entry, made, ("reset", "step"), "a gymnasium environment resets and steps")
        if any(inspect.iscoroutinefunction(getattr(made, method)) for method in ("reset", "step")):
            raise UserEnvironmentError(
                f"environment entry {entry!r} made a {type(made).__name__} with async reset/step: gymnasium's are "
                "plain calls (an async one is a text environment: adapter: text)"
            )
    except BaseException:
        thread.stop()
        raise
    first = [GymnasiumText(lambda: made, thread, made)]
    return lambda: first.pop() if first else GymnasiumText(lambda: _make(entry, factory, params))


def _make(entry: str, factory: Callable, params: dict) -> Any:
    try:
        inspect.signature(factory).bind(**params)
    except TypeError as error:
        raise UserEnvironmentError(f"environment entry {entry!r} does not take params {params}: {error}") from None
    except ValueError:  # a builtin without a signature: the call itself says
        pass
    try:
        return factory(**params)
    except Exception as error:  # noqa: BLE001 - the user's code raised: named, with what it said
        raise UserEnvironmentError(
            f"environment entry {entry!r} raised {type(error).__name__} making an environment: {error}"
        ) from None


def _needs(entry: str, made: Any, methods: tuple[str, ...], what: str) -> None:
    missing = [m for m in methods if not callable(getattr(made, m, None))]
    if missing:
        raise UserEnvironmentError(
            f"environment entry {entry!r} made a {type(made).__name__}, which has no {', '.join(missing)}: {what}"
        )


class GymnasiumText:
    """``TextEnvironment`` over a gymnasium-style text environment, made, reset, stepped and closed on
    a thread of its own (``UserThread``)."""

    def __init__(self, make: Callable[[], Any], thread: UserThread | None = None, env: Any = None) -> None:
        self.make, self.thread, self.env = make, thread or UserThread(), env  # env: one already made on thread

    async def reset(self, task: int) -> str:
        if self.env is None:
            self.env = await self.thread.run(self.make)
        result = await self.thread.run(self.env.reset, seed=task)
        return result[0] if isinstance(result, tuple) else result  # the episode refuses one that is no text

    async def step(self, action: str) -> TextStep:
        """The step's answer as it came (the episode checks the reward): a 4-tuple is the old gym API,
        whose single ``done`` gymnasium split in two, named rather than left to an unpacking error."""
        answer = await self.thread.run(self.env.step, action)
        if not isinstance(answer, tuple) or len(answer) != 5:
            got = f"a {len(answer)}-tuple" if isinstance(answer, tuple) else f"a {type(answer).__name__}"
            old = " (the old gym API's observation, reward, done, info)" if got == "a 4-tuple" else ""
            raise UserEnvironmentError(
                f"step returned {got}{old}: gymnasium's step returns (observation, reward, terminated, truncated, info)"
            )
        observation, reward, terminated, truncated, _ = answer
        for name, value in (("terminated", terminated), ("truncated", truncated)):
            if not isinstance(value, bool | numpy.bool_):  # "False" or None read as a bool would end or not end it
                raise UserEnvironmentError(f"step returned {name} {value!r}, not a bool")
        # the episode refuses what is no text; truncated alone is a limit of the environment's own
        return TextStep(observation, reward, bool(terminated or truncated), bool(truncated and not terminated))

    async def close(self) -> None:
        """gymnasium's ``close()``, where the environment has one: what it holds (a subprocess, a socket)
        is let go; then its thread ends."""
        try:
            if self.env is not None and callable(getattr(self.env, "close", None)):
                await self.thread.run(self.env.close)
        finally:
            self.thread.stop()


class TaskSet:
    """``TextEnvironment`` over a set of verifiable tasks: one turn, its score the reward."""

    def __init__(self, tasks: Any) -> None:
        self.tasks, self.entry = tasks, None

    async def reset(self, task: int) -> str:
        """The task's question, picked in a thread as a step is scored (a set may make its tasks as it is
        indexed, and a slow one must not stall the harness's loop)."""
        self.entry = await in_user_thread(self._pick, task)
        return self.entry["question"]  # the episode refuses one that is no text

    def _pick(self, task: int) -> Any:
        index = task % len(self.tasks)
        entry = self.tasks[index]
        if not isinstance(entry, Mapping) or "question" not in entry:
            raise UserEnvironmentError(f"task {index} is a {type(entry).__name__} with no 'question'")
        return entry

    async def step(self, action: str) -> TextStep:
        score = await in_user_thread(self.tasks.score_answer, action, self.entry)
        if not isinstance(score, numbers.Real):  # a None read as 0 would train on a reward nobody gave
            raise UserEnvironmentError(f"score_answer returned {score!r}, not a number")
        return TextStep("", score, True)


def environment_factory(entry: str, adapter: str, params: dict) -> Callable[[], TextEnvironment]:
    """What makes one episode's environment, checked now by making one (a task set is made once and
    shared: its tasks are read-only)."""
    if adapter not in ADAPTERS:
        raise UserEnvironmentError(f"environment adapter {adapter!r}: known adapters are {', '.join(ADAPTERS)}")
    factory = load_entry(entry)
    if adapter == "gymnasium":
        return _gymnasium_factory(entry, factory, params)
    made = _make(entry, factory, params)
    if adapter == "tasks":
        _needs(entry, made, ("__len__", "__getitem__", "score_answer"), "a task set is indexed and scores answers")
        try:  # the user's len(): its own failure (reasoning-gym's size -5) is named as the entry's, no traceback
            size = len(made)
        except (TypeError, ValueError, OverflowError) as error:
            raise UserEnvironmentError(
                f"environment entry {entry!r} made a task set whose len() fails ({error}): check its params"
            ) from None
        if not size:
            raise UserEnvironmentError(f"environment entry {entry!r} made an empty task set")
        return lambda: TaskSet(made)
    first = [made]  # the instance made to check the entry is the first episode's

    def fresh() -> Any:
        return first.pop() if first else _make(entry, factory, params)

    if not all(inspect.iscoroutinefunction(getattr(made, method, None)) for method in ("reset", "step")):
        raise UserEnvironmentError(
            f"environment entry {entry!r} made a {type(made).__name__}: a text environment has async "
            "reset(task) and step(action) (targets.api.TextEnvironment)"
        )
    close = getattr(made, "close", None)
    if close is not None and not inspect.iscoroutinefunction(close):
        raise UserEnvironmentError(
            f"environment entry {entry!r} made a {type(made).__name__} whose close() is not async: a text "
            "environment's close, where it has one, is a coroutine (targets.api.TextEnvironment)"
        )
    return fresh
