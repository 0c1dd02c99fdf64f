"""The ``EnvSource`` the harness hands a controller: new GRPO groups on demand, each episode
recorded in the trace the moment it exists (so the audit can account for every one)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from targets.api import DROP_REASONS
from targets.harness.clock import Clock
from targets.harness.environments.base import Episode
from targets.harness.environments.registry import ENVIRONMENTS
from targets.harness.environments.seeds import RunSeed
from targets.harness.trace import Trace

if TYPE_CHECKING:
    from targets.harness.environments.hosted import Confinement, EnvironmentHost
    from targets.harness.isolation.episode_activity import Idleness
    from targets.spec import WorkloadSpec


def episode_id_of(group_id: str, member: int) -> str:
    return f"{group_id}/e{member}"


def group_of(episode_id: str) -> str:
    """The group an episode id names (the inverse of ``episode_id_of``)."""
    return episode_id.split("/", 1)[0]


def numbers_of(episode_id: str) -> tuple[int, int]:
    """The group's index and the member's number an episode id names (``g<index>/e<member>``): what its
    seed is derived from (``RunSeed.episode``)."""
    group, _, member = episode_id.partition("/e")
    if not (group.startswith("g") and group[1:].isdigit() and member.isdigit()):
        raise ValueError(f"{episode_id!r} is not an episode id of the form g<index>/e<member>")
    return int(group[1:]), int(member)


class EnvironmentPool:
    """Follows ``targets.api.EnvSource`` and ``EnvDropper``."""

    def __init__(
        self,
        workload: WorkloadSpec,
        clock: Clock,
        trace: Trace,
        seed: int | RunSeed = 0,
        counts: bool = False,
        model_path: str | None = None,
        confinement: Confinement | None = None,
    ) -> None:
        """``seed``: what the tasks are drawn from (a bare number: the public derivation). ``counts``: a
        simulated run's pool, whose episodes answer with token counts. ``model_path``: the model whose
        tokenizer a user's environment's text is rendered with (a real run's). ``confinement``: how a run confines
        the process a user's environment runs in (``hosted.py``)."""
        self.host: EnvironmentHost | None = None
        self.make_episode = self._episode_maker(workload, None if counts else model_path, confinement)
        self.workload = workload
        self.group_size = workload.group_size
        self.clock = clock
        self.trace = trace
        self.seed = seed if isinstance(seed, RunSeed) else RunSeed(seed)
        self.counts = counts
        self.groups_created = 0
        self.max_extra = 0  # the stack's declared redundancy, set once the stack has said it
        self._task_of_group: dict[str, int] = {}  # group -> the task it runs (its own index unless relaunched)
        self._postponed: set[str] = set()  # groups a member of which was dropped as deferred or stale
        self._ran_again: set[str] = set()  # postponed groups whose task ran again
        self._relaunches: set[str] = set()  # groups that ran a postponed group's task again
        self._running: dict[str, set[str]] = {}  # group -> its members not yet dropped

    def new_group(self, extra: int = 0, relaunch: str | None = None) -> list[Episode]:
        if not 0 <= extra <= self.max_extra:
            raise ValueError(
                f"new_group asked for {extra} spare episodes; the stack declares redundant_per_group {self.max_extra}"
            )
        task = self.groups_created
        if relaunch is not None:
            if relaunch not in self._postponed:
                raise ValueError(f"new_group(relaunch={relaunch!r}): that group was never deferred or dropped as stale")
            if relaunch in self._relaunches:
                raise ValueError(f"new_group(relaunch={relaunch!r}): that group was itself a relaunch")
            if relaunch in self._ran_again:
                raise ValueError(f"new_group(relaunch={relaunch!r}): that group's task was already relaunched")
            if self._running[relaunch]:
                raise ValueError(
                    f"new_group(relaunch={relaunch!r}): that group was not handed back whole "
                    f"({min(self._running[relaunch])} is not dropped)"
                )
            self._ran_again.add(relaunch)
            task = self._task_of_group[relaunch]
        index = self.groups_created
        self.groups_created += 1
        group_id = f"g{index}"
        self._task_of_group[group_id] = task
        if relaunch is not None:
            self._relaunches.add(group_id)
        task_seed = self.seed.task(task)
        episodes = []
        for member in range(self.group_size + extra):
            episode_id = episode_id_of(group_id, member)
            episode = self.make_episode(
                episode_id=episode_id,
                group_id=group_id,
                task_seed=task_seed,
                episode_seed=self.seed.episode(index, member),
                workload=self.workload,
                clock=self.clock,
                trace=self.trace,
                task=episodes[0].task if episodes else None,
                counts=self.counts,
            )
            if relaunch is None:
                self.trace.record("episode_created", episode=episode_id, group=group_id)
            else:
                self.trace.record("episode_created", episode=episode_id, group=group_id, relaunch=relaunch)
            episodes.append(episode)
        self._running[group_id] = {e.episode_id for e in episodes}
        return episodes

    def task_of(self, episode_id: str) -> str:
        """The task an episode runs, named by the group that ran it first (a relaunched group runs
        its deferred or stale group's task)."""
        return f"g{self._task_of_group[group_of(episode_id)]}"

    def drop(self, episode_id: str, reason: str, idleness: Idleness | None = None) -> None:
        """A controller discards an episode on purpose; recorded so the audit can verify the reason, with how
        long it had sat with no call under way (the controller link's count: ``isolation/episode_activity.py``)."""
        if reason not in DROP_REASONS:
            raise ValueError(f"drop reason must be one of {DROP_REASONS}, got {reason!r}")
        group = group_of(episode_id)
        if group not in self._running:
            raise ValueError(f"drop({episode_id!r}): no group of that name was created")
        if reason in ("deferred", "stale"):
            self._postponed.add(group)
        self._running[group].discard(episode_id)
        idle = {} if idleness is None else dataclasses.asdict(idleness)
        self.trace.record("sample_dropped", episode=episode_id, reason=reason, **idle)

    def close(self) -> None:
        """The process a user's environment ran in, ended (a run's episodes closed first); none for a harness
        environment."""
        if self.host is not None:
            self.host.stop()

    def _episode_maker(
        self, workload: WorkloadSpec, model_path: str | None, confinement: Confinement | None
    ) -> Callable[..., Episode]:
        """What makes one episode (called with ``Episode``'s keywords). A user's environment speaks text,
        so it needs the model's tokenizer (``model_path``): it runs for real, never on the simulator, in a
        process of its own (``hosted.py``)."""
        from targets.harness.environments.adapters import UserEnvironmentError

        env = workload.environment
        if env.name is not None:
            return ENVIRONMENTS[env.name]
        if model_path is None:
            raise UserEnvironmentError(
                f"environment {env.entry} is the user's own: it runs for real with the target's model and "
                "tokenizer, not on the simulator (a simulated target takes a workload measured on it)"
            )
        from targets.harness.environments.chat_format import ChatFormat
        from targets.harness.environments.hosted import EnvironmentHost
        from targets.harness.environments.text_episode import TextEpisode
        from targets.harness.model import load_tokenizer
        from targets.harness.tokenizer import stop_token_ids

        chat = ChatFormat(load_tokenizer(model_path), stop_token_ids(model_path), env.system, env.answer)
        host = self.host = EnvironmentHost.start(env, confinement)

        def make(**episode) -> TextEpisode:
            return TextEpisode(environment=host.environment(), chat=chat, entry=str(env.entry), **episode)

        return make
