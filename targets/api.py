"""The target contract's public types: the only harness module a candidate stack may import.

The data that flows through a stack (sampling parameters, completions, trajectories, batches); the
protocols a candidate implements or drives (``RolloutEngine``, ``Trainer``, ``Cluster``,
``Controller``) and the environment handles the harness hands it (``EnvHandle``, ``EnvSource``); the
trace events the harness records (the audit and the benchmark read only these). Plain dataclasses
and ``typing.Protocol``: a stack written by any agent follows the contract without harness code.

In simulated execution every token sequence a controller handles is a ``TokenCount``: its length.
Code that only measures and joins sequences (``len``, ``+``, ``Trajectory.append_turn``) runs on both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is only needed for annotations here; keep this module import-light.
    import torch

TokenIds = list[int]
StateDict = Mapping[str, "torch.Tensor"]


class TokenCount(Sequence[int]):
    """A token (or logprob) sequence known by its length alone: a simulated run's prompts, completions,
    observations and trajectories (its cluster is a cost model: only how many tokens matter). Joining
    counts adds them (a list joined to a count is a count); reading a token raises (a controller that
    looks at token values works only on a real cluster). ``ones``: a loss mask's 1 entries."""

    __slots__ = ("n", "ones")

    def __init__(self, n: int, ones: int = 0) -> None:
        if n < 0 or not 0 <= ones <= n:
            raise ValueError(f"TokenCount({n}, ones={ones}): a count is >= 0 and holds at most n ones")
        self.n, self.ones = n, ones

    def __len__(self) -> int:
        return self.n

    def _no_values(self, *_):
        raise TypeError("a simulated run keeps token counts, not tokens: this sequence has no values to read")

    __getitem__ = __iter__ = _no_values

    def __add__(self, other: Sequence) -> TokenCount:
        return TokenCount(self.n + len(other))

    __radd__ = __add__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenCount) and other.n == self.n

    def __hash__(self) -> int:
        return hash(("TokenCount", self.n))

    def __repr__(self) -> str:
        return f"TokenCount({self.n})"


# -- Generation --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request. ``temperature == 0`` means greedy.

    Logprobs are those of the distribution each token was drawn from, softmax(logits / temperature)
    (softmax(logits) when greedy): the policy the GRPO step trains (``TrainingConfig``, as verl, TRL)."""

    max_new_tokens: int
    temperature: float = 1.0
    seed: int | None = None  # one per turn, all its segments (the audit names a reseeded turn); apart per episode
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")


FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Completion:
    """What an engine returns for one prompt: new tokens, their logprobs, and who produced them (``device``:
    the engine, by its first device, which the audit holds to serving in arrival order). ``queued_s`` and
    ``cached_tokens``: the engine's word on its own work, read by calibration alone (None: not said): the
    seconds the request waited with none of it computing (for KV room, behind a load, after a preemption),
    and its prompt's leading tokens reused from the prefix cache (vLLM's ``num_cached_tokens``), so that a
    fit counts neither a wait as decoding nor an evicted prefix as cached."""

    tokens: TokenIds
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int
    device: str = ""
    queued_s: float | None = None
    cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(f"Completion has {len(self.tokens)} tokens but {len(self.logprobs)} logprobs")


@dataclass(frozen=True)
class GenerateRequest:
    """One turn of one trajectory, as a controller asks the cluster to generate it.

    ``device`` is a routing request: serve the turn on the engine that holds this device if that
    engine is active; ``None`` (or an engine that is not active) leaves the choice to the cluster.

    ``continues`` > 0 resumes an interrupted turn (partial rollout): the prompt's last ``continues``
    tokens are this turn's response so far (what ``Aborted.partial`` returned), and
    ``params.max_new_tokens`` is the response budget left. The engine serves it as any prompt."""

    episode_id: str
    turn: int
    prompt: TokenIds
    params: SamplingParams
    device: str | None = None
    continues: int = 0


class Aborted(Exception):
    """Raised by ``Cluster.generate`` when the engine serving the request was shrunk, suspended or interrupted by
    ``sync_weights(..., interrupt=True)``. ``partial`` holds the tokens decoded before the interruption (finish
    ``"abort"``, the version and device that decoded them), always sent, empty if none were: the audit explains an
    abort only by a shrink, suspend or interrupting sync of that device. Stacks that declare ``partial_rollout``
    resume the turn from it (``GenerateRequest.continues``); others retry from the start. Engines admit in the order
    the harness forwarded (not Ray's: the kit's ``arrival_order.py``) and preempt the youngest first, so a request
    has decoded once a later one on its engine has: for those stacks the audit rejects an empty partial after that."""

    def __init__(self, message: str = "", partial: Completion | None = None) -> None:
        super().__init__(message)
        self.partial = partial


# -- Training data -----------------------------------------------------------------------------------


@dataclass
class Trajectory:
    """One finished episode, laid out as a single token sequence for training.

    ``loss_mask[i]`` is 1 where token ``i`` was generated by the policy (a response token) and 0 for
    prompt/observation tokens. ``logprobs[i]`` is the behaviour policy's logprob for response tokens
    (0.0 elsewhere). ``weight_versions`` records, per turn, the version that generated it; the oldest
    one is what the staleness bound is checked against."""

    episode_id: str
    group_id: str
    tokens: TokenIds
    loss_mask: list[int]
    logprobs: list[float]
    reward: float
    weight_versions: list[int]
    created_at_step: int = 0
    timed_out: bool = False

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"Trajectory {self.episode_id}: tokens ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"logprobs ({len(self.logprobs)}) must have equal lengths"
            )

    @classmethod
    def start(cls, episode_id: str, group_id: str, prompt: Sequence[int], created_at_step: int = 0) -> Trajectory:
        """A trajectory holding only its prompt (what ``EnvHandle.reset`` returned): tokens of a real
        run, a ``TokenCount`` of a simulated one."""
        if isinstance(prompt, TokenCount):
            n = len(prompt)
            return cls(episode_id, group_id, TokenCount(n), TokenCount(n), TokenCount(n), 0.0, [], created_at_step)
        n = len(prompt)
        return cls(episode_id, group_id, list(prompt), [0] * n, [0.0] * n, 0.0, [], created_at_step)

    def append_turn(self, completion: Completion, result: StepResult) -> None:
        """Add one turn: the policy's response (trained on) and the environment's answer (not)."""
        response, observation = len(completion.tokens), len(result.observation)
        if isinstance(self.tokens, TokenCount):
            n = len(self.tokens) + response + observation
            self.tokens, self.logprobs = TokenCount(n), TokenCount(n)
            self.loss_mask = TokenCount(n, ones=self.loss_mask.ones + response)
        else:
            self.tokens += completion.tokens + result.observation
            self.loss_mask += [1] * response + [0] * observation
            self.logprobs += completion.logprobs + [0.0] * observation
        self.weight_versions.append(completion.weight_version)
        self.reward += result.reward
        self.timed_out = self.timed_out or result.timed_out

    @property
    def oldest_version(self) -> int:
        return min(self.weight_versions) if self.weight_versions else 0

    @property
    def response_tokens(self) -> int:
        return self.loss_mask.ones if isinstance(self.loss_mask, TokenCount) else sum(self.loss_mask)


@dataclass
class TrainBatch:
    """A training batch: trajectories with their group-relative advantages (one per trajectory)."""

    trajectories: list[Trajectory]
    advantages: list[float]

    def __post_init__(self) -> None:
        if len(self.trajectories) != len(self.advantages):
            raise ValueError(
                f"TrainBatch has {len(self.trajectories)} trajectories but {len(self.advantages)} advantages"
            )
        if not self.trajectories:
            raise ValueError("TrainBatch is empty")


@dataclass(frozen=True)
class TrainingConfig:
    """The GRPO step every trainer must implement identically (the judge compares against it):
    loss = token-mean over all response tokens of the batch of
           -min(r * A, clip(r, 1 - clip_eps, 1 + clip_eps) * A) + kl_coef * k3(pi || pi_ref)
    with r = exp(logp_new - logp_behaviour), every logp (pi_ref's too) of softmax(logits / temperature), what
    the rollout samples; then global-norm gradient clipping at ``max_grad_norm`` and one AdamW step."""

    lr: float = 1e-3
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    temperature: float = 1.0


# -- Component protocols (what a stack provides) -----------------------------------------------------


@runtime_checkable
class RolloutEngine(Protocol):
    """Batched generation on one device, with versioned weights."""

    weight_version: int

    def generate(self, prompts: Sequence[TokenIds], params: SamplingParams) -> list[Completion]:
        """Decode every prompt; one Completion per prompt, in order."""
        ...

    def load_weights(self, state: StateDict, version: int) -> None:
        """Replace the weights (transformers parameter names) and set ``weight_version``."""
        ...


@runtime_checkable
class Trainer(Protocol):
    """Applies ``TrainingConfig``'s GRPO step; ``version`` counts the steps taken."""

    version: int

    def train_step(self, batch: TrainBatch) -> int:
        """One optimizer step on the batch; returns the new weight version."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Current weights, transformers parameter names, on CPU."""
        ...


# -- Environments (created by the harness, never by the candidate) -----------------------------------


@dataclass(frozen=True)
class StepResult:
    """What an environment answers an action. ``state_changed``: the turn changed state a crash would
    lose (``Workload.env_state``). ``lost``: a crash lost state no checkpoint held; the episode ends."""

    observation: TokenIds
    reward: float
    done: bool
    timed_out: bool = False
    state_changed: bool = True
    lost: bool = False


@runtime_checkable
class EnvHandle(Protocol):
    """One episode of a harness environment. ``reset`` once, then ``step`` until ``done``."""

    episode_id: str
    group_id: str

    async def reset(self) -> TokenIds: ...

    async def step(self, action: TokenIds) -> StepResult: ...

    async def checkpoint(self) -> None:
        """Save the environment's state at this turn boundary (between steps), so a crash later
        restores it instead of losing the episode; it takes the environment's time. Only where
        ``Workload.env_state``: elsewhere environments keep their state through a crash."""
        ...


@dataclass(frozen=True)
class TextStep:
    """What a user's environment answers an action with: its text, the reward, whether it ended."""

    observation: str
    reward: float
    done: bool
    truncated: bool = False  # the end was a limit of its own (gymnasium's truncated), not the play's outcome


@runtime_checkable
class TextEnvironment(Protocol):
    """A user's own environment (``workload.environment.entry``, made by ``environments/adapters.py``). One
    instance an episode, run by the harness in a process of its own (sandboxed: the spec's ``writable`` and
    ``network``): text in, text out, the reward is the reward; ``task`` is the seed the episode's group
    shares. Its ``async close()``, if any, is awaited once the episode (or the run) ends."""

    async def reset(self, task: int) -> str: ...

    async def step(self, action: str) -> TextStep: ...


@runtime_checkable
class EnvSource(Protocol):
    """Hands out new episodes, a GRPO group at a time (all members share one task)."""

    group_size: int

    def new_group(self, extra: int = 0, relaunch: str | None = None) -> list[EnvHandle]:
        """``group_size + extra`` members, ``extra`` spares at most the declared ``redundant_per_group``
        (the first ``group_size`` to finish make the group, the rest are dropped as ``redundant``).
        ``relaunch``: a group dropped as ``deferred`` or ``stale``, whose task the new group runs again
        with new episodes: once, and a relaunched group is never deferred nor relaunched itself."""
        ...


# -- Cluster and controller (the scheduling policy drives the mechanism) -----------------------------


@dataclass(frozen=True)
class Device:
    """A schedulable device: a GPU, or on CPU targets a logical device (a custom Ray resource). Its
    kind's peak numbers (0: not known) say how compute- or bandwidth-rich it is, for a router."""

    id: str
    kind: str
    index: int
    bf16_tflops: float = 0.0
    hbm_bandwidth_gbs: float = 0.0


class WeightExport(Protocol):
    """Where a cluster writes one weight version for the harness: a memory region the harness made
    and seals once the cluster answers (``ipc/weight_export.py``). ``shapes`` names every weight (tied
    names share one tensor: writing either is enough); ``write`` copies a tensor (any dtype, any
    device: a GPU tensor by DMA) into its place as float32."""

    shapes: Mapping[str, tuple[int, ...]]

    def write(self, name: str, tensor: torch.Tensor) -> None: ...


@runtime_checkable
class Cluster(Protocol):
    """The mechanism a controller drives. Real stacks implement it on Ray; the harness simulates it.

    ``generate`` is routed to the active rollout engines (to the request's ``device`` when that engine is active)
    and raises ``Aborted`` if its engine is shrunk mid-request; a dropped episode's turn is cancelled (abort it on
    its engine; a controller awaiting it gets ``RuntimeError``). ``shrink``/``expand`` move devices out of/into the
    rollout pool (draining and offloading/reloading engines). ``train`` runs a step on the given devices and returns
    the new weight version (each ``train_part`` before it starts that step early on whole groups, on the same
    devices: stream training); ``sync_weights`` pushes a version to the engines on ``devices``: it lets the requests
    they are running finish first, or with ``interrupt`` aborts every request it started at once (``Aborted``, its
    partial; never some of them, and only to bring a newer version: docs/judge.md), serving the rest under it."""

    devices: list[Device]

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    async def generate(self, request: GenerateRequest) -> Completion: ...

    async def shrink(self, devices: Sequence[Device]) -> None: ...

    async def expand(self, devices: Sequence[Device]) -> None: ...

    async def train(self, batch: TrainBatch, devices: Sequence[Device]) -> int: ...

    async def train_part(self, batch: TrainBatch, devices: Sequence[Device]) -> None: ...

    async def sync_weights(self, version: int, devices: Sequence[Device], interrupt: bool = False) -> None: ...

    async def suspend(self) -> None: ...

    async def resume(self) -> None: ...

    async def export_weights(self, into: WeightExport) -> None:
        """Write the latest trained weights into ``into`` (every tensor once, float32 whatever the
        trainer computes in) for the harness's audit, which replays every training step against
        them; return only when done. Called by the harness after each ``train``, never by
        controllers; the simulator's cluster is never asked."""
        ...

    async def serving_load(self) -> ServingLoad:
        """The serving pools' traffic now (the harness answers it; a target without one refuses)."""
        ...

    async def residency(self) -> dict[str, list[str]]:
        """Which components hold memory on each device (``"engine"``, ``"trainer"``); the harness
        records it after every shrink, expand, train, suspend and resume, and the audit requires
        that an engine and a trainer never hold one device at once."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class Controller(Protocol):
    """The scheduling policy: run ``steps`` training steps on ``cluster`` with episodes from ``envs``.

    ``placement`` says where engines and trainer ranks live, so any cluster (the candidate's on Ray,
    or the harness's simulator) starts them in the right places before ``run``."""

    def placement(self, devices: list[Device]) -> tuple[list[Device], list[Device]]:
        """(devices that host a rollout engine, devices that host a trainer rank)."""
        ...

    async def run(self, cluster: Cluster, envs: EnvSource, steps: int) -> None: ...


DROP_REASONS = ("stale", "end_of_run", "max_sequence", "redundant", "deferred")
MAX_SPECULATIVE_TOKENS = 8  # the drafts a step an engine may declare (``EngineSettings``): the audit credits no more


class EnvDropper(Protocol):
    """``EnvSource`` also takes back episodes a controller discards on purpose, for a reason the audit
    verifies: ``stale`` (a group member beyond the staleness bound), ``end_of_run`` (after the last
    step), ``max_sequence`` (the next turn cannot fit), ``redundant`` (a declared spare) or ``deferred``
    (tail batching: a group handed back whole); a stale or deferred group's task may run again
    (``new_group(relaunch=...)``). Anything neither trained nor dropped is lost; a turn in flight is stopped."""

    def drop(self, episode_id: str, reason: str) -> None: ...


@dataclass(frozen=True)
class ServingLoad:
    """A serving pool's traffic over the last ``window_s`` (the harness's measure): requests/s, devices
    serving and lent, p99 TTFT (those still waiting count their wait) and TPOT of the requests then,
    the SLOs, and the rate one device serves within them (``capacity_rps``, the harness's profile)."""

    rate_rps: float
    serving: int
    lent: int
    ttft_p99_s: float
    tpot_p99_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    capacity_rps: float
    window_s: float


# -- What the harness hands a stack, and what ``stack.build`` returns --------------------------------


@dataclass(frozen=True)
class Workload:
    """What a stack may know of the workload: the batch it must train on, the staleness bound, the
    token budgets and the GRPO step (environments' turns, seeds and latencies stay with the harness)."""

    batch_size: int
    group_size: int
    async_ratio: int  # the target's staleness bound, unless the stack declares another
    max_async_ratio: int  # the largest bound a stack may declare (``Declared.async_ratio``)
    prompt_tokens: int
    observation_tokens: int
    response_tokens: int  # max new tokens per turn
    max_sequence: int  # max tokens of a whole trajectory
    training: TrainingConfig
    env_state: bool = False  # a crash loses an environment's state back to its last checkpoint
    reward_model: bool = False  # an LLM judge scores each finished trajectory (``EngineSettings.reward``)
    temperature = property(lambda self: self.training.temperature)  # the rollout's (``TrainingConfig``)

    @property
    def groups_per_step(self) -> int:
        return self.batch_size // self.group_size


@dataclass(frozen=True)
class Runtime:
    """Everything a stack may know about where and what it runs; ``build(runtime)`` gets only this."""

    model_path: str
    dtype: str
    devices: tuple[Device, ...]
    device_resource: str  # Ray custom resource naming device i: f"{device_resource}{i}" (capacity 1)
    stop_token_ids: tuple[int, ...]
    workload: Workload
    accelerator: Literal["cpu", "cuda"] = "cpu"  # where components put their tensors
    device_memory_bytes: int = 0  # each device's own memory (0: CPU logical devices share the host's)
    engine_devices: int = 1  # consecutive rollout devices one engine spans (the simulator's tensor-parallel size)
    serving_devices: tuple[Device, ...] = ()  # a serving pool's: rollout may borrow them (expand), never train


@dataclass(frozen=True)
class Declared:
    """What a stack does on purpose that the audit would otherwise count against it; the audit bounds each by what is
    declared here. ``redundant_per_group``: extra episodes launched per group (dropped as ``redundant`` once the
    group has ``group_size`` finished). ``async_ratio``: the staleness bound the stack runs under when it chooses one
    (at most ``Workload.max_async_ratio``; None: the workload's ``async_ratio``). ``partial_rollout``: the stack
    resumes interrupted turns from their partial responses; only then may it resume any, and then it must resume
    every one it trains (keeping some partials and restarting others would let it choose its samples).
    ``tail_round``: the stack defers unfinished groups and relaunches their tasks ``tail_round`` at a time (tail
    batching; 0: it defers none); at most ``tail_round - 1`` deferred tasks may still wait for their relaunch when
    the run ends, so deferring cannot drop tasks it finds too long. ``env_prestart``: the next step's groups start
    before this step trains (their resets overlap it): a step's groups more in flight, the staleness bound as it is.
    The target bounds each (``WorkloadSpec.declared_limits``); the harness refuses more at hello."""

    redundant_per_group: int = 0
    async_ratio: int | None = None
    partial_rollout: bool = False
    tail_round: int = 0
    env_prestart: bool = False


@dataclass(frozen=True)
class EngineSettings:
    """What the simulator models of the stack's engines (a real run's are the stack's own code; the harness records
    this): ``speculative_tokens`` drafted a step while at most ``speculative_batch`` run; where the target's reward
    model judges (``Workload.reward_model``): beside the policy on the engine of the episode's last turn, on
    ``reward_devices`` (never rollout or training), or serverless; ``engine_scale`` times ``Runtime.engine_devices``
    devices an engine (up to the target's maximum); ``host_kv_tokens`` of evicted prefixes kept in host memory."""

    speculative_tokens: int = 0
    speculative_batch: int = 0
    reward: Literal["colocated", "dedicated", "serverless"] = "colocated"
    reward_devices: tuple[str, ...] = ()  # the job's devices set aside for the judge (``dedicated``)
    engine_scale: int = 1
    host_kv_tokens: int = 0
    prefill_chunk: int = 0  # prompt tokens an iteration computes beside the decoding batch (``chunked_prefill``)


@dataclass
class Stack:
    """A candidate, as ``stack.build(runtime)`` returns it. ``make_cluster`` starts the candidate's
    real cluster (None for a simulated-only stack); ``make_engine``/``make_trainer``/``sync_engine``
    expose single components so the judge can run accuracy checks 1-3 on them. Each runs in a
    candidate process of its own; the harness reaches them only through the contract's calls."""

    controller: Controller
    make_cluster: Callable[[], Awaitable[Cluster]] | None
    make_engine: Callable[[], RolloutEngine]
    make_trainer: Callable[[StateDict, TrainingConfig], Trainer]
    sync_engine: Callable[[RolloutEngine, StateDict, int], None]
    declared: Declared = field(default_factory=Declared)
    engine: EngineSettings = field(default_factory=EngineSettings)


# -- Trace events (recorded by the harness with its own clock; candidates never write them) ----------

EventKind = Literal[
    "env_reset",
    "env_step",
    "env_checkpoint",
    "generate",
    "generate_cancelled",  # a turn whose episode was dropped while it generated: the harness stopped it
    "train",
    "train_part",  # stream training: groups given to the next step early (``Cluster.train_part``)
    "sync",
    "shrink",
    "expand",
    "suspend",
    "resume",
    "weight_export",  # the harness copying the trained weights for its audit; the train call waits for it
    "serving",  # a serving pool's run: its requests' p99 TTFT and TPOT, its SLOs, the device-seconds lent
    "reward",  # the reward model judged a finished trajectory: where, its tokens, when, its score
    "reward_service",  # the run's reward placement: devices and device-seconds it held, their busy share
    "device_state",
    "sample_dropped",
    "episode_created",
    "run_start",
    "run_end",
]

DeviceActivity = Literal["rollout", "train", "sync", "switching", "idle"]


@dataclass(frozen=True)
class TraceEvent:
    """One harness-observed fact at harness time ``t`` (seconds since the run started)."""

    kind: EventKind
    t: float
    data: dict[str, Any] = field(default_factory=dict)
