"""The reward model of a real run, placed where the stack says (``EngineSettings.reward``), each
instance a judge process of the harness's (``judge_process.py``) on the devices it stands for:

* **colocated**: an instance on each device the stack rolls out on, started before the run; a
  verdict goes to the instance on the device that served the episode's last turn (one is started
  there if the stack rolled out on a device it did not name at hello). It shares that device with
  the stack's engine, as a judge beside the policy does.
* **dedicated**: an instance per engine of the devices the stack set aside (``reward_devices``,
  grouped as the simulator groups them), started before the run and held to its end; a verdict to
  the least loaded.
* **serverless** (CPU targets: the host stands for the service's machines): instances started on
  demand, each ready once its process has loaded the judge and ``cold_start_s`` has passed, released
  after ``keep_warm_s`` idle, at most ``max_devices``.

A verdict is asked as the episode's last step ends, on its whole context; the ``reward`` event and
the run's ``reward_service`` summary are those of the simulated service (``sim/reward.py``), with
the judge's score, which the harness adds to the environment's last reward.

A judge process of a run the launcher started (``isolation/launch.py``) is a fork of the harness
zygote, which has imported what a judge loads; elsewhere (a harness child run by hand) a fresh process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from targets import PROJECT_ROOT
from targets.api import EngineSettings, Runtime
from targets.harness.environments.base import Episode
from targets.harness.isolation.zygote_client import ZygoteChild, forks_of, passed_fd
from targets.harness.model import model_dir
from targets.harness.sim.cost_model import ClusterCosts
from targets.harness.sim.reward import (
    SERVERLESS_CONCURRENCY,
    Usage,
    dedicated_engines,
    judge_costs_of,
    usage_summary,
)
from targets.harness.trace import Trace
from targets.spec import TargetSpec
from targets.spec.reward import RewardModelSpec

VERDICT_TIMEOUT_S = 300.0  # a verdict not in by then: the judge's process hangs, and the run fails saying so


class JudgeProcessError(RuntimeError):
    """A judge process ended or answered out of turn: the harness's fault or the machine's, never the candidate's."""


JUDGE_MODULE = "targets.harness.reward_model.judge_process"


class JudgeProcess(Protocol):
    """What an instance needs of its process: a fresh one (``asyncio.subprocess.Process``) or a fork."""

    returncode: int | None

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


class ForkedJudge:
    """A judge process the harness zygote forked, as an instance uses its process."""

    def __init__(self, child: ZygoteChild) -> None:
        self.child = child

    @property
    def returncode(self) -> int | None:
        return self.child.poll()

    async def wait(self) -> int:
        while self.child.poll() is None:
            await asyncio.sleep(0.05)
        return self.child.returncode

    def kill(self) -> None:
        if self.child.poll() is None:
            os.kill(self.child.pid, signal.SIGKILL)


async def fresh_process(command: list[str], requests: int, verdicts: int, log: int, env: dict[str, str]):
    """``command`` as a fresh process, its two pipes' descriptors appended to it."""
    return await asyncio.create_subprocess_exec(
        *command,
        str(requests),
        str(verdicts),
        pass_fds=(requests, verdicts),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        env=env,
        cwd=PROJECT_ROOT,  # ``-m`` imports from its cwd first: never the user's (a ``targets`` folder of theirs)
    )


# starts a judge process: (requests read end, verdicts write end, log descriptor, environment) -> it
Launch = Callable[[int, int, int, dict[str, str]], Awaitable[JudgeProcess]]


@dataclass
class JudgeInstance:
    """One judge process, the devices it stands for, and how long it has had verdicts under way."""

    name: str
    devices: list[str]
    usage: Usage
    process: JudgeProcess | None = None
    log: object = None  # its output, read back when it fails
    requests: asyncio.StreamWriter | None = None  # contexts to it, a line each
    verdicts: asyncio.StreamReader | None = None  # its answers, a line each
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)  # one verdict at a time through its pipes
    load: int = 0  # verdicts routed to it and not yet answered (waiting for its start included)
    active: int = 0  # of them, those past its start: it is busy while any is
    starting: asyncio.Future | None = None  # its process loading (and a serverless cold start)
    _transports: list[asyncio.BaseTransport] = field(default_factory=list)

    def begin(self, launch: Launch, env: dict[str, str], cold_start_s: float = 0.0) -> None:
        """Start its process (``launch``, ``env``); it is ready once the process has loaded the judge and
        ``cold_start_s`` has passed."""
        self.starting = asyncio.ensure_future(asyncio.gather(self._start(launch, env), asyncio.sleep(cold_start_s)))

    @property
    def ready(self) -> bool:
        return self.starting is not None and self.starting.done()

    async def _start(self, launch: Launch, env: dict[str, str]) -> None:
        self.log = tempfile.TemporaryFile()
        loop = asyncio.get_running_loop()
        requests_read, requests_write = os.pipe()
        verdicts_read, verdicts_write = os.pipe()
        try:  # our ends as streams first: from here on they close with their transports
            self.verdicts = asyncio.StreamReader()
            reading, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(self.verdicts), os.fdopen(verdicts_read, "rb", 0)
            )
            writing, protocol = await loop.connect_write_pipe(
                asyncio.streams.FlowControlMixin, os.fdopen(requests_write, "wb", 0)
            )
            self._transports += [reading, writing]
            self.requests = asyncio.StreamWriter(writing, protocol, None, loop)
            self.process = await launch(requests_read, verdicts_write, self.log.fileno(), env)
        finally:  # the process's ends are its own now: its verdicts' pipe ends when it does
            os.close(requests_read)
            os.close(verdicts_write)
        said = await self.verdicts.readline()
        if said.strip() != b"ready":
            raise self._failed(f"said {said[:200]!r} instead of ready")

    async def score(self, context: list[int], timeout_s: float) -> float:
        """The verdict on ``context``; ``asyncio.TimeoutError`` where the process took over ``timeout_s`` on it
        (timed from its turn at the pipes: verdicts queued behind others on a busy instance wait their turn)."""
        async with self.turn:
            line = await asyncio.wait_for(self._ask(context), timeout_s)
        if not line:
            raise self._failed("ended before its verdict")
        return float(json.loads(line)["score"])

    async def _ask(self, context: list[int]) -> bytes:
        """One request down the pipe and the line that answers it (empty: the process ended)."""
        self.requests.write(json.dumps(context).encode() + b"\n")
        await self.requests.drain()
        return await self.verdicts.readline()

    def _failed(self, what: str) -> JudgeProcessError:
        self.log.seek(0)
        tail = self.log.read()[-3000:].decode(errors="replace")
        return JudgeProcessError(f"the reward model's process {self.name} {what}:\n{tail}")

    async def close(self) -> None:
        if self.usage.release is not None:
            self.usage.release.cancel()
        if self.starting is not None and not self.starting.done():
            self.starting.cancel()
            await asyncio.gather(self.starting, return_exceptions=True)
        if self.requests is not None:
            self.requests.close()  # its end of file: the process's loop ends
        if self.process is not None and self.process.returncode is None:
            try:
                await asyncio.wait_for(self.process.wait(), timeout=10)
            except asyncio.TimeoutError:
                self.process.kill()
                await self.process.wait()
        for transport in self._transports:
            transport.close()
        if self.log is not None:
            self.log.close()


class RewardModelService:
    """The judge's instances for one real run, and every verdict asked of them."""

    def __init__(
        self,
        spec: RewardModelSpec,
        placement: EngineSettings,
        job_devices: list[str],
        judge_dir: Path,
        policy_dir: Path,
        judge_costs: ClusterCosts,
        trace: Trace,
        last_device: Callable[[str], str | None],
        fail: Callable[[BaseException], None],
    ) -> None:
        """``last_device``: the device that served an episode's last turn (the harness's proxy knows);
        ``fail``: what ends the run when a verdict cannot be had."""
        self.spec, self.where, self.trace, self.fail = spec, placement.reward, trace, fail
        self.placement, self.judge_costs, self.last_device = placement, judge_costs, last_device
        self.judge_dir, self.policy_dir = judge_dir, policy_dir
        self.job_devices = set(job_devices)
        self.instances: list[JudgeInstance] = []
        self.on_device: dict[str, JudgeInstance] = {}
        self.scored = 0
        self._verdicts: set[asyncio.Task] = set()
        self._closing = False  # set when the run's figures are taken: a verdict landing later is not one

    @classmethod
    def for_run(
        cls, spec: TargetSpec, placement: EngineSettings, runtime: Runtime, trace: Trace, last_device, fail
    ) -> RewardModelService:
        """The service of a real run of ``spec`` (which has a reward model), placed as the stack said."""
        judge = spec.workload.reward_model
        return cls(
            judge,
            placement,
            [d.id for d in runtime.devices],
            model_dir(judge.model),
            Path(runtime.model_path),
            judge_costs_of(spec),
            trace,
            last_device,
            fail,
        )

    async def launch(self, requests: int, verdicts: int, log: int, env: dict[str, str]) -> JudgeProcess:
        """A judge process (``judge_process.py``; the host's CPU: the spec refuses a real reward model on
        other devices until its GPU placement is built and tested) reading contexts from ``requests`` and
        writing verdicts to ``verdicts``: a warm fork of the harness zygote where this process was given a
        connection to it (a harness child the launcher started), else a fresh process."""
        arguments = [str(self.judge_dir), str(self.policy_dir), "cpu", self.spec.model.dtype]
        forks = forks_of("harness")
        if forks is None:
            return await fresh_process([sys.executable, "-m", JUDGE_MODULE, *arguments], requests, verdicts, log, env)
        pipes = [str(passed_fd(0)), str(passed_fd(1))]  # where the fork finds ``requests`` and ``verdicts``
        child = forks.spawn(
            [*arguments, *pipes], env, log, requests, verdicts, cwd=str(PROJECT_ROOT), main=JUDGE_MODULE
        )
        return ForkedJudge(child)

    def _spawn(self, name: str, devices: list[str], cold_start_s: float = 0.0) -> JudgeInstance:
        instance = JudgeInstance(name, devices, Usage(self.trace.clock.now(), len(devices)))
        instance.begin(self.launch, dict(os.environ), cold_start_s)  # imports the harness from PROJECT_ROOT, its cwd
        self.instances.append(instance)
        return instance

    async def start(self, rollout: list[str]) -> None:
        """The instances held from the run's start (colocated, dedicated), loaded before it starts."""
        if self.where == "colocated":
            for device in dict.fromkeys(d for d in rollout if d in self.job_devices):  # each once, the job's only
                self.on_device[device] = self._spawn(f"judge:{device}", [device])
        elif self.where == "dedicated":
            engines = dedicated_engines(self.placement.reward_devices, self.judge_costs)
            if isinstance(engines, str):
                raise ValueError(engines)  # the harness refused the placement at hello (drive.py)
            for devices in engines:
                self._spawn(f"judge:{devices[0]}", devices)
        await asyncio.gather(*(i.starting for i in self.instances))
        for instance in self.instances:  # held from the run's start: their loading is not the run's
            instance.usage.started = self.trace.clock.now()

    # -- verdicts ---------------------------------------------------------------------------------
    def judge(self, episode: Episode, then: Callable[[float], None]) -> None:
        """Judge ``episode``'s whole context as its last step ends; ``then(score)`` once the verdict is in."""
        start, context = episode.last_step.t, list(episode.context)
        try:
            instance = self._instance_for(episode.episode_id)
        except Exception as error:  # noqa: BLE001 - raised in the loop's callback it would be lost: the run's
            self.fail(error)
            return
        instance.load += 1
        task = asyncio.ensure_future(self._verdict(instance, episode.episode_id, context, start, then))
        self._verdicts.add(task)
        task.add_done_callback(self._verdicts.discard)

    async def _verdict(self, instance: JudgeInstance, episode: str, context: list[int], start: float, then) -> None:
        """One verdict; whatever stops it (a process that ends, hangs or answers out of turn) ends the
        run with its reason, never leaves the episode waiting."""
        try:
            await asyncio.shield(instance.starting)  # shared by every verdict routed to it
            self._busy(instance, +1)
            try:
                score = await instance.score(context, VERDICT_TIMEOUT_S)
            except (ValueError, KeyError, TypeError) as error:  # a line that is no verdict
                raise JudgeProcessError(
                    f"the reward model's process {instance.name} answered out of turn: {error}"
                ) from None
            except asyncio.TimeoutError:
                raise JudgeProcessError(
                    f"the reward model's process {instance.name} gave no verdict in {VERDICT_TIMEOUT_S:.0f} s"
                ) from None
            finally:
                self._busy(instance, -1)
            if self._closing:  # the run ended while it was scored (Python 3.11's wait_for can swallow the
                return  # cancel of a call that just finished): neither counted nor recorded after the figures
            if not 0.0 <= score <= 1.0:  # NaN included
                raise JudgeProcessError(f"the reward model's process {instance.name} scored {score!r}, not in [0, 1]")
            self.scored += 1
            self.trace.record(
                "reward",
                episode=episode,
                where=self.where,
                device=instance.devices[0],
                tokens=len(context),
                start=start,
                score=score,
            )
            then(score)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure of a verdict is the run's, said by name
            self.fail(error)
        finally:
            instance.load -= 1

    def _instance_for(self, episode: str) -> JudgeInstance:
        if self.where == "colocated":
            device = self.last_device(episode)
            if device is None or device not in self.job_devices:
                raise ValueError(f"episode {episode} ended with no turn served on any of the job's devices")
            if device not in self.on_device:
                self.on_device[device] = self._spawn(f"judge:{device}", [device])
            return self.on_device[device]
        live = [i for i in self.instances if i.usage.released is None]
        if self.where == "dedicated":
            return min(live, key=lambda i: (i.load, i.name))
        room = [i for i in live if i.load < SERVERLESS_CONCURRENCY]
        if room:
            return min(room, key=lambda i: (not i.ready, i.load, i.name))
        if len(live) + 1 <= self.spec.serverless.max_devices:
            return self._start_serverless()
        return min(live, key=lambda i: (i.load, i.name))

    def _start_serverless(self) -> JudgeInstance:
        n = len(self.instances)
        return self._spawn(f"judge:serverless{n}", [f"serverless:{n}.0"], self.spec.serverless.cold_start_s)

    # -- busy time and release (as the simulated service's) -------------------------------------------
    def _busy(self, instance: JudgeInstance, change: int) -> None:
        instance.active += change
        if change > 0:
            instance.usage.busy(self.trace.clock.now())
        elif instance.active == 0:
            instance.usage.idle(self.trace.clock.now())
            self._idle_check(instance)

    def _idle_check(self, instance: JudgeInstance) -> None:
        """A serverless instance idle ``keep_warm_s`` from now is released: its process ends."""
        if self.where != "serverless":
            return
        usage = instance.usage

        def release() -> None:
            if instance.load == 0 and usage.released is None:
                usage.released = self.trace.clock.now()
                task = asyncio.ensure_future(instance.close())
                self._verdicts.add(task)
                task.add_done_callback(self._verdicts.discard)

        usage.release = asyncio.get_running_loop().call_later(self.spec.serverless.keep_warm_s, release)

    # -- the run's figures ------------------------------------------------------------------------
    def summary(self, end: float) -> dict:
        """The simulated service's figures (``usage_summary``) for these processes."""
        return usage_summary(self.where, self.scored, [i.usage for i in self.instances], end)

    async def close(self) -> None:
        self._closing = True
        for task in list(self._verdicts):
            task.cancel()
        await asyncio.gather(*self._verdicts, return_exceptions=True)
        await asyncio.gather(*(i.close() for i in self.instances))
