"""Length- and KV-aware routing and admission (the ``kv_routing`` technique) and hardware-affinity
routing (``hardware_affinity``), on the controller's side.

The cluster on its own keeps an episode on the engine that served its previous turn (the prefix is
cached there). That ignores what the requests cost: one engine can hold many long contexts while
another idles, and every request is sent the moment its turn starts, queueing behind a full KV cache.
``RoutedCluster`` wraps the cluster a controller drives and routes each turn itself:

* **load** of an engine is the KV a request needs (its context plus ``max_new_tokens``), summed over
  the requests sent there and not yet answered: a long context weighs more than a short one;
* **sticky with a gate** (verl's prefix routing with an imbalance gate): a turn goes back to the
  engine of its previous turn unless that engine's load exceeds the least loaded one's by more than
  ``slack_tokens``, then to the least loaded engine (losing the prefix, gaining the idle engine);
* **admission** (``admit_tokens`` > 0): a request that would push its engine past ``admit_tokens``
  waits here while the engine holds anything, and waiting requests are admitted longest context
  first (Seer's longest-first: the long ones start early instead of ending the batch's tail).

* **hardware affinity** (``affinity_ratio`` > 0, on devices of more than one kind): each episode's
  prefill tokens (what each turn adds to the prompt) and decode tokens (what it generates) are counted
  as it runs; an episode adding at least ``affinity_ratio`` prompt tokens per generated token is
  prefill-heavy (compute-bound) and prefers the compute-rich engines (the highest peak FLOP/s per byte
  of HBM bandwidth: RollArt's mapping of FrozenLake and SWE trajectories to H800s, decided here per
  trajectory as it runs); the others, whose decode costs about the same on any kind, go where the load
  is least. A preference yields to the gate: when the compute-rich engines' least loaded one holds more
  than ``slack_tokens`` over the least loaded engine of any kind, the turn goes there. An episode's
  first turn, before anything is measured, has no preference.

Engines are groups of ``runtime.engine_devices`` consecutive rollout devices (the cluster groups them
the same way), each known by its first device, the one its completions name. An engine is routable
while all its devices are in the rollout pool, which the wrapper tracks from the controller's
shrink, expand, suspend and resume (a serving pool's engines, ``lendable``, join it when
``serving_harvest`` lends them); while none is, the cluster chooses (``device=None``). The
request's ``device`` is a routing request: a cluster serves a request for an engine that is not
active elsewhere, so a routing mistake costs a prefix, never correctness.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence

from targets.api import Cluster, Completion, Device, GenerateRequest


class RoutedCluster:
    def __init__(
        self,
        cluster: Cluster,
        rollout_devices: list[str],
        engine_devices: int,
        slack_tokens: int,
        admit_tokens: int,
        affinity_ratio: float = 0.0,
        lendable: Sequence[Device] = (),
    ) -> None:
        if slack_tokens < 0 or admit_tokens < 0 or affinity_ratio < 0:
            raise ValueError(
                "the routing slack, admission bound and affinity ratio must be >= 0: "
                f"{slack_tokens}, {admit_tokens}, {affinity_ratio}"
            )
        self.routed_cluster, self.devices = cluster, cluster.devices  # the cluster this one routes for
        self.slack_tokens, self.admit_tokens = slack_tokens, admit_tokens
        known = [*rollout_devices, *(d.id for d in lendable)]  # a serving pool's too: routable once lent
        self.engines = {  # engine (its first device) -> its devices
            known[i]: set(known[i : i + engine_devices]) for i in range(0, len(known), engine_devices)
        }
        self._pool = set(rollout_devices)  # devices in the rollout pool (not shrunk; lent: expanded)
        self._suspended = False
        self.load = dict.fromkeys(self.engines, 0)  # engine -> KV tokens of its requests not yet answered
        self._previous: dict[str, str] = {}  # episode -> the engine of its previous turn
        self._waiting: list[tuple[int, int, asyncio.Future]] = []  # (-tokens, arrival, wake-up), sorted at release
        self._arrival = itertools.count()
        self.affinity_ratio = affinity_ratio
        self.compute_rich = self._compute_rich([*cluster.devices, *lendable]) if affinity_ratio else set()
        if affinity_ratio and not self.compute_rich:  # on, it would do nothing: said, not silently ignored
            raise ValueError(
                f"params affinity_ratio {affinity_ratio}: the rollout devices are of one kind (or their FLOP/s "
                "and bandwidth are unknown): there is no compute-rich engine to prefer; set it to 0"
            )
        self.tokens: dict[str, list[int]] = {}  # episode -> [prefill tokens, decode tokens] so far
        self._context: dict[str, int] = {}  # episode -> its context after its last turn

    def _compute_rich(self, devices) -> set[str]:
        """The engines on the kind with the most FLOP/s per byte of bandwidth; none when one kind (or
        unknown numbers) leaves nothing to choose."""
        by_id = {d.id: d for d in devices}
        ridge = {
            engine: by_id[engine].bf16_tflops / by_id[engine].hbm_bandwidth_gbs
            for engine in self.engines
            if by_id[engine].hbm_bandwidth_gbs > 0
        }
        if len(ridge) < len(self.engines) or len(set(ridge.values())) < 2:
            return set()
        top = max(ridge.values())
        return {engine for engine, value in ridge.items() if value == top}

    def __getattr__(self, name: str):
        return getattr(self.routed_cluster, name)  # train, sync_weights, now, sleep, ...: the cluster's own

    # -- routing ----------------------------------------------------------------------------------
    def _routable(self) -> list[str]:
        if self._suspended:
            return []
        return [engine for engine, devices in self.engines.items() if devices <= self._pool]

    def _choose(self, episode: str) -> str | None:
        engines = self._routable()
        if not engines:
            return None
        least = min(engines, key=lambda e: (self.load[e], e))
        preferred = self._preferred(episode, engines)
        if preferred:
            least_preferred = min(preferred, key=lambda e: (self.load[e], e))
            if self.load[least_preferred] - self.load[least] <= self.slack_tokens:
                engines, least = preferred, least_preferred
        previous = self._previous.get(episode)
        if previous in engines and self.load[previous] - self.load[least] <= self.slack_tokens:
            return previous
        return least

    def _preferred(self, episode: str, engines: list[str]) -> list[str]:
        """The routable compute-rich engines for a prefill-heavy episode; none (no preference) for the
        rest: a prefill costs several times more on a bandwidth-rich device (6.7x on an H20 against an
        H800) while decode costs about the same anywhere (1.2x), so only prefill-heavy work is worth
        steering; decode-heavy work goes where the load is least."""
        if not self.compute_rich or episode not in self.tokens:
            return []
        prefill, decode = self.tokens[episode]
        if prefill < self.affinity_ratio * max(1, decode):
            return []
        return [e for e in engines if e in self.compute_rich]

    def _measure(self, request: GenerateRequest, completion: Completion) -> None:
        """Count what the turn prefilled (the prompt past the previous turn's context) and decoded."""
        episode = request.episode_id
        prefill, decode = self.tokens.setdefault(episode, [0, 0])
        added = len(request.prompt) - self._context.get(episode, 0)
        self.tokens[episode] = [prefill + max(0, added), decode + len(completion.tokens)]
        self._context[episode] = len(request.prompt) + len(completion.tokens)

    async def _admit(self, episode: str, tokens: int) -> str | None:
        """The engine to send to, once it has room (``admit_tokens``); an engine holding nothing
        always has room. Waiting requests look again whenever room may have freed, longest first."""
        while True:
            engine = self._choose(episode)
            if engine is None or not self.admit_tokens or not self.load[engine]:
                return engine
            if self.load[engine] + tokens <= self.admit_tokens:
                return engine
            wake = asyncio.get_running_loop().create_future()
            self._waiting.append((-tokens, next(self._arrival), wake))
            await wake

    def _release(self) -> None:
        """Room may have freed: every waiting request looks again, the longest first."""
        waiting, self._waiting = sorted(self._waiting), []
        for _, _, wake in waiting:
            if not wake.done():
                wake.set_result(None)

    async def generate(self, request: GenerateRequest) -> Completion:
        tokens = len(request.prompt) + request.params.max_new_tokens
        engine = await self._admit(request.episode_id, tokens)
        if engine is not None:
            self.load[engine] += tokens
        try:
            completion = await self.routed_cluster.generate(dataclasses.replace(request, device=engine))
        finally:
            if engine is not None:
                self.load[engine] -= tokens
            self._release()
        self._previous[request.episode_id] = completion.device
        if self.compute_rich:
            self._measure(request, completion)
        return completion

    # -- the rollout pool -------------------------------------------------------------------------
    async def shrink(self, devices) -> None:
        self._pool -= {d.id for d in devices}
        await self.routed_cluster.shrink(devices)

    async def expand(self, devices) -> None:
        await self.routed_cluster.expand(devices)
        self._pool |= {d.id for d in devices}
        self._release()

    async def suspend(self) -> None:
        self._suspended = True
        await self.routed_cluster.suspend()

    async def resume(self) -> None:
        await self.routed_cluster.resume()
        self._suspended = False
        self._release()
