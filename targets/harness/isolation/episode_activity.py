"""What each episode was doing, as the harness saw the controller's calls: a generate request or an
environment call (reset, step, checkpoint) under way, or nothing. An episode a stack stops stepping
and holds until the run ends is dropped as ``end_of_run`` like one the end cut off mid-turn; what
tells them apart is how long it sat with nothing under way while the engines served others
(docs/judge.md, the net)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Idleness:
    """An unfinished episode's time with nothing under way: right before the moment asked about (0 when
    a call was under way then, or it had finished), over its life, and of that the time some other
    episode had a generate request under way (it was *held*: the engines served others, not nobody);
    how long, over its life, any generate request was under way (what ``held_s`` is a share of); and how
    long its own generate request had been under way then (0 with none: a request a cluster accepts and
    never serves keeps an episode under way, held all the same)."""

    idle_s: float
    idle_total_s: float
    held_s: float
    serving_s: float
    waiting_s: float


@dataclass
class _Episode:
    """One episode's account, on the harness's clock; ``serving_*``: the run's serving seconds then."""

    idle_since: float  # when its last call ended (or it was created)
    serving_at_idle: float
    serving_at_creation: float
    under_way: int = 0  # its calls under way
    requests: int = 0  # of those, generate requests
    requesting_since: float = 0.0  # when the first of those went out
    idle_total: float = 0.0
    held: float = 0.0
    finished: bool = False


class EpisodeActivity:
    """Counts each episode's calls under way and the time it spent with none, by the harness's clock.
    A pause of the whole rollout (a stack that stops sampling while it trains, or suspends its cluster)
    holds no one: ``held_s`` grows only while some generate request is under way and not suspended."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self._episodes: dict[str, _Episode] = {}
        self._generating = 0  # generate requests under way, every episode's
        self._suspended = False  # the rollout suspended: requests parked in the cluster serve no one
        self._serving_s = 0.0  # seconds with a generate request under way, up to ``_serving_at``
        self._serving_at = 0.0

    def created(self, episode: str) -> None:
        serving = self._serving()
        self._episodes[episode] = _Episode(self.now(), serving, serving)

    def begin(self, episode: str, generate: bool = False) -> None:
        """A call for ``episode`` started (an unknown episode's call is refused elsewhere)."""
        e = self._episodes.get(episode)
        if e is None:
            return
        serving = self._serving()
        if not e.under_way and not e.finished:
            e.idle_total += self.now() - e.idle_since
            e.held += serving - e.serving_at_idle
        e.under_way += 1
        self._generating += generate
        if generate:
            if not e.requests:
                e.requesting_since = self.now()
            e.requests += 1

    def end(self, episode: str, generate: bool = False, finished: bool = False) -> None:
        """A call for ``episode`` ended; ``finished``: the step that ended it (from then on it waits to be
        trained, which holds nothing back)."""
        e = self._episodes.get(episode)
        if e is None or not e.under_way:
            return
        serving = self._serving()
        self._generating -= generate
        e.requests -= generate
        e.under_way -= 1
        e.finished = e.finished or finished
        if not e.under_way:
            e.idle_since, e.serving_at_idle = self.now(), serving

    def of(self, episode: str) -> Idleness | None:
        """How idle ``episode`` is now, and has been; None for an episode the harness never created."""
        e = self._episodes.get(episode)
        if e is None:
            return None
        serving = self._serving()
        lived = serving - e.serving_at_creation
        waiting = self.now() - e.requesting_since if e.requests else 0.0
        if e.under_way or e.finished:
            return Idleness(0.0, e.idle_total, e.held, lived, waiting)
        idle = self.now() - e.idle_since
        return Idleness(idle, e.idle_total + idle, e.held + serving - e.serving_at_idle, lived, waiting)

    def suspended(self, suspended: bool) -> None:
        """The controller suspended the rollout (or resumed it): while it is, no request is being served,
        so an episode it does not step meanwhile is held by no one."""
        self._serving()
        self._suspended = suspended

    def _serving(self) -> float:
        """Seconds so far with some generate request under way (the rollout not suspended)."""
        now = self.now()
        if self._generating and not self._suspended:
            self._serving_s += now - self._serving_at
        self._serving_at = now
        return self._serving_s
