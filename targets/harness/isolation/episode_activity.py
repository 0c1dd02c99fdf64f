"""What each episode was doing, as the harness saw the controller's calls: a generate request or an
environment call (reset, step, checkpoint) under way, or nothing. An episode a stack stops stepping
and holds until the run ends is dropped as ``end_of_run`` like one the end cut off mid-turn; what
tells them apart is how long it sat with nothing under way while the engines served others
(docs/judge.md, the net)."""

from __future__ import annotations

from collections import defaultdict
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


class EpisodeActivity:
    """Counts each episode's calls under way and the time it spent with none, by the harness's clock.
    A pause of the whole rollout (a stack that stops sampling while it trains, or suspends its cluster)
    holds no one: ``held_s`` grows only while some generate request is under way and not suspended."""

    def __init__(self, now: Callable[[], float]) -> None:
        self.now = now
        self._under_way: dict[str, int] = defaultdict(int)
        self._idle_since: dict[str, float] = {}  # episode -> when its last call ended (or it was created)
        self._serving_at_idle: dict[str, float] = {}  # episode -> ``_serving_s`` when it went idle
        self._serving_at_creation: dict[str, float] = {}
        self._idle_total: dict[str, float] = defaultdict(float)
        self._held: dict[str, float] = defaultdict(float)
        self._finished: set[str] = set()
        self._requests: dict[str, int] = defaultdict(int)  # episode -> its generate requests under way
        self._requesting_since: dict[str, float] = {}  # episode -> when the first of those went out
        self._generating = 0  # generate requests under way, every episode's
        self._suspended = False  # the rollout suspended: requests parked in the cluster serve no one
        self._serving_s = 0.0  # seconds with a generate request under way, up to ``_serving_at``
        self._serving_at = 0.0

    def created(self, episode: str) -> None:
        self._idle_since[episode] = self.now()
        self._serving_at_idle[episode] = self._serving_at_creation[episode] = self._serving()

    def begin(self, episode: str, generate: bool = False) -> None:
        """A call for ``episode`` started (an unknown episode's call is refused elsewhere)."""
        if episode not in self._idle_since:
            return
        serving = self._serving()
        if not self._under_way[episode] and episode not in self._finished:
            self._idle_total[episode] += self.now() - self._idle_since[episode]
            self._held[episode] += serving - self._serving_at_idle[episode]
        self._under_way[episode] += 1
        self._generating += generate
        if generate:
            if not self._requests[episode]:
                self._requesting_since[episode] = self.now()
            self._requests[episode] += 1

    def end(self, episode: str, generate: bool = False, finished: bool = False) -> None:
        """A call for ``episode`` ended; ``finished``: the step that ended it (from then on it waits to be
        trained, which holds nothing back)."""
        if not self._under_way.get(episode):
            return
        serving = self._serving()
        self._generating -= generate
        self._requests[episode] -= generate
        self._under_way[episode] -= 1
        if finished:
            self._finished.add(episode)
        if not self._under_way[episode]:
            self._idle_since[episode] = self.now()
            self._serving_at_idle[episode] = serving

    def of(self, episode: str) -> Idleness | None:
        """How idle ``episode`` is now, and has been; None for an episode the harness never created."""
        if episode not in self._idle_since:
            return None
        serving = self._serving()
        lived = serving - self._serving_at_creation[episode]
        waiting = self.now() - self._requesting_since[episode] if self._requests[episode] else 0.0
        if self._under_way[episode] or episode in self._finished:
            return Idleness(0.0, self._idle_total[episode], self._held[episode], lived, waiting)
        idle = self.now() - self._idle_since[episode]
        held = serving - self._serving_at_idle[episode]
        return Idleness(idle, self._idle_total[episode] + idle, self._held[episode] + held, lived, waiting)

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
