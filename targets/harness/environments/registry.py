"""The harness-owned environments by name: a target's ``workload.environment.name`` picks one (a
user's own, by ``entry``, is made by ``EnvironmentPool``)."""

from __future__ import annotations

from targets.harness.environments.base import Episode
from targets.harness.environments.guess_number import GuessNumber
from targets.harness.environments.synthetic_agent import SyntheticAgent

ENVIRONMENTS: dict[str, type[Episode]] = {cls.name: cls for cls in (GuessNumber, SyntheticAgent)}
