"""The reference GRPO loop: one process, co-located, synchronous.

Each step: new groups of episodes, all rolled out in lock-step turns with the reference engine
(environment steps of a turn run concurrently), group-relative advantages, one reference trainer
step, weights copied into the engine. The yardstick a candidate stack's learning is compared to.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from targets.api import SamplingParams, TrainBatch, Trajectory
from targets.harness.clock import WallClock
from targets.harness.environments import EnvironmentPool, Episode, close_environments
from targets.harness.model import load_model, model_dir
from targets.harness.reference.engine import ReferenceEngine
from targets.harness.reference.grpo import group_advantages
from targets.harness.reference.trainer import ReferenceTrainer
from targets.harness.tokenizer import stop_token_ids
from targets.harness.trace import Trace
from targets.spec import TargetSpec

log = logging.getLogger("vibetrain.reference")


@dataclass
class StepStats:
    step: int
    mean_reward: float
    mean_turns: float
    response_tokens: int
    timeouts: int
    loss: float
    grad_norm: float
    seconds: float


async def rollout_lockstep(
    engine: ReferenceEngine, episodes: list[Episode], spec: TargetSpec, seed: int, stops: tuple[int, ...]
) -> list[Trajectory]:
    """Roll every episode to its end, each turn stopping on ``stops``; one Trajectory per episode, in order.
    A user's environments are closed once all have ended (what they hold, a subprocess or a sandbox, let go)."""
    try:
        built = await _rollout(engine, episodes, spec, seed, stops)
    except BaseException:
        for failed in await close_environments(episodes):  # the rollout's error is the one raised; the closes' are said
            log.error("closing after the rollout failed: %s", failed)
        raise
    failed = await close_environments(episodes)
    for later in failed[1:]:
        log.error("closing: %s", later)
    if failed:
        raise failed[0]
    return built


async def _rollout(
    engine: ReferenceEngine, episodes: list[Episode], spec: TargetSpec, seed: int, stops: tuple[int, ...]
) -> list[Trajectory]:
    tokens_spec, training = spec.workload.tokens, spec.workload.training
    prompts = await asyncio.gather(*(e.reset() for e in episodes))
    built = [
        Trajectory(e.episode_id, e.group_id, list(p), [0] * len(p), [0.0] * len(p), 0.0, [])
        for e, p in zip(episodes, prompts)
    ]
    active = [i for i in range(len(episodes))]
    turn = 0
    while active:
        # A turn that cannot fit in max_sequence ends the trajectory (truncation) before generating.
        active = [i for i in active if len(built[i].tokens) + tokens_spec.response <= tokens_spec.max_sequence]
        if not active:
            break
        params = SamplingParams(
            max_new_tokens=tokens_spec.response,
            temperature=training.temperature,
            seed=seed * 10_007 + turn,
            stop_token_ids=stops,
        )
        completions = engine.generate([built[i].tokens for i in active], params)
        results = await asyncio.gather(*(episodes[i].step(c.tokens) for i, c in zip(active, completions)))
        still_active = []
        for i, completion, result in zip(active, completions, results):
            built[i].append_turn(completion, result)
            if not result.done:
                still_active.append(i)
        active = still_active
        turn += 1
    return built


def run_reference(
    spec: TargetSpec, steps: int, seed: int = 0, on_step: Callable[[StepStats], None] | None = None
) -> list[StepStats]:
    if spec.execution == "simulated":
        raise ValueError(f"target {spec.id} is simulated-only; the reference loop needs real execution")
    if spec.workload.reward_model is not None:
        raise ValueError(f"target {spec.id} has a reward model: the reference loop trains on environment rewards only")
    torch.manual_seed(seed)
    path = model_dir(spec.model)
    model, stops = load_model(path, spec.model.dtype), stop_token_ids(path)
    engine = ReferenceEngine(copy.deepcopy(model))  # in the model's dtype
    # float32 masters, as a trainer keeps (a bf16 AdamW step at lr 1e-6 moved 1.9% of a bf16 model's weights)
    trainer = ReferenceTrainer(model.float(), spec.workload.training.config())
    clock = WallClock()
    pool = EnvironmentPool(spec.workload, clock, Trace(clock), seed=seed, model_path=str(path))
    history = []
    try:
        for step in range(steps):
            started = time.monotonic()
            episodes = [e for _ in range(spec.workload.groups_per_step) for e in pool.new_group()]
            trajectories = asyncio.run(rollout_lockstep(engine, episodes, spec, seed * 100_003 + step, stops))
            version = trainer.train_step(TrainBatch(trajectories, group_advantages(trajectories)))
            engine.load_weights(trainer.state_dict(), version)
            stats = StepStats(
                step=step,
                mean_reward=sum(t.reward for t in trajectories) / len(trajectories),
                mean_turns=sum(len(t.weight_versions) for t in trajectories) / len(trajectories),
                response_tokens=sum(t.response_tokens for t in trajectories),
                timeouts=sum(t.timed_out for t in trajectories),
                loss=trainer.last_loss,
                grad_norm=trainer.last_grad_norm,
                seconds=time.monotonic() - started,
            )
            history.append(stats)
            if on_step:
                on_step(stats)
    finally:
        pool.close()  # the process its environments ran in, when they are the user's
    return history
