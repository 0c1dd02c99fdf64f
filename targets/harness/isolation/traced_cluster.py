"""The harness's proxy in front of a cluster: the one place a candidate's cluster is reached during a
system run. Every call is stamped with the harness's clock into its trace, and after every training
step the weights are exported and sealed (``ipc/weight_export.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from targets.api import Aborted, Cluster, Completion, Device, GenerateRequest, ServingLoad, TrainBatch
from targets.harness.ipc.protocol import ProtocolError
from targets.harness.ipc.weight_export import WeightExporter
from targets.harness.sim.cluster import Answer, SimCluster
from targets.harness.trace import Trace


class Generating:
    """A turn the cluster is serving. ``cancel`` stops it when its episode was dropped: the cluster is
    told to stop (the simulator's engine frees it; a candidate's ``generate`` is cancelled, and its
    engine should abort the request) and the trace records ``generate_cancelled``. ``task``: a
    candidate cluster's call (None on the simulator)."""

    __slots__ = ("request", "start", "trace", "task", "cancel_inner", "answered", "cancelled")

    def __init__(self, request: GenerateRequest, start: float, trace: Trace) -> None:
        self.request, self.start, self.trace = request, start, trace
        self.task: asyncio.Task | None = None
        self.cancel_inner: Callable[[], object] = lambda: None  # the cluster's way to stop it
        self.answered = self.cancelled = False

    @property
    def under_way(self) -> bool:
        return not (self.answered or self.cancelled)

    def cancel(self) -> bool:
        """Stop serving it, unless it was answered already; whether it was under way."""
        if not self.under_way:
            return False
        self.cancelled = True
        self.cancel_inner()
        request = self.request
        self.trace.record("generate_cancelled", episode=request.episode_id, turn=request.turn, start=self.start)
        return True


class TracedCluster:
    """The harness's proxy in front of a cluster: every call stamped into the trace, the weights
    exported after every training step (a real run's; ``weight_export.py``). ``steps`` counts
    training steps as the harness saw them."""

    def __init__(self, inner: Cluster, trace: Trace, exporter: WeightExporter | SimCluster) -> None:
        self.inner, self.trace, self.exporter = inner, trace, exporter
        self.devices: list[Device] = list(inner.devices)
        self.by_id = {d.id: d for d in self.devices}
        self.steps = 0
        self._parts: list[tuple[float, TrainBatch]] = []  # the next step's parts so far (stream training)
        self._part_devices: list[str] = []
        self._training = asyncio.Lock()  # one training call at a time: a part is checked and filed whole
        self._resident: dict | None = None
        self.last_device: dict[str, str] = {}  # episode -> the device that served its latest turn

    @property
    def training(self) -> bool:
        """A training call is under way: its step trained, or training, its weights not yet exported."""
        return self._training.locked()

    def generate_then(self, request: GenerateRequest, done: Answer) -> Generating:
        """Serve ``request`` on the cluster and record it; ``done`` is told its completion or the
        error it ended in. The simulator answers by callback; a cluster that answers only by await
        (a candidate's) gets a task, which the caller awaits at the end of the run."""
        start = self.trace.clock.now()
        generating = Generating(request, start, self.trace)

        def recorded(result: Completion | BaseException) -> None:
            if generating.cancelled:  # answered as it was cancelled: nobody asks for it now
                return
            generating.answered = True
            if isinstance(result, Completion):
                self._record(request, result, start, aborted=False)
            elif isinstance(result, Aborted) and result.partial is None:
                self.trace.record("generate", episode=request.episode_id, turn=request.turn, start=start, aborted=True)
            elif isinstance(result, Aborted):  # what it decoded is recorded: a resumed turn's response is checked
                self._record(request, result.partial, start, aborted=True)
            else:  # the cluster failed it: recorded, so a turn asked again after a failure shows (the audit's)
                failed = f"{type(result).__name__}: {result}"[:500]
                self.trace.record(
                    "generate", episode=request.episode_id, turn=request.turn, start=start, aborted=True, failed=failed
                )
            done(result)

        then = getattr(self.inner, "generate_then", None)
        if then is not None:
            generating.cancel_inner = then(request, recorded)
            return generating
        task = asyncio.ensure_future(self.inner.generate(request))
        task.add_done_callback(lambda task: None if task.cancelled() else recorded(task.exception() or task.result()))
        generating.task, generating.cancel_inner = task, task.cancel
        return generating

    def _record(self, request: GenerateRequest, completion: Completion, start: float, aborted: bool) -> None:
        tokens, p = self.trace.tokens, request.params
        said = self._engine_word(request, completion, start)
        self.last_device[request.episode_id] = completion.device
        self.trace.record(
            "generate",
            episode=request.episode_id,
            turn=request.turn,
            start=start,
            aborted=aborted,
            device=completion.device,
            routed=request.device,
            prompt=tokens(request.prompt),
            continues=request.continues,
            tokens=tokens(completion.tokens),
            logprobs=tokens(completion.logprobs),
            version=completion.weight_version,
            finish=completion.finish_reason,
            temperature=p.temperature,
            max_new_tokens=p.max_new_tokens,
            stop=list(p.stop_token_ids),
            seed=p.seed,
            **said,
        )

    def _engine_word(self, request: GenerateRequest, completion: Completion, start: float) -> dict:
        """What the engine says of its work on the request (``Completion.queued_s``, ``cached_tokens``), which
        calibration alone reads, held to what the harness saw: no longer a wait than the request took, no
        more of a prefix than its prompt (``word_cut`` marks one cut so; calibrate counts them)."""
        said: dict = {}
        if completion.queued_s is not None:
            said["queued"] = min(completion.queued_s, self.trace.clock.now() - start)
        if completion.cached_tokens is not None:
            said["cached"] = min(completion.cached_tokens, len(request.prompt))
        if said.get("queued") != completion.queued_s or said.get("cached") != completion.cached_tokens:
            said["word_cut"] = True
        return said

    async def _timed(self, kind, devices: Sequence[Device], call, **data) -> None:
        start = self.trace.clock.now()
        await call
        self.trace.record(kind, start=start, devices=[d.id for d in devices], **data)
        if kind != "sync":
            await self._residency()

    async def _residency(self) -> None:
        """Who holds each device now, in the cluster's words (recorded when it changes)."""
        state = await self.inner.residency()
        if not isinstance(state, dict) or not all(
            isinstance(v, list) and all(isinstance(c, str) for c in v) for v in state.values()
        ):
            raise ProtocolError(f"residency must map devices to lists of component names, got {str(state)[:200]}")
        if state != self._resident:
            self._resident = state
            self.trace.record("device_state", resident={k: sorted(v) for k, v in state.items()})

    async def shrink(self, devices: Sequence[Device]) -> None:
        await self._timed("shrink", devices, self.inner.shrink(devices))

    async def expand(self, devices: Sequence[Device]) -> None:
        await self._timed("expand", devices, self.inner.expand(devices))

    async def sync_weights(self, version: int, devices: Sequence[Device], interrupt: bool = False) -> None:
        await self._timed(
            "sync", devices, self.inner.sync_weights(version, devices, interrupt), version=version, interrupt=interrupt
        )

    def _same_devices(self, devices: Sequence[Device], call: str) -> None:
        """A step's parts and the step itself run on one set of devices (one trainer holds the
        parts' gradients)."""
        ids = [d.id for d in devices]
        if self._parts and sorted(ids) != sorted(self._part_devices):
            raise ValueError(
                f"{call} on {ids}: this step's parts were trained on {self._part_devices} "
                "(a step and its parts run on the same devices)"
            )

    async def train_part(self, batch: TrainBatch, devices: Sequence[Device]) -> None:
        """Stream training: the groups are recorded with the step they join, and the step's ``train``
        event lists them with the time each was taken (``consumed``). Training calls run one at a
        time (calls a controller makes at once wait their turn), so parts can neither race the device
        check nor land in another step than the one they were taken for."""
        async with self._training:
            start = self.trace.clock.now()
            self._same_devices(devices, "train_part")
            await self.inner.train_part(batch, devices)
            self._parts.append((start, batch))
            self._part_devices = [d.id for d in devices]
            self.trace.record(
                "train_part",
                start=start,
                step=self.steps + 1,
                devices=[d.id for d in devices],
                episodes=[t.episode_id for t in batch.trajectories],
            )
            await self._residency()

    async def train(self, batch: TrainBatch, devices: Sequence[Device]) -> int:
        async with self._training:
            return await self._train(batch, devices)

    async def _train(self, batch: TrainBatch, devices: Sequence[Device]) -> int:
        """The batch is recorded as the harness received it (what the trainer gets and the audit
        replays): this step's parts first, each trajectory with ``consumed``, when it stopped being
        in flight (its part's start; ``start``, the call's, for the batch's own)."""
        start = self.trace.clock.now()
        self._same_devices(devices, "train")
        await self.exporter.saved()  # the previous version's snapshot is on disk before the next step
        self.steps += 1
        step, tokens = self.steps, self.trace.tokens
        version = await self.inner.train(batch, devices)
        parts, self._parts = [*self._parts, (start, batch)], []
        self.trace.record(
            "train",
            start=start,
            step=step,
            devices=[d.id for d in devices],
            version=version,
            advantages=[a for _, part in parts for a in part.advantages],
            trajectories=[
                {
                    "episode": t.episode_id,
                    "group": t.group_id,
                    "tokens": tokens(t.tokens),
                    "loss_mask": tokens(t.loss_mask),
                    "logprobs": tokens(t.logprobs),
                    "reward": t.reward,
                    "consumed": consumed,
                }
                for consumed, part in parts
                for t in part.trajectories
            ],
        )
        export_start = self.trace.clock.now()
        await self.exporter.export(step)
        self.trace.record("weight_export", start=export_start, step=step)
        await self._residency()
        return version

    async def serving_load(self) -> ServingLoad:
        """The harness's measure of the serving traffic (the simulator's; nothing a stack reports)."""
        return await self.inner.serving_load()

    async def suspend(self) -> None:
        await self._timed("suspend", self.devices, self.inner.suspend())

    async def resume(self) -> None:
        await self._timed("resume", self.devices, self.inner.resume())
