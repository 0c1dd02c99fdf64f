"""A reward model under virtual time (RollArt-like targets): an LLM judge reads each finished
trajectory and gives its verdict before the environment's last answer reaches the controller. The
verdict is the environment's reward (a simulated target has no text to judge): what is modelled is
where the judge runs and what it costs there, as the stack declares (``EngineSettings.reward``).

* **colocated** (every stack's default): the judge shares the rollout engines' devices. A verdict
  is a request on the engine that served the episode's last turn (else the least loaded active
  one), of ``ratio`` times the trajectory's tokens and the verdict's, ``ratio`` being the judge's
  active parameters over the policy's: to first order its prefill FLOPs and its decode's weight
  reads. The judge's weights take their bytes from every engine's KV cache. A shrink, suspend or
  interrupting sync aborts a verdict as it aborts a turn; it is asked again, never lost.
* **dedicated**: ``reward_devices`` of the job's set aside for the judge, in engines of the judge's
  model (as many consecutive devices of one pool each as its weights need, at that pool's pace), each
  verdict to the least loaded. They never roll out or train; they hold the whole run (their
  device-seconds are the run's length each).
* **serverless** (the target's ``reward_model.serverless``): instances of the judge (an engine's
  devices each) of the job's first pool's kind, outside the job. A verdict goes to a ready instance
  with fewer than ``SERVERLESS_CONCURRENCY`` verdicts under way; when none has room and another
  instance keeps within ``max_devices``, one is asked for and serves ``cold_start_s`` later; an
  instance idle ``keep_warm_s`` is released. Billed per device from its start to its release (or
  the run's end).

Each verdict is a ``reward`` event (episode, where, device, tokens, start); the run's end a
``reward_service`` event: the device-seconds the judge held beyond the job's own devices' rollout
(dedicated, serverless) and the share of them it was busy (an engine with a verdict under way).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from targets.api import Aborted, EngineSettings, GenerateRequest, SamplingParams, TokenCount
from targets.harness.environments.base import Episode
from targets.harness.sim.cost_model import ClusterCosts, CostModel
from targets.harness.sim.engine import SimEngine
from targets.harness.trace import Trace
from targets.spec import TargetSpec, WorkloadSpec
from targets.spec.reward import RewardModelSpec

SERVERLESS_CONCURRENCY = 32  # verdicts one serverless instance takes at once before another is asked for


def placement_refused(
    workload: WorkloadSpec, engine: EngineSettings, rollout: list, train: list, devices: list
) -> str | None:
    """Why the stack's reward placement (its hello) cannot run on this target, or None."""
    judge, where, reserved = workload.reward_model, engine.reward, list(engine.reward_devices)
    if where != "colocated" and judge is None:
        return f"the stack places the reward model {where}, but the target has none (workload.reward_model)"
    if where == "serverless" and judge.serverless is None:
        return "the stack places the reward model serverless, but the target offers no serverless service"
    if (where == "dedicated") != bool(reserved):
        return f"reward_devices {reserved} go with a dedicated reward model, and only there (placed {where})"
    unknown = [d for d in reserved if d not in devices]
    if unknown:
        return f"reward_devices {unknown} are not the job's devices {devices}"
    used = sorted(set(reserved) & (set(rollout) | set(train)))
    if used:
        return (
            f"reward_devices {used} are set aside for the reward model: the controller places rollout or training there"
        )
    return None


def judge_costs_of(spec: TargetSpec) -> ClusterCosts | None:
    """The reward model's cost on each pool's devices (None without one)."""
    judge = spec.workload.reward_model
    if judge is None:
        return None
    costs = ClusterCosts.from_spec(spec, judge.model)
    if judge.serverless is not None and judge.serverless.max_devices < costs.engine_devices:  # no instance fits
        raise ValueError(
            f"workload.reward_model.serverless.max_devices {judge.serverless.max_devices} holds no instance of "
            f"the judge: its weights need {costs.engine_devices} devices an instance"
        )
    return costs


def dedicated_engines(reserved: tuple[str, ...], judge_costs: ClusterCosts) -> list[list[str]] | str:
    """The judge's engines on the devices set aside for it: consecutive runs of ``engine_devices``
    (as many as its weights need) within one pool; or why the devices cannot hold whole engines."""
    size, engines, pending = judge_costs.engine_devices, [], []
    for device in reserved:
        if pending and judge_costs.pool_of[device] != judge_costs.pool_of[pending[0]]:
            break
        pending.append(device)
        if len(pending) == size:
            engines.append(pending)
            pending = []
    if pending or sum(map(len, engines)) != len(reserved):
        return (
            f"reward_devices {list(reserved)} do not divide into engines of the reward model's {size} devices "
            "within one pool each"
        )
    return engines


@dataclass
class Usage:
    """A judge instance's time, as the simulated and the real services both account it: held on
    ``devices`` devices from ``started`` to ``released`` (or the run's end), busy while a verdict is
    under way, and while idle perhaps a ``release`` pending (serverless)."""

    started: float
    devices: int
    released: float | None = None
    busy_since: float | None = None
    busy_s: float = 0.0
    release: asyncio.TimerHandle | None = None

    def busy(self, now: float) -> None:
        """A verdict begins: busy from now if it was idle, a pending release called off."""
        if self.busy_since is None:
            self.busy_since = now
        if self.release is not None:
            self.release.cancel()
            self.release = None

    def idle(self, now: float) -> None:
        """The last verdict under way ended."""
        if self.busy_since is not None:
            self.busy_s += now - self.busy_since
            self.busy_since = None

    def held_s(self, end: float) -> float:
        """Device-seconds held by ``end``."""
        return (min(self.released if self.released is not None else end, end) - self.started) * self.devices

    def busy_device_s(self, end: float) -> float:
        """Device-seconds busy by ``end``."""
        return (self.busy_s + (end - self.busy_since if self.busy_since is not None else 0.0)) * self.devices


def usage_summary(where: str, scored: int, usages: list[Usage], end: float) -> dict:
    """The run's ``reward_service`` figures: the device-seconds held beyond the job's own rollout devices
    (none colocated) and the busy share of them; ``busy_s`` whatever the placement."""
    beyond = [] if where == "colocated" else usages
    held = sum(u.held_s(end) for u in beyond)
    busy_beyond = sum(u.busy_device_s(end) for u in beyond)
    return {
        "where": where,
        "scored": scored,
        "instances": len(usages),
        "device_s": held,
        "busy_s": sum(u.busy_device_s(end) for u in usages),
        "utilization": busy_beyond / held if held else 0.0,
    }


@dataclass
class _Instance:
    """A judge engine the service runs (dedicated or serverless) and its time."""

    engine: SimEngine
    usage: Usage
    waiting: list[Callable[[], None]] = field(default_factory=list)  # verdicts held for its cold start

    @property
    def ready(self) -> bool:
        """Its cold start is over (a serverless instance's engine stays offloaded until then)."""
        return not self.engine.offloaded


class RewardService:
    def __init__(
        self,
        spec: RewardModelSpec,
        placement: EngineSettings,
        cluster,  # the run's SimCluster
        judge_costs: ClusterCosts,
        policy_cost: CostModel,
        trace: Trace,
        fail: Callable[[BaseException], None],
    ) -> None:
        """``fail``: what ends the run when a verdict cannot be served (an engine refused it)."""
        self.spec, self.where, self.cluster, self.trace, self.fail = spec, placement.reward, cluster, trace, fail
        self.judge_costs = judge_costs
        self.ratio = judge_costs.shared.active_params / policy_cost.active_params
        self._loop = asyncio.get_running_loop()
        self.instances: list[_Instance] = []
        self.scored = 0
        if self.where == "dedicated":  # held from the run's start
            engines = dedicated_engines(placement.reward_devices, judge_costs)
            if isinstance(engines, str):
                raise ValueError(engines)  # the harness refused the placement at hello (drive.py)
            for devices in engines:  # each at its own pool's pace
                engine = SimEngine(f"judge:{devices[0]}", devices, judge_costs.of(devices[0]))
                self.instances.append(_Instance(engine, Usage(self._loop.time(), len(devices))))

    # -- verdicts ---------------------------------------------------------------------------------
    def judge(self, episode: Episode, then: Callable[[float], None]) -> None:
        """Judge ``episode``'s whole context as its last step ends; ``then(0.0)`` once the verdict is in
        (a simulated judge has no text to read: its score adds nothing to the environment's reward)."""
        start, tokens, episode = episode.last_step.t, episode.context_tokens, episode.episode_id

        def judged(device: str) -> None:
            self.scored += 1
            self.trace.record(
                "reward", episode=episode, where=self.where, device=device, tokens=tokens, start=start, score=0.0
            )
            then(0.0)

        if self.where == "colocated":
            self._colocated(episode, tokens, judged)
        else:
            self._on_instance(episode, tokens, judged)

    def _colocated(self, episode: str, tokens: int, judged: Callable[[str], None]) -> None:
        out = max(1, math.ceil(self.spec.output_tokens * self.ratio))
        request = GenerateRequest(
            f"{episode}#judge",
            0,
            TokenCount(max(1, math.ceil(tokens * self.ratio))),
            SamplingParams(max_new_tokens=out),
            device=self.cluster.last_device(episode),
        )

        def answered(result) -> None:
            if isinstance(result, Aborted):  # its engine was shrunk or suspended: asked again
                self.cluster.generate_then(request, answered, length=out)
            elif isinstance(result, BaseException):  # the engine refused it: the run cannot go on
                self.fail(result)
            else:
                judged(result.device)

        self.cluster.generate_then(request, answered, length=out)

    def _on_instance(self, episode: str, tokens: int, judged: Callable[[str], None]) -> None:
        instance = self._instance_for()
        out = self.spec.output_tokens

        def submit() -> None:
            try:
                instance.engine.submit(f"{episode}#judge", tokens, out, out, lambda _: done())
            except (ValueError, RuntimeError) as error:  # the engine refused it: the run cannot go on
                self.fail(error)
                return
            self._busy(instance, +1)

        def done() -> None:
            self._busy(instance, -1)
            judged(instance.engine.devices[0])

        if instance.ready:
            submit()
        else:
            instance.waiting.append(submit)

    def _instance_for(self) -> _Instance:
        live = [i for i in self.instances if i.usage.released is None]
        if self.where == "dedicated":
            return min(live, key=lambda i: (i.engine.load, i.engine.name))
        room = [i for i in live if i.engine.load + len(i.waiting) < SERVERLESS_CONCURRENCY]
        serverless = self.spec.serverless
        if room:
            return min(room, key=lambda i: (not i.ready, i.engine.load + len(i.waiting), i.engine.name))
        if (len(live) + 1) * self.judge_costs.engine_devices <= serverless.max_devices:
            return self._start_instance()
        return min(live, key=lambda i: (i.engine.load + len(i.waiting), i.engine.name))

    def _start_instance(self) -> _Instance:
        n, size = len(self.instances), self.judge_costs.engine_devices
        engine = SimEngine(
            f"judge:serverless{n}", [f"serverless:{n}.{i}" for i in range(size)], self.judge_costs.shared
        )
        engine.offload()  # not ready until its cold start is over
        instance = _Instance(engine, Usage(self._loop.time(), size))
        self.instances.append(instance)

        def ready() -> None:
            engine.reload()
            waiting, instance.waiting = instance.waiting, []
            for submit in waiting:
                submit()
            self._idle_check(instance)

        self._loop.call_later(self.spec.serverless.cold_start_s, ready)
        return instance

    # -- busy time and release ----------------------------------------------------------------------
    def _busy(self, instance: _Instance, change: int) -> None:
        """Track the time ``instance`` has a verdict under way (called after its engine took a verdict
        in, or answered one)."""
        if change > 0:
            instance.usage.busy(self._loop.time())
        elif instance.engine.load == 0 and instance.usage.busy_since is not None:
            instance.usage.idle(self._loop.time())
            self._idle_check(instance)

    def _idle_check(self, instance: _Instance) -> None:
        """A serverless instance idle ``keep_warm_s`` from now is released."""
        usage = instance.usage
        if self.where != "serverless" or usage.busy_since is not None or instance.waiting:
            return

        def release() -> None:
            if usage.busy_since is None and not instance.waiting and usage.released is None:
                usage.released = self._loop.time()
                instance.engine.close()

        usage.release = self._loop.call_later(self.spec.serverless.keep_warm_s, release)

    # -- the run's figures ------------------------------------------------------------------------
    def summary(self, end: float) -> dict:
        """The judge's device-seconds beyond the job's rollout and its busy share of them, to ``end``."""
        return usage_summary(self.where, self.scored, [i.usage for i in self.instances], end)

    def close(self) -> None:
        for instance in self.instances:
            if instance.usage.release is not None:
                instance.usage.release.cancel()
            instance.engine.close()
