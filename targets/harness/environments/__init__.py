"""Harness-owned environments, by name. A target's ``workload.environment.name`` picks one."""

from targets.harness.environments.base import Episode
from targets.harness.environments.guess_number import GuessNumber
from targets.harness.environments.pool import EnvironmentPool
from targets.harness.environments.synthetic_agent import SyntheticAgent

ENVIRONMENTS: dict[str, type[Episode]] = {cls.name: cls for cls in (GuessNumber, SyntheticAgent)}

__all__ = ["ENVIRONMENTS", "Episode", "EnvironmentPool"]
