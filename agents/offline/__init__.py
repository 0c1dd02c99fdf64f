"""The offline backend: deterministic, skill-driven agents that need no network and no API key."""

from __future__ import annotations

from agents.offline.evaluator import OfflineEvaluator
from agents.offline.implementer import OfflineImplementer
from agents.offline.judge import OfflineJudge
from agents.offline.planner import OfflinePlanner
from agents.roles import Agents
from targets.harness.measure.session import Session


def make_offline_agents(session: Session, *, engine_devices: int, seed: int, repeat: int) -> Agents:
    spec = session.target.spec
    planner = OfflinePlanner(spec, engine_devices, seed, session.target.simulated)
    return Agents(
        backend="offline",
        planner=planner,
        implementer=OfflineImplementer(spec, planner),
        judge=OfflineJudge(session),
        evaluator=OfflineEvaluator(session, repeat),
    )
