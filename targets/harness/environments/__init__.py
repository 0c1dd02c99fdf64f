"""Harness-owned environments: each episode an ``Episode`` (``base.py``), the built-in ones by name
(``registry.py``), the ``EnvSource`` a controller draws groups from (``pool.py``), and the seeds a
run's workload is drawn from (``seeds.py``)."""

from targets.harness.environments.base import Episode, close_environments
from targets.harness.environments.pool import EnvironmentPool
from targets.harness.environments.registry import ENVIRONMENTS

__all__ = ["ENVIRONMENTS", "Episode", "EnvironmentPool", "close_environments"]
