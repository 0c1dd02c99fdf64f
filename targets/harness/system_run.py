"""A system run: the candidate's controller drives the candidate's cluster through a harness proxy,
with harness-owned environments, for a number of training steps.

``TracedCluster`` stamps every call with the harness clock into the trace and snapshots the weights
after each training step, so the audit and the benchmark never depend on the candidate's word.
"""

from __future__ import annotations

from typing import Sequence

from targets.api import Aborted, Cluster, Completion, Device, GenerateRequest, Stack, StateDict, TrainBatch
from targets.harness.environments import EnvironmentPool
from targets.harness.trace import Trace
from targets.spec import TargetSpec


class TracedCluster:
    def __init__(self, inner: Cluster, trace: Trace, weights: dict[int, StateDict]) -> None:
        self.inner, self.trace, self.weights = inner, trace, weights
        self.devices: list[Device] = list(inner.devices)
        self.policy_version = 0

    def now(self) -> float:
        return self.trace.clock.now()

    async def sleep(self, seconds: float) -> None:
        await self.trace.clock.sleep(seconds)

    async def generate(self, request: GenerateRequest) -> Completion:
        start = self.now()
        try:
            completion = await self.inner.generate(request)
        except Aborted:
            self.trace.record("generate", episode=request.episode_id, turn=request.turn, start=start, aborted=True)
            raise
        tokens = self.trace.tokens
        self.trace.record(
            "generate", episode=request.episode_id, turn=request.turn, start=start, aborted=False,
            device=completion.device, prompt=tokens(request.prompt), tokens=tokens(completion.tokens),
            logprobs=tokens(completion.logprobs), version=completion.weight_version, finish=completion.finish_reason,
        )
        return completion

    async def _timed(self, kind, devices: Sequence[Device], call, **data) -> None:
        start = self.now()
        await call
        self.trace.record(kind, start=start, devices=[d.id for d in devices], **data)

    async def shrink(self, devices: Sequence[Device]) -> None:
        await self._timed("shrink", devices, self.inner.shrink(devices))

    async def expand(self, devices: Sequence[Device]) -> None:
        await self._timed("expand", devices, self.inner.expand(devices))

    async def sync_weights(self, version: int, devices: Sequence[Device]) -> None:
        await self._timed("sync", devices, self.inner.sync_weights(version, devices), version=version)

    async def train(self, batch: TrainBatch, devices: Sequence[Device]) -> int:
        start = self.now()
        version = await self.inner.train(batch, devices)
        self.trace.record(
            "train", start=start, devices=[d.id for d in devices], version=version, policy_version=self.policy_version,
            trajectories=[
                {"episode": t.episode_id, "group": t.group_id, "tokens": self.trace.tokens(t.tokens),
                 "loss_mask": self.trace.tokens(t.loss_mask), "logprobs": self.trace.tokens(t.logprobs), "reward": t.reward}
                for t in batch.trajectories
            ],
        )
        self.policy_version = version
        state = await self.inner.export_weights()
        if state is not None:
            self.weights[version] = {k: v.detach().cpu().clone() for k, v in state.items()}
        return version

    async def suspend(self) -> None:
        await self._timed("suspend", self.devices, self.inner.suspend())

    async def resume(self) -> None:
        await self._timed("resume", self.devices, self.inner.resume())

    async def export_weights(self) -> StateDict | None:
        raise PermissionError("export_weights is the harness's; controllers do not call it")

    async def close(self) -> None:
        raise PermissionError("the harness closes the cluster")


async def drive(spec: TargetSpec, controller, cluster: Cluster, steps: int, seed: int, trace: Trace,
                weights: dict[int, StateDict], engines: dict[str, list[str]] | None = None) -> None:
    """Run ``controller`` on ``cluster`` through the harness proxy, with harness environments.

    ``engines`` (harness-known, never the candidate's word) maps a completion's ``device`` to every
    device its engine spans, for clusters whose engines are wider than one device."""
    traced = TracedCluster(cluster, trace, weights)
    envs = EnvironmentPool(spec.workload, trace.clock, trace, seed=seed)
    trace.record("run_start", devices=[d.id for d in cluster.devices], steps=steps,
                 tokens_recorded=trace.record_tokens, engines=engines or {})
    try:
        await controller.run(traced, envs, steps)
    finally:
        trace.record("run_end")
        await cluster.close()


async def run_system(spec: TargetSpec, stack: Stack, steps: int, seed: int, trace: Trace, weights: dict[int, StateDict]) -> None:
    """A real run: the candidate's own cluster (``stack.make_cluster``)."""
    if stack.make_cluster is None:
        raise ValueError("this stack has no real cluster (make_cluster is None)")
    await drive(spec, stack.controller, await stack.make_cluster(), steps, seed, trace, weights)
