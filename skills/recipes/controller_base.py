"""What every controller shares: the spec-derived knobs, the buffer and environment manager wiring,
and group-relative advantages. The policies themselves (one file each) stay a screen long."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from targets.api import Cluster, Device, Runtime, SamplingParams, TrainBatch, Trajectory

from .env_manager import EnvManager
from .router import RoutedCluster
from .sample_buffer import GroupBuffer
from .serving_harvest import ServingHarvest


def group_advantages(trajectories: list[Trajectory]) -> list[float]:
    """(reward - group mean) / (group population std + 1e-6); exactly 0 for a group whose rewards are equal."""
    groups: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        groups[t.group_id].append(t.reward)
    stats = {}
    for group, rewards in groups.items():
        mean = sum(rewards) / len(rewards)
        stats[group] = (mean, (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5)
    equal = {group for group, rewards in groups.items() if max(rewards) == min(rewards)}
    return [
        0.0 if t.group_id in equal else (t.reward - stats[t.group_id][0]) / (stats[t.group_id][1] + 1e-6)
        for t in trajectories
    ]


class ControllerBase:
    def __init__(self, runtime: Runtime, params: dict) -> None:
        workload = runtime.workload
        self.groups_per_step = workload.groups_per_step
        self.group_size = workload.group_size
        self.async_ratio = params.get("async_ratio", workload.async_ratio)  # declared by build.py
        ratio_ok = isinstance(self.async_ratio, int) and not isinstance(self.async_ratio, bool)
        if not ratio_ok or not 0 <= self.async_ratio <= workload.max_async_ratio:
            raise ValueError(
                f"params async_ratio must be an integer within [0, {workload.max_async_ratio}] "
                f"(the target's max_async_ratio), got {self.async_ratio!r}"
            )
        self.max_sequence = workload.max_sequence
        self.engine_devices = runtime.engine_devices * params.get("engine_scale", 1)  # the engine_scale skill
        self.sampling = SamplingParams(
            max_new_tokens=workload.response_tokens,
            temperature=workload.training.temperature,
            stop_token_ids=tuple(runtime.stop_token_ids),
        )
        self.params = params
        self.partial_rollout = bool(params.get("partial_rollout", 0))  # resume interrupted turns; syncs interrupt
        # where a crash loses an environment's state: 0 never checkpoint, 1 after turns that changed it, 2 every turn
        self.checkpoint_level = params.get("checkpoint_level", 0)
        if self.checkpoint_level and not workload.env_state:  # on, it would do nothing: said, not silently ignored
            raise ValueError(
                f"params checkpoint_level {self.checkpoint_level}: this target's environments keep no state to "
                "checkpoint (workload.env_state); set it to 0"
            )
        self.serving_devices = list(runtime.serving_devices)  # a serving pool's, lent by serving_harvest
        self.own = {d.id for d in runtime.devices}  # the job's devices less a dedicated reward model's (build.py)
        if params.get("serving_harvest", 0) and not self.serving_devices:
            raise ValueError("params serving_harvest: this target has no serving pool to borrow from")
        self.version = 0
        self._manager: EnvManager | None = None
        self._harvest: ServingHarvest | None = None

    def placement(self, devices: list[Device]) -> tuple[list[Device], list[Device]]:
        """(devices with a rollout engine, devices with a trainer rank), among this controller's own."""
        return self._place([d for d in devices if d.id in self.own])

    def _place(self, devices: list[Device]) -> tuple[list[Device], list[Device]]:
        raise NotImplementedError

    def _wire(self, cluster: Cluster, envs, async_ratio: int) -> tuple[Cluster, GroupBuffer, EnvManager]:
        """The cluster the controller drives (routed by the controller with ``kv_routing`` or
        ``hardware_affinity``), the
        group buffer, and the environment manager generating on that cluster; with ``serving_harvest``
        the harvester lending a serving pool's devices to rollout starts."""
        harvest = bool(self.params.get("serving_harvest", 0))
        if self.params.get("kv_routing", 0) or self.params.get("affinity_ratio", 0.0):
            rollout, _ = self.placement(cluster.devices)
            cluster = RoutedCluster(
                cluster,
                [d.id for d in rollout],
                self.engine_devices,
                # both in units of one full-length sequence's KV, so one setting means the same on any target
                slack_tokens=round(self.params.get("route_slack", 1.0) * self.max_sequence),
                admit_tokens=round(self.params.get("route_admit", 0.0) * self.max_sequence),
                affinity_ratio=self.params.get("affinity_ratio", 0.0),
                lendable=self.serving_devices if harvest else (),
            )
        if harvest:  # lends through the router, if any, which then routes to the lent engines too
            margin = self.params.get("harvest_margin", 0.3)
            self._harvest = ServingHarvest(
                cluster, self.serving_devices, self.engine_devices, margin, self.partial_rollout
            )
            self._harvest.start()
        buffer = GroupBuffer(self.group_size, async_ratio, envs)
        manager = EnvManager(
            cluster,
            envs,
            buffer,
            self.sampling,
            self.max_sequence,
            redundancy=self.params.get("redundant_envs", 0),
            abort_stale=bool(self.params.get("abort_stale", 0)),
            partial_rollout=self.partial_rollout,
            tail_round=self.params.get("tail_round", 0),
            checkpoint_level=self.checkpoint_level,
            start_after=self._harvest.ready if self._harvest is not None else None,
        )
        if self._harvest is not None:
            self._harvest.on_failure = manager.fail  # the controller's next wait raises it
        self._manager = manager  # told of each new policy version by _train
        return cluster, buffer, manager

    def _refill(self, buffer: GroupBuffer, manager: EnvManager) -> Callable[[], None]:
        """Keep ``groups_per_step * (1 + async_ratio)`` groups in flight or waiting: sampling may run
        that far ahead of training, and no further (the staleness bound would drop the excess)."""
        outstanding = self.groups_per_step * (1 + buffer.async_ratio)

        def refill() -> None:
            manager.launch(max(0, outstanding - manager.groups_in_flight - buffer.ready_groups - buffer.streamed))

        return refill

    async def _finish(self, buffer: GroupBuffer, manager: EnvManager) -> None:
        """Hand back every episode not trained on: in flight or waiting in the buffer."""
        manager.raise_if_failed()
        if self._harvest is not None:
            await self._harvest.stop()
        await manager.cancel_all()
        buffer.drop_all("end_of_run")

    async def _train(self, cluster: Cluster, batch: list[Trajectory], devices: list[Device]) -> int:
        if self._harvest is not None:
            await self._harvest.synced()  # lent engines hold the last version before the next is trained
        self.version = await cluster.train(TrainBatch(batch, group_advantages(batch)), devices)
        self._manager.policy_advanced(self.version)
        if self._harvest is not None:
            self._harvest.policy_advanced(self.version)
        return self.version
