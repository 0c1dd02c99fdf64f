"""The harness's end of the controller process (``ControllerLink``): it serves the controller's environment
and cluster calls as each arrives, stamps nothing itself (the ``TracedCluster`` and the environments do), counts
what each episode has under way (``episode_activity.py``), and under virtual time tells the loop whether the
controller is idle (``IdlePeer``). ``drive.py`` runs a system run around it."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from targets.api import (
    Aborted,
    Completion,
    Declared,
    EngineSettings,
    GenerateRequest,
    StepResult,
    TokenCount,
    TokenIds,
)
from targets.errors import UserError
from targets.harness.environments import EnvironmentPool, Episode, close_environments
from targets.harness.ipc.channel import AsyncChannel, Frame, Received
from targets.harness.ipc.protocol import ProtocolError
from targets.harness.ipc.remote import CandidateError
from targets.harness.ipc.wire import (
    PromptMemory,
    field_of,
    get_batch,
    get_declared,
    get_engine_settings,
    get_request,
    get_tokens,
    put_aborted,
    put_completion,
    put_step_result,
    put_tokens,
)
from targets.harness.isolation.episode_activity import EpisodeActivity
from targets.harness.isolation.traced_cluster import Generating, TracedCluster
from targets.harness.sim.engine import simulated_response

FLIGHT_MARGIN = 2  # of the audit's in-flight bound (``check_in_flight``): what the link refuses outright


class ControllerLink:
    """The harness's end of the controller process: serves its environment and cluster calls, each
    as it arrives, and under virtual time tracks whether it is idle (``IdlePeer``)."""

    def __init__(
        self, channel: AsyncChannel, envs: EnvironmentPool, clock, virtual: bool, vocab: int | None = None
    ) -> None:
        self.channel, self.envs, self.clock, self.virtual = channel, envs, clock, virtual
        self.vocab = vocab  # a real run's: the ids a step's action may hold (``_action``)
        self.cluster: TracedCluster | None = None  # set by ``open`` once the controller said hello
        # environment and cluster calls that came before ``open``: served then, in order, so nothing
        # the controller asks starts before the run does (a reward model's judges load in between)
        self._held: list[Received] = []
        self.memory = PromptMemory(counts=virtual)  # a simulated run keeps token counts only
        self.episodes: dict[str, Any] = {}
        self._settled: set[str] = set()  # episodes trained (their step called) or dropped: out of flight
        self.activity = EpisodeActivity(clock.now)  # what each episode has under way, and how long it sat idle
        self.declared = Declared()  # what the controller's hello declares
        self.engine = EngineSettings()  # what the simulator models of its engines (the hello says)
        # a reward model's: judge(episode, then) as the episode's last step ends; then(score) with the verdict
        self.judge: Callable[[Episode, Callable[[float], None]], None] | None = None
        loop = asyncio.get_running_loop()
        self.hello: asyncio.Future = loop.create_future()
        self.done: asyncio.Future = loop.create_future()
        self._idle_received, self._deadline = -1, None
        self.waits = 0  # idle notices: how often the harness waited on the controller (round trips)
        self._numbers = itertools.count()  # numbers the calls under way
        self._tasks: dict[int, asyncio.Task] = {}  # cluster calls being answered, by number
        # generate calls under way, by episode (a drop cancels its own at one look), then by number: the controller's id
        self._generating: dict[str, dict[int, tuple[Any, Generating]]] = {}
        self._steps: dict[int, asyncio.TimerHandle] = {}  # environment steps and checkpoints under way, by number

    # -- IdlePeer ------------------------------------------------------------------------------------
    def idle_until(self) -> tuple[bool, float | None]:
        return self._idle_received == self.channel.sent, self._deadline

    def wake(self, now: float) -> None:
        self.send(Frame(kind="time"))

    def flush(self) -> None:
        self.channel.flush()

    def _on_idle(self, received: int, deadline: float | None) -> None:
        """The controller's idle notice (the end of its burst): it has taken in ``received`` frames."""
        self._idle_received, self._deadline = received, deadline
        self.waits += 1

    # -- frames ----------------------------------------------------------------------------------------
    def send(self, frame: Frame) -> None:
        """A frame for the controller; dropped once it is done: nobody waits for an answer the run's end
        overtook (a step's timer or a verdict due in the loop turn that read the controller's last frame,
        when its socket may already be closed). Dropped too while its channel closes: the controller
        exited, a write failed, and the channel's loss, due in this loop turn, ends the run with what
        the controller sent last (its "done", or that it hung up before it), not this answer."""
        if self.done.done() or self.channel.closing:
            return
        if self.virtual:
            frame.header["t"] = self.clock.now()
        self.channel.send(frame)

    def fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)

    async def serve(self) -> None:
        """Serve frames until the controller is done (or fails, or breaks the protocol)."""
        self.channel.listen(self._on_frame, self._on_lost, self._on_idle)
        try:
            await self.done
        finally:
            for step in self._steps.values():
                step.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            unclosed = await self._close_environments()
        if unclosed:  # the run itself succeeded: an environment that would not close still fails it
            raise unclosed[0]

    def _on_frame(self, rx: Received) -> None:
        if self.done.done():
            return
        try:
            self._dispatch(rx)
        except ProtocolError as error:
            self.fail(ProtocolError(f"the controller process broke the protocol: {error}"))

    def _on_lost(self, error: BaseException) -> None:
        self.fail(ProtocolError(f"the controller process hung up before it was done: {error}"))

    def _dispatch(self, rx: Received) -> None:
        kind = rx.get("kind")
        if kind in ("env", "cluster") and self.cluster is None:
            if kind == "cluster" and not self.hello.done():
                raise ProtocolError("a cluster call before the controller's hello")
            self._held.append(rx)
        elif kind == "hello":
            if not self.hello.done():
                self.declared = get_declared(field_of(rx.header, "declared", dict, "hello"))
                self.engine = get_engine_settings(field_of(rx.header, "engine", dict, "hello"))
                refused = self.envs.workload.over_declared_limits(self.declared)
                if refused:
                    raise ProtocolError(refused)
                # before the controller's first new_group, which may follow in the same burst
                self.envs.max_extra = self.declared.redundant_per_group
                self.hello.set_result(rx)
        elif kind == "done":
            if self.cluster is not None and self.cluster.training:
                # a step's train event is recorded before its export: a controller that polled for the new
                # version (sync_weights answers once it exists) and said done here ended the run one export
                # early, the last step counted and its weights never exported nor its time charged
                raise ProtocolError(
                    f"it said it was done while training step {self.cluster.steps} was under way: a run ends once "
                    "every training call it made has returned (the step's weights exported)"
                )
            if not self.done.done():
                self.done.set_result(None)
        elif kind == "failed":
            error = rx.get("error") or {}
            raised = f"the controller raised {error.get('type')}: {error.get('message')}\n"
            self.fail(CandidateError(raised + str(error.get("traceback", ""))[-3000:]))
        elif kind == "env" and rx.get("method") == "new_group":
            group = field_of(rx.header, "group", int, "new_group")
            if group != self.envs.groups_created:
                raise ProtocolError(
                    f"the controller numbered a new group {group}, the harness's next is {self.envs.groups_created}"
                )
            relaunch = rx.get("relaunch")
            if relaunch is not None and not isinstance(relaunch, str):
                raise ProtocolError(f"new_group.relaunch: expected a group id or null, got {relaunch!r}")
            extra = field_of(rx.header, "extra", int, "new_group")
            self._refuse_past_the_flight(extra)
            try:
                episodes = self.envs.new_group(extra, relaunch)
            except UserError as error:  # the user's environment would not be made: its failure, not the candidate's
                self.fail(error)
                return
            except ValueError as error:
                raise ProtocolError(str(error)) from None
            for episode in episodes:
                self.episodes[episode.episode_id] = episode
                self.activity.created(episode.episode_id)
        elif kind == "env" and rx.get("method") == "drop":
            episode = field_of(rx.header, "episode", str, "drop")
            self.memory.forget(episode)
            idle = self.activity.of(episode)
            try:
                self.envs.drop(episode, field_of(rx.header, "reason", str, "drop"), idle)
            except ValueError as error:
                raise ProtocolError(str(error)) from None
            self._settled.add(episode)
            self._cancel_turns(episode)
        elif kind == "env":
            self._env(rx)
        elif kind == "cluster":
            # Tokens travel as deltas against the episode's last prompt: decode them now, in arrival
            # order, before a drop later in the same burst (a cancelled spare) forgets that prompt.
            tokens = self._decode_tokens(rx)
            if rx.get("method") in ("train", "train_part"):  # out of flight as the step takes them (the audit's)
                # the harness's own episodes only: ids of a batch's own making would otherwise free room
                self._settled.update(t.episode_id for t in tokens.trajectories if t.episode_id in self.episodes)
            self._call(rx, tokens)
        else:
            raise ProtocolError(f"unknown frame kind {kind!r}")

    def _refuse_past_the_flight(self, extra: int) -> None:
        """A new group past ``FLIGHT_MARGIN`` times the audit's in-flight bound is a protocol break: the audit
        would reject the run anyway, and until then each episode is an environment made (a user's, whose
        failure to make thousands would be blamed on it)."""
        size, bound = self.envs.workload.group_size + extra, self.envs.workload.in_flight_bound(self.declared)
        outstanding = len(self.episodes) - len(self._settled)
        if outstanding + size > FLIGHT_MARGIN * bound:
            raise ProtocolError(
                f"new_group: {outstanding} episodes in flight and {size} more, over "
                f"{FLIGHT_MARGIN} times the bound of {bound} the audit holds a run to"
            )

    def _decode_tokens(self, rx: Received):
        """A generate call's request or a train (or train_part) call's batch (both carry prompt deltas), else None."""
        method = rx.get("method")
        try:
            if method == "generate":
                return get_request(rx, field_of(rx.header, "request", dict, "generate"), self.memory)
            if method in ("train", "train_part"):
                return get_batch(rx, field_of(rx.header, "batch", dict, method), self.memory)
        except ValueError as error:  # a sampling or batch field the contract's own types refuse
            raise ProtocolError(str(error)) from None
        return None

    def open(self, cluster: TracedCluster) -> None:
        """Serve calls on ``cluster`` from now on: the run has started. The calls that came before
        are served first, in the order they came (a drop after a generate forgets its prompt after)."""
        self.cluster = cluster
        held, self._held = self._held, []
        for rx in held:
            self._on_frame(rx)

    def _call(self, rx: Received, tokens) -> None:
        key = next(self._numbers)
        if rx.get("method") == "generate":
            self._generate(rx.get("id"), tokens, key)
        else:
            self._tasks[key] = asyncio.create_task(self._answer(rx, tokens, key))

    def _generate(self, request_id: Any, request: GenerateRequest, key: int) -> None:
        """Answer a generate call when the cluster has served it (a callback, not a task a turn). A turn is
        asked once at a time: a second request for it while one is under way is refused (a cluster could
        answer whichever draw it liked and leave the others unanswered, unrecorded)."""
        for _, other in self._generating.get(request.episode_id, {}).values():
            if other.request.turn == request.turn and other.under_way:
                message = (
                    f"episode {request.episode_id} turn {request.turn} is being generated already (asked at "
                    f"{other.start:.2f}s): a turn is asked again only once its request has been answered"
                )
                self.send(Frame(id=request_id, error={"type": "ValueError", "message": message}))
                return
        self.activity.begin(request.episode_id, generate=True)

        def done(result: Completion | BaseException) -> None:
            self._tasks.pop(key, None)
            turns = self._generating.get(request.episode_id)
            if turns is not None and turns.pop(key, None) is not None and not turns:
                del self._generating[request.episode_id]
            self.activity.end(request.episode_id, generate=True)
            if self.done.done():
                return  # the run is over: nobody waits for this answer
            try:
                if isinstance(result, BaseException):
                    reply = self._error_reply(request_id, result)
                else:
                    reply = Frame(id=request_id)
                    reply.header["completion"] = put_completion(reply, result, self.memory.counts)
            except Exception as error:  # noqa: BLE001 - a harness bug: the run fails with it, loudly
                self.fail(error)
                return
            if reply is not None:
                self.send(reply)

        generating = self.cluster.generate_then(request, done)
        if generating.under_way:  # not answered at once (a request no engine can take is)
            self._generating.setdefault(request.episode_id, {})[key] = (request_id, generating)
        if generating.task is not None:
            self._tasks[key] = generating.task

    def _cancel_turns(self, episode: str) -> None:
        """The episode was dropped: a turn of it the cluster still serves is stopped (nobody will train
        it; a cancelled spare decoded on to its turn's end, holding its engine's batch and KV), and the
        controller, should it still wait for that turn, is told."""
        for key, (request_id, generating) in self._generating.pop(episode, {}).items():
            if generating.cancel():
                self._tasks.pop(key, None)  # a candidate cluster's call: cancelled, it ends on its own
                self.activity.end(episode, generate=True)
                turn = generating.request.turn
                message = f"episode {episode} was dropped while its turn {turn} generated: the turn was cancelled"
                self.send(Frame(id=request_id, error={"type": "RuntimeError", "message": message}))

    async def _answer(self, rx: Received, tokens, key: int) -> None:
        """Answer one cluster call (a task of its own: it takes the cluster's time)."""
        request_id = rx.get("id")
        try:
            reply = Frame(id=request_id)
            await self._cluster(rx, reply, tokens)
        except Exception as error:  # noqa: BLE001 - _error_reply sorts out what the controller is told
            reply = self._error_reply(request_id, error)
        finally:
            del self._tasks[key]  # here, not in a done callback: one loop turn less per call
        if reply is not None:
            self.send(reply)

    def _error_reply(self, request_id: Any, error: Exception) -> Frame | None:
        """What the controller is told of a call that raised, as it would be in-process; None (and
        the run fails) when the call broke the protocol, or when the error is none a call may raise:
        the harness's own bug, which fails the run with it (raised here, in a task nobody awaits, it
        would leave the controller waiting for an answer until the run's time limit)."""
        if isinstance(error, ProtocolError):
            self.fail(ProtocolError(f"the controller process broke the protocol: {error}"))
            return None
        if isinstance(error, Aborted):  # its partial response only goes to a stack that declared it resumes them
            frame = Frame(id=request_id)
            partial = error if self.declared.partial_rollout else Aborted(str(error))
            frame.header["error"] = put_aborted(frame, partial, self.memory.counts)
            return frame
        if isinstance(error, (CandidateError, ValueError, KeyError, PermissionError, RuntimeError)):
            # the candidate's own cluster raised, or the controller misused the contract: it is told, as in-process
            kind = "RuntimeError" if isinstance(error, CandidateError) else type(error).__name__
            return Frame(id=request_id, error={"type": kind, "message": str(error)[:2000]})
        self.fail(error)
        return None

    def _env(self, rx: Received) -> None:
        """A reset, a step or a checkpoint is answered when its time has passed (a timer, not a task; a reset
        of a workload without ``env_reset_s`` at once)."""
        request_id, counts = rx.get("id"), self.memory.counts
        reply = Frame(id=request_id)
        try:
            episode_id = field_of(rx.header, "episode", str, "env call")
            if episode_id not in self.episodes:
                raise KeyError(f"no episode {episode_id!r}: the harness never created it")
            episode = self.episodes[episode_id]
            if episode.asynchronous and rx["method"] in ("reset", "step"):  # a user's environment: its own time
                action = None
                if rx["method"] == "step":
                    action = self._action(rx)
                key = next(self._numbers)
                self._tasks[key] = asyncio.create_task(self._user_env(key, request_id, reply, episode, action))
                return
            if rx["method"] == "reset":
                seconds = episode.begin_reset()
                self.activity.begin(episode_id)

                def reset() -> None:
                    reply.header["observation"] = put_tokens(reply, episode.end_reset(), counts)
                    self.activity.end(episode_id)

                if not seconds:
                    reset()
                else:
                    self._answer_after(seconds, reply, reset)
                    return
            elif rx["method"] == "step":
                action = self._action(rx)
                if counts:  # what a simulated engine's response of that length says (the environment reads it)
                    action = simulated_response(episode_id, len(action))
                latency, failures = episode.begin_step()
                self.activity.begin(episode_id)

                def stepped() -> bool:
                    result = episode.end_step(action, latency, failures)
                    self.activity.end(episode_id, finished=result.done)
                    if not self._judged(result):
                        reply.header["result"] = put_step_result(reply, result, counts)
                        return False

                    def verdict(score: float) -> None:  # the judge's score joins the last turn's reward
                        judged = dataclasses.replace(result, reward=result.reward + score)
                        reply.header["result"] = put_step_result(reply, judged, counts)
                        self.send(reply)

                    self.judge(episode, verdict)
                    return True  # answered once the verdict is in

                self._answer_after(latency, reply, stepped)
                return
            elif rx["method"] == "checkpoint":
                # the first since the episode's last step is work on it; another at the same turn saves
                # nothing new, and would keep an episode the stack holds looking under way
                first = episode.checkpoint_turn < episode.turn
                seconds = episode.begin_checkpoint()
                if first:
                    self.activity.begin(episode_id)

                def checkpointed() -> None:
                    episode.end_checkpoint()
                    if first:
                        self.activity.end(episode_id)

                self._answer_after(seconds, reply, checkpointed)
                return
            else:
                raise ProtocolError(f"unknown env method {rx['method']!r}")
        except Exception as error:  # noqa: BLE001 - _error_reply sorts out what the controller is told
            reply = self._error_reply(request_id, error)
        if reply is not None:
            self.send(reply)

    def _action(self, rx: Received) -> TokenIds | TokenCount:
        """A step's action, refused (the controller's error) where it holds an id outside the model's
        vocabulary: a user's environment and the reward model read it through the tokenizer, whose failure
        would be blamed on them (and stop the search) instead of on the candidate."""
        action = get_tokens(rx, field_of(rx.header, "action", dict, "step"), self.memory.counts, "step.action")
        if self.vocab is not None and not isinstance(action, TokenCount):
            outside = next((t for t in action if not 0 <= t < self.vocab), None)
            if outside is not None:
                raise ValueError(f"step.action: token id {outside} is not in the model's vocabulary of {self.vocab}")
        return action

    async def _user_env(self, key: int, request_id: Any, reply: Frame, episode, action: TokenIds | None) -> None:
        """A reset (``action`` None) or a step of a user's environment, answered when it answers. A call
        the contract forbids (a second reset, a step after the end) is the controller's error; the
        environment raising ends the run with its message (the user's code, not the candidate's)."""
        self.activity.begin(episode.episode_id)
        under_way, ended = True, False
        try:
            if action is None:
                reply.header["observation"] = put_tokens(reply, await episode.reset(), self.memory.counts)
            else:
                result = await episode.step(action)
                self.activity.end(episode.episode_id, finished=result.done)  # a verdict may follow
                under_way, ended = False, result.done
                if self._judged(result):  # the judge's score joins the last turn's reward
                    verdict = asyncio.get_running_loop().create_future()
                    self.judge(episode, lambda score: None if verdict.done() else verdict.set_result(score))
                    result = dataclasses.replace(result, reward=result.reward + await verdict)
                reply.header["result"] = put_step_result(reply, result, self.memory.counts)
        except UserError as error:
            self._tasks.pop(key, None)
            self.fail(error)
            return
        except Exception as error:  # noqa: BLE001 - _error_reply sorts out what the controller is told
            reply = self._error_reply(request_id, error)
        finally:
            if under_way:  # a reset, or a call that raised
                self.activity.end(episode.episode_id)
        if reply is not None:
            self.send(reply)
        try:
            if ended:  # the episode's last turn is answered: what its environment holds is let go
                await episode.close()
        except UserError as error:
            self.fail(error)
        finally:
            self._tasks.pop(key, None)

    async def _close_environments(self) -> list[UserError]:
        """At the run's end, every user environment whose episode never ended (dropped, or under way)
        is closed; what a close raised, for the run to fail on."""
        return await close_environments(self.episodes.values())

    def _judged(self, result: StepResult) -> bool:
        """Whether a reward model judges the episode this step ended (it ended well)."""
        return self.judge is not None and result.done and not result.timed_out and not result.lost

    def _answer_after(self, seconds: float, reply: Frame, finish: Callable[[], bool | None]) -> None:
        """Send ``reply`` once ``seconds`` have passed, ``finish`` having ended the environment's work
        (and filled the reply; True: a reward model judges first, and ``finish`` sends it then): a
        timer, not a task, cancelled with the link if the run ends first."""
        key = next(self._numbers)

        def answer() -> None:
            del self._steps[key]
            if not finish():  # True: ``finish`` sends the reply itself, later
                self.send(reply)

        self._steps[key] = asyncio.get_running_loop().call_later(seconds, answer)

    async def _cluster(self, rx: Received, reply: Frame, tokens) -> None:
        """``tokens``: the generate request or train batch, decoded as the frame arrived."""
        cluster = self.cluster
        by_id, names = cluster.by_id, rx.get("devices")
        if names is not None and (not isinstance(names, list) or any(n not in by_id for n in names)):
            raise ValueError(f"unknown devices {names!r}; this cluster has {sorted(by_id)}")
        devices = [] if names is None else [by_id[n] for n in names]
        method = rx.get("method")
        if len(set(map(id, devices))) != len(devices):  # the simulator would count a device named twice twice
            raise ValueError(f"{method} names a device twice: {names}")
        if method in ("train", "train_part") and not devices:  # where it trains is what the mechanism rule reads
            raise ValueError(f"{method} names no device: a step trains on the devices it names")
        if method in ("shrink", "expand"):
            await getattr(cluster, method)(devices)
        elif method == "train":
            reply.header["version"] = await cluster.train(tokens, devices)
        elif method == "train_part":
            await cluster.train_part(tokens, devices)
        elif method == "sync_weights":
            await cluster.sync_weights(
                field_of(rx.header, "version", int, "sync_weights"),
                devices,
                interrupt=field_of(rx.header, "interrupt", bool, "sync_weights"),
            )
        elif method == "suspend":
            # suspended from the suspend's return (as the mechanism rule's window: a suspend that failed, or
            # that a cluster held open while it served, paused nothing, and its episodes stay counted) ...
            await cluster.suspend()
            self.activity.suspended(True)
        elif method == "resume":
            # ... to the resume's start (not its end: a cluster that held its resume open while it served
            # would hold its episodes, unheld by the count, for as long)
            self.activity.suspended(False)
            await cluster.resume()
        elif method == "serving_load":
            reply.header["load"] = dataclasses.asdict(await cluster.serving_load())
        else:
            raise ProtocolError(f"unknown cluster method {method!r}")
