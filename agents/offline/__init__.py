"""The offline backend: deterministic, skill-driven agents that need no network and no API key."""

from __future__ import annotations

from agents.offline.evaluator import OfflineEvaluator
from agents.offline.implementer import OfflineImplementer
from agents.offline.judge import OfflineJudge
from agents.offline.planner import OfflinePlanner
from agents.roles import Agents
from agents.sandbox import Sandbox
from targets.harness.candidate import Limits
from targets.spec import TargetSpec


def make_offline_agents(target: str, spec: TargetSpec, *, simulated: bool, engine_devices: int, seed: int, repeat: int,
                        sandbox: Sandbox, limits: Limits) -> Agents:
    planner = OfflinePlanner(spec, engine_devices, seed, simulated)
    return Agents(
        backend="offline",
        planner=planner,
        implementer=OfflineImplementer(spec, planner),
        judge=OfflineJudge(target, spec, sandbox, limits, simulated),
        evaluator=OfflineEvaluator(target, spec, sandbox, limits, repeat, simulated),
    )
