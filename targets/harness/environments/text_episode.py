"""An episode of a user's environment (``targets.api.TextEnvironment``, made by an adapter): the
harness's ``Episode`` with the environment's own text, reward, end and time. Observations are
rendered with the model's chat template (``ChatFormat``); the environment reads each action as the
model's text. The environment's own time is the step's latency (nothing is added), and every reset
and step is in the trace like a built-in environment's."""

from __future__ import annotations

import asyncio
import math
import numbers
import random
from collections.abc import Awaitable
from typing import Any

import numpy
from pydantic import BaseModel, ConfigDict

from targets.api import StepResult, TextEnvironment, TextStep, TokenIds
from targets.harness.environments.adapters import UserEnvironmentError
from targets.harness.environments.base import Episode
from targets.harness.environments.chat_format import ChatFormat

HUNG = object()  # what ``_call`` returns for a call that did not answer in time
TIMEOUT_MARGIN_S = 0.01  # waited past the trajectory's deadline, so the harness clock sees it passed
CLOSE_LIMIT_S = 30.0  # how long an environment's close() may take


async def _named_exit(call: Awaitable) -> Any:
    """The user's coroutine, a ``sys.exit()`` in it named as the error it is: asyncio lets a
    SystemExit out of a task stop the harness's event loop (a thread's is named by ``in_user_thread``)."""
    try:
        return await call
    except SystemExit as error:
        raise RuntimeError(f"SystemExit: {error}") from None


class UserParams(BaseModel):
    model_config = ConfigDict(extra="allow")  # the user's entry takes them (checked when it is made)


class TextEpisode(Episode):
    name = "user"
    Params = UserParams
    asynchronous = True

    def __init__(self, *, environment: TextEnvironment, chat: ChatFormat, entry: str, **kwargs) -> None:
        self.environment, self.chat, self.entry = environment, chat, entry
        self.closed = False
        self.abandoned: asyncio.Future | None = None  # a call not answered in time (cancelled; a thread runs on)
        self.running: asyncio.Future | None = None  # a call the run's end cut off waiting for, still answering
        super().__init__(**kwargs)

    async def close(self) -> None:
        """The environment's ``close()``, once, where it has one: as the episode ends, or at the run's end
        for an episode that never did, once a call the run's end cut off has answered. Never under a call
        still running in it (a gymnasium environment is not safe to close under its own step): one that
        has not answered within ``CLOSE_LIMIT_S`` of the run's end is left. One abandoned as hung is closed
        behind it, not waited for: once its cancelled call is done (a coroutine's cleanup over; a thread's
        call goes on, and an adapter's close queues behind it on the environment's own thread,
        ``UserThread``). Returning without a close leaked what the environment holds at every timeout (a
        review of user environments)."""
        close = getattr(self.environment, "close", None)
        if self.closed or close is None:
            return
        if self.abandoned is not None:
            self.closed = True

            def closing(_: asyncio.Future) -> None:  # what it says goes nowhere: the episode is over
                asyncio.ensure_future(_named_exit(close())).add_done_callback(lambda c: c.cancelled() or c.exception())

            if self.abandoned.done():
                closing(self.abandoned)
            else:
                self.abandoned.add_done_callback(closing)
            await asyncio.sleep(0)  # a close begun runs its first step: an adapter's is queued on its thread
            return
        if self.running is not None:
            done, _ = await asyncio.wait({self.running}, timeout=CLOSE_LIMIT_S)
            if not done:
                return
            if not self.running.cancelled():
                self.running.exception()  # what it answered goes nowhere: the episode was over
        self.closed = True
        if await self._call(close(), "closing", CLOSE_LIMIT_S) is HUNG:
            raise UserEnvironmentError(
                f"environment {self.entry} did not close {self.episode_id} within {CLOSE_LIMIT_S:g} s: a hung close()"
            )

    def make_task(self, rng: random.Random) -> int:
        """The seed the environment resets from (a group's members share it: one task)."""
        return rng.randrange(2**31)

    def _latency(self) -> tuple[float, int]:
        return 0.0, 0  # the environment's own time is the step's

    async def _call(self, call: Awaitable, doing: str, limit: float) -> Any:
        """The environment's answer, or ``HUNG`` when none came within ``limit`` seconds (the call is
        abandoned: a thread cannot be stopped). Whatever the user's code raised is named."""
        answering = asyncio.ensure_future(_named_exit(call))
        try:
            done, _ = await asyncio.wait({answering}, timeout=limit)
        except asyncio.CancelledError:  # the run ended under it: the call answers on, closing waits for it
            self.running = answering
            # read when it answers, whether or not a close still waits for it (what it raised goes nowhere:
            # asyncio would print it as a task exception never retrieved, after the run's own error)
            answering.add_done_callback(lambda call: call.cancelled() or call.exception())
            raise
        if not done:
            answering.cancel()
            self.abandoned = answering
            return HUNG
        if answering.cancelled():  # the user's own coroutine cancelled itself
            raise UserEnvironmentError(f"environment {self.entry} was cancelled {doing} {self.episode_id}")
        try:
            return answering.result()
        except UserEnvironmentError as error:  # the adapter's word on what the environment answered
            raise UserEnvironmentError(f"environment {self.entry} {doing} {self.episode_id}: {error}") from None
        except Exception as error:  # noqa: BLE001 - the user's code: named, never a traceback of ours
            raise UserEnvironmentError(
                f"environment {self.entry} raised {type(error).__name__} {doing} {self.episode_id}: {error}"
            ) from None

    async def reset(self) -> TokenIds:
        self._start()
        self.stepping = True  # until the environment has answered: a step now is the controller's error
        limit = self.workload.trajectory_timeout_s
        observation = await self._call(self.environment.reset(self.task), "resetting", limit)
        if observation is HUNG:
            raise UserEnvironmentError(
                f"environment {self.entry} did not reset {self.episode_id} within the trajectory timeout "
                f"({limit:g} s): a hung environment"
            )
        self.stepping = False
        if not isinstance(observation, str):  # a repr (None, a dict, an array) is no prompt to train on
            raise UserEnvironmentError(
                f"environment {self.entry} began {self.episode_id} with observation {observation!r:.200}, a "
                f"{type(observation).__name__}, not a str: a text environment's observations are text"
            )
        prompt = self.chat.first(observation)
        tokens = self.workload.tokens
        if len(prompt) + tokens.response > tokens.max_sequence:  # no turn would fit: said, not cut
            raise UserEnvironmentError(
                f"environment {self.entry} began {self.episode_id} with {len(prompt)} tokens: with a response's "
                f"{tokens.response} they pass the context (workload.tokens.max_sequence {tokens.max_sequence})"
            )
        return self._reset_with(prompt)

    async def step(self, action: TokenIds) -> StepResult:
        """The environment's answer; one that does not come before the trajectory's time is up ends the
        episode as timed out (as a built-in environment's slow step does), its call abandoned."""
        self.begin_step()
        started = self.clock.now()
        left = self.workload.trajectory_timeout_s - (started - self.started_at)
        if left <= 0:  # the trajectory's time is already up: the environment is not asked
            return self.end_step(action, 0.0, 0, ("timeout", 0.0, True, False))
        doing = f"at turn {self.turn + 1} of"
        answer = await self._call(self.environment.step(self.chat.text(action)), doing, left + TIMEOUT_MARGIN_S)
        if answer is HUNG:
            return self.end_step(action, self.clock.now() - started, 0, ("timeout", 0.0, True, False))
        return self.end_step(action, self.clock.now() - started, 0, self._checked(answer))

    def _checked(self, answer: Any) -> tuple[str, float, bool, bool]:
        """A step's answer as the episode records it: a ``TextStep`` of text, a finite reward (a NaN would
        reach the candidate's loss as a null) and bools, or an error naming the field."""
        if not isinstance(answer, TextStep):
            raise UserEnvironmentError(
                f"environment {self.entry} answered a step of {self.episode_id} with a {type(answer).__name__}, "
                "not a targets.api.TextStep"
            )
        reward, done, truncated = answer.reward, answer.done, answer.truncated
        ended = isinstance(done, bool | numpy.bool_) and bool(done)  # the last observation is never read
        wrong = (
            f"done {done!r}, not a bool"
            if not isinstance(done, bool | numpy.bool_)
            else f"truncated {truncated!r}, not a bool"
            if not isinstance(truncated, bool | numpy.bool_)
            else f"truncated {truncated!r} with done {done!r}: a truncated episode has ended"
            if truncated and not ended
            else f"observation {answer.observation!r}, not a str"
            if not isinstance(answer.observation, str) and not ended
            else f"reward {reward!r}, not a finite number"
            if not isinstance(reward, numbers.Real) or not math.isfinite(reward)
            else None
        )
        if wrong is not None:
            raise UserEnvironmentError(
                f"environment {self.entry} answered turn {self.turn + 1} of {self.episode_id} with {wrong}"
            )
        text = answer.observation if isinstance(answer.observation, str) else ""
        return text, float(reward), bool(done), bool(truncated)

    def observe(self, text: str, action: TokenIds) -> TokenIds:
        return self.chat.next(text, stopped_on=int(action[-1]) if len(action) else None)
