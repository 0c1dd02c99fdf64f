"""The ``EnvSource`` the harness hands a controller: new GRPO groups on demand, each episode
recorded in the trace the moment it exists (so the audit can account for every one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from targets.api import DROP_REASONS
from targets.harness.clock import Clock
from targets.harness.environments.base import Episode
from targets.harness.trace import Trace

if TYPE_CHECKING:
    from targets.spec import WorkloadSpec


def episode_id_of(group_id: str, member: int) -> str:
    return f"{group_id}/e{member}"


def group_of(episode_id: str) -> str:
    """The group an episode id names (the inverse of ``episode_id_of``)."""
    return episode_id.split("/", 1)[0]


class EnvironmentPool:
    """Follows ``targets.api.EnvSource`` and ``EnvDropper``."""

    def __init__(self, workload: WorkloadSpec, clock: Clock, trace: Trace, seed: int = 0) -> None:
        from targets.harness.environments import ENVIRONMENTS

        self.episode_class: type[Episode] = ENVIRONMENTS[workload.environment.name]
        self.workload = workload
        self.group_size = workload.group_size
        self.clock = clock
        self.trace = trace
        self.seed = seed
        self.groups_created = 0
        self.max_extra = 0  # the stack's declared redundancy, set once the stack has said it

    def new_group(self, extra: int = 0) -> list[Episode]:
        if not 0 <= extra <= self.max_extra:
            raise ValueError(
                f"new_group asked for {extra} spare episodes; the stack declares redundant_per_group {self.max_extra}"
            )
        index = self.groups_created
        self.groups_created += 1
        group_id = f"g{index}"
        task_seed = self.seed * 1_000_003 + index
        episodes = []
        for member in range(self.group_size + extra):
            episode_id = episode_id_of(group_id, member)
            episode = self.episode_class(
                episode_id=episode_id,
                group_id=group_id,
                task_seed=task_seed,
                episode_seed=task_seed * 131 + member + 1,
                workload=self.workload,
                clock=self.clock,
                trace=self.trace,
            )
            self.trace.record("episode_created", episode=episode_id, group=group_id)
            episodes.append(episode)
        return episodes

    def drop(self, episode_id: str, reason: str) -> None:
        """A controller discards an episode on purpose; recorded so the audit can verify the reason."""
        if reason not in DROP_REASONS:
            raise ValueError(f"drop reason must be one of {DROP_REASONS}, got {reason!r}")
        self.trace.record("sample_dropped", episode=episode_id, reason=reason)
