"""Target specs: pydantic models of the YAML, and the loader (catalog id or path).

Every model forbids unknown fields, so a misspelled key fails with its full field path instead of
being silently ignored. ``SpecError`` carries one readable line per problem.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from targets.api import TrainingConfig
from targets.errors import UserError
from targets.hardware import HARDWARE_CATALOG
from targets.harness.tokenizer import has_chat_template
from targets.workload_profile import with_profile

CATALOG_DIR = Path(__file__).parent / "catalog"
RANDOM_WEIGHTS = re.compile(r"^random\((\d+)\)$")


class SpecError(UserError, ValueError):
    """A target spec that cannot be used; the message names the field path and the value."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- Distributions (turn counts, environment latency) --------------------------------------


class Fixed(Strict):
    kind: Literal["fixed"]
    value: float = Field(ge=0)

    def sample(self, rng: random.Random) -> float:
        return self.value

    def mean_value(self) -> float:
        return self.value


class Geometric(Strict):
    """Number of trials until first success, support 1, 2, ...; long tail for small success rates."""

    kind: Literal["geometric"]
    mean: float = Field(ge=1)

    def sample(self, rng: random.Random) -> float:
        p = 1.0 / self.mean
        if p >= 1.0:
            return 1.0
        return float(1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p)))

    def mean_value(self) -> float:
        return self.mean


class Lognormal(Strict):
    """Heavy-tailed positive values: median ``median``, log-space spread ``sigma``."""

    kind: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)

    def sample(self, rng: random.Random) -> float:
        return self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))

    def mean_value(self) -> float:
        return self.median * math.exp(self.sigma**2 / 2)


Distribution = Annotated[Fixed | Geometric | Lognormal, Field(discriminator="kind")]


# -- Model ---------------------------------------------------------------------------------


class ModelConfig(Strict):
    """The HF-style config fields vibetrain uses (Qwen3 dense and MoE)."""

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    max_position_embeddings: int = Field(default=4096, gt=0)
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_experts: int | None = Field(default=None, gt=0)
    num_experts_per_tok: int | None = Field(default=None, gt=0)
    moe_intermediate_size: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        return self


class ParamCounts(Strict):
    total: float = Field(gt=0)
    active: float = Field(gt=0)


class ModelSpec(Strict):
    family: Literal["qwen3", "qwen3_moe"]
    config: ModelConfig
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    weights: str
    tokenizer: Literal["words", "bpe"] | None = None  # built with random weights (docs/targets.md)
    params: ParamCounts | None = None

    @field_validator("weights")
    @classmethod
    def _weights_exist(cls, value: str, info: ValidationInfo) -> str:
        if RANDOM_WEIGHTS.match(value):
            return value
        base = (info.context or {}).get("base_dir", Path.cwd())
        path = Path(value).expanduser()
        path = path if path.is_absolute() else Path(base) / path
        if not path.exists():
            raise ValueError(f"weights path does not exist: {path} (use a local model directory or random(SEED))")
        return str(path.resolve())

    @model_validator(mode="after")
    def _family_fields(self) -> ModelSpec:
        moe_fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        have = [f for f in moe_fields if getattr(self.config, f) is not None]
        if self.family == "qwen3_moe" and len(have) != len(moe_fields):
            missing = [f for f in moe_fields if f not in have]
            raise ValueError(f"family qwen3_moe needs config fields {missing}")
        if self.family == "qwen3" and have:
            raise ValueError(f"family qwen3 is dense; remove MoE config fields {have}")
        return self

    @model_validator(mode="after")
    def _tokenizer_with_random_weights(self) -> ModelSpec:
        if self.tokenizer is not None and self.random_seed is None:
            raise ValueError(
                f"tokenizer: {self.tokenizer} is for random weights; the model directory {self.weights} brings its own"
            )
        return self

    @property
    def tokenizer_kind(self) -> str | None:
        """The tokenizer built with random weights (``words`` unless stated); None for a directory's own."""
        return None if self.random_seed is None else self.tokenizer or "words"

    @property
    def random_seed(self) -> int | None:
        match = RANDOM_WEIGHTS.match(self.weights)
        return int(match.group(1)) if match else None

    def param_counts(self) -> ParamCounts:
        """Stated counts, else computed from the config (embeddings included)."""
        if self.params is not None:
            return self.params
        c = self.config
        attn = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        attn += 2 * c.head_dim + 2 * c.hidden_size  # q/k norms, two RMSNorms per layer
        embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.hidden_size
        if self.family == "qwen3_moe":
            expert = 3 * c.hidden_size * c.moe_intermediate_size
            router = c.hidden_size * c.num_experts
            total = embed + c.num_hidden_layers * (attn + router + c.num_experts * expert)
            active = embed + c.num_hidden_layers * (attn + router + c.num_experts_per_tok * expert)
            return ParamCounts(total=total, active=active)
        mlp = 3 * c.hidden_size * c.intermediate_size
        total = embed + c.num_hidden_layers * (attn + mlp)
        return ParamCounts(total=total, active=total)


# -- Hardware ------------------------------------------------------------------------------


class HardwareSpec(Strict):
    """A device kind from ``targets.hardware`` plus any per-spec overrides of its numbers."""

    kind: str
    count: int = Field(gt=0)
    memory_gb: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0)
    hbm_bandwidth_gbs: float = Field(gt=0)
    intra_node_bandwidth_gbs: float = Field(gt=0)
    inter_node_bandwidth_gbs: float = Field(gt=0)
    host_link_bandwidth_gbs: float = Field(gt=0)
    devices_per_node: int = Field(gt=0)
    mfu: float = Field(default=0.4, gt=0, le=1)

    def device_ids(self) -> list[str]:
        """The devices' names, ``kind:index``: the one way they are written everywhere."""
        return [f"{self.kind}:{i}" for i in range(self.count)]

    @model_validator(mode="before")
    @classmethod
    def _fill_from_catalog(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "kind" not in data:
            return data
        kind = data["kind"]
        if kind not in HARDWARE_CATALOG:
            raise ValueError(f"unknown hardware kind {kind!r}; known kinds: {sorted(HARDWARE_CATALOG)}")
        return {**HARDWARE_CATALOG[kind], **data}


# -- Workload ------------------------------------------------------------------------------


class EnvironmentRef(Strict):
    """A harness environment by ``name``, or the user's own by ``entry`` (``package.module:callable``,
    called with ``params``) spoken to through an ``adapter`` (``docs/targets.md``)."""

    name: str | None = None
    entry: str | None = None
    adapter: Literal["gymnasium", "tasks", "text"] | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_environment(self) -> EnvironmentRef:
        from targets.harness.environments.registry import ENVIRONMENTS  # late: environments import this module

        if (self.name is None) == (self.entry is None):
            raise ValueError("name a harness environment (name) or bring your own (entry: package.module:callable)")
        if self.entry is not None:
            if self.adapter is None:
                raise ValueError(f"entry {self.entry}: say its adapter (gymnasium, tasks or text)")
            from targets.harness.environments.adapters import load_entry

            load_entry(self.entry)  # importable now, or an error that names it
            return self
        if self.adapter is not None:
            raise ValueError(f"adapter {self.adapter} is for a user's entry, not the harness environment {self.name}")
        if self.name not in ENVIRONMENTS:
            raise ValueError(f"unknown environment {self.name!r}; known environments: {sorted(ENVIRONMENTS)}")
        ENVIRONMENTS[self.name].Params.model_validate(self.params)
        return self

    @property
    def label(self) -> str:
        """How a person names it: the harness environment's name or the user's entry."""
        return self.name or str(self.entry)


class TurnsSpec(Strict):
    """Turns per episode, capped at ``max``. ``dist`` is given exactly when the environment draws the
    turn count (``synthetic_agent``); environments whose episodes end by the policy's own play
    (``guess_number``) reject it rather than silently ignore it."""

    max: int = Field(gt=0)
    dist: Distribution | None = None


class ResponseLengthSpec(Strict):
    """How many of a turn's ``tokens.response`` budget the simulated model generates (a real model
    decides for itself, so real execution ignores this). Lognormal, cut at the budget: the product of
    a per-task factor (``task_sigma``; shared by a group's members and by every turn of their
    episodes, so a hard task stays long) and a per-turn factor (``turn_sigma``). ``mean`` is the mean
    after the cut; ``targets/harness/sim/response_length.py`` solves for the median that gives it."""

    mean: float = Field(gt=0, description="mean tokens a turn generates, after the cut at the budget")
    task_sigma: float = Field(default=0.0, ge=0, le=3, description="log-space spread between tasks")
    turn_sigma: float = Field(default=0.0, ge=0, le=3, description="log-space spread between turns of one task")


class TokensSpec(Strict):
    prompt: int = Field(gt=0, description="prompt tokens at reset")
    observation: int = Field(gt=0, description="observation tokens per turn")
    response: int = Field(gt=0, description="max new tokens per turn")
    max_sequence: int = Field(gt=0, description="max tokens of a whole trajectory")
    response_length: ResponseLengthSpec | None = Field(
        default=None, description="simulator: tokens a turn generates (default: the whole budget, every turn)"
    )
    draft_acceptance: float = Field(
        default=0.0, ge=0, lt=1, description="simulator: share of speculative draft tokens the model keeps"
    )

    @model_validator(mode="after")
    def _fits(self) -> TokensSpec:
        if self.prompt + self.response > self.max_sequence:
            raise ValueError(
                f"prompt ({self.prompt}) + response ({self.response}) exceeds max_sequence ({self.max_sequence})"
            )
        return self

    @model_validator(mode="after")
    def _response_mean_reachable(self) -> TokensSpec:
        r = self.response_length
        if r is None:
            return self
        spread = r.task_sigma > 0 or r.turn_sigma > 0
        if r.mean > self.response or (spread and r.mean >= self.response) or r.mean < 1:
            raise ValueError(
                f"response_length.mean ({r.mean}) must lie in [1, response ({self.response})]"
                + (", below it when the lengths spread" if spread else "")
            )
        return self


class TrainingSpec(Strict):
    lr: float = Field(default=1e-3, gt=0)
    clip_eps: float = Field(default=0.2, gt=0)
    kl_coef: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    temperature: float = Field(default=1.0, gt=0)

    def config(self) -> TrainingConfig:
        return TrainingConfig(
            lr=self.lr, clip_eps=self.clip_eps, kl_coef=self.kl_coef, max_grad_norm=self.max_grad_norm
        )


class WorkloadSpec(Strict):
    environment: EnvironmentRef
    turns: TurnsSpec
    tokens: TokensSpec
    env_latency_s: Distribution
    env_latency_max_s: float = Field(gt=0, description="cap on one environment step's latency")
    env_failure_rate: float = Field(
        default=0.0, ge=0, lt=1, description="chance an environment step fails (tool or sandbox crash)"
    )
    env_restart_s: float = Field(
        default=30.0, ge=0, description="seconds to restart a failed environment to its state before the step"
    )
    trajectory_timeout_s: float = Field(gt=0)
    batch_size: int = Field(gt=0, description="trajectories per training step")
    group_size: int = Field(ge=2, description="trajectories per GRPO group (same task)")
    async_ratio: int = Field(ge=0, description="max weight versions a sample may lag behind")
    max_async_ratio: int | None = Field(
        default=None, ge=0, description="the largest async_ratio a stack may choose for itself (default: async_ratio)"
    )
    train_steps: int = Field(gt=0, description="training steps a benchmark run measures")
    training: TrainingSpec = TrainingSpec()

    profile: str | None = Field(default=None, exclude=True, description="the workload profile its keys came from")

    @model_validator(mode="before")
    @classmethod
    def _profiled(cls, data: Any, info: ValidationInfo) -> Any:
        return with_profile(data, Path((info.context or {}).get("base_dir", Path.cwd())))

    @model_validator(mode="after")
    def _groups_and_ratios(self) -> WorkloadSpec:
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size})")
        if self.max_async_ratio is not None and self.max_async_ratio < self.async_ratio:
            raise ValueError(
                f"max_async_ratio ({self.max_async_ratio}) must be at least async_ratio ({self.async_ratio})"
            )
        return self

    @property
    def staleness_limit(self) -> int:
        """The largest staleness bound a stack may declare on this target."""
        return self.async_ratio if self.max_async_ratio is None else self.max_async_ratio

    @model_validator(mode="after")
    def _turns_match_environment(self) -> WorkloadSpec:
        from targets.harness.environments.registry import ENVIRONMENTS

        env = self.environment
        draws = env.name is not None and ENVIRONMENTS[env.name].draws_turns  # a user's environment ends by play
        if draws and self.turns.dist is None:
            raise ValueError(f"environment {env.label} draws turn counts: set turns.dist")
        if not draws and self.turns.dist is not None:
            raise ValueError(f"environment {env.label} ends episodes by play, not by a drawn count: remove turns.dist")
        return self

    @property
    def groups_per_step(self) -> int:
        return self.batch_size // self.group_size

    @property
    def declared_limits(self) -> dict[str, tuple[str, int]]:
        """The most a stack may declare (``targets.api.Declared``) on this workload, by field: (what
        the limit is, its value). A staleness bound up to ``max_async_ratio``. Spares up to one more
        group's worth per group: beyond that, keeping the first finishers is mostly a choice of the
        quick episodes. Deferred tasks relaunched at most a step's groups at a time, since up to
        ``tail_round - 1`` of them may go unrun at the end: less than one batch of tasks, never an
        unbounded share of the run chosen by length."""
        return {
            "async_ratio": ("max_async_ratio", self.staleness_limit),
            "redundant_per_group": ("group_size", self.group_size),
            "tail_round": ("groups per step", self.groups_per_step),
        }

    def over_declared_limits(self, declared) -> str | None:
        """Why ``declared`` (a ``targets.api.Declared``) asks for more than this workload allows, or None."""
        for field, (what, limit) in self.declared_limits.items():
            value = getattr(declared, field)
            if value is not None and value > limit:
                return f"the stack declares {field} {value}, over the target's {what} {limit}"
        return None


# -- Baselines, accuracy tolerances, the target --------------------------------------------


class BaselineSpec(Strict):
    name: Literal["colocate", "static_split", "time_multiplex"]
    rollout_devices: int | None = Field(default=None, gt=0)
    train_devices: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _split_given(self) -> BaselineSpec:
        if self.name == "static_split" and (self.rollout_devices is None or self.train_devices is None):
            raise ValueError("static_split needs rollout_devices and train_devices")
        return self


class AccuracySpec(Strict):
    """Tolerances of the judge's deterministic checks (fp32 CPU defaults)."""

    logprob_atol: float = Field(default=1e-3, gt=0)
    update_rtol: float = Field(default=2e-2, gt=0, description="relative error of a train step's update")
    greedy_tie_margin: float = Field(default=1e-3, ge=0, description="top-2 logit gap under which greedy may differ")
    prompts: int = Field(default=4, gt=0)
    new_tokens: int = Field(default=12, gt=0)
    selection_bias: float | None = Field(
        default=None,
        ge=0,
        description="how much shorter or better rewarded (in standard deviations) the trained episodes may be "
        "than every episode launched; default: what the stack's declared techniques are documented to bias",
    )


class SimulatorSpec(Strict):
    """Efficiencies and fixed overheads of the cluster simulator's cost model
    (``targets/harness/sim/cost_model.py`` documents each formula). ``vibetrain calibrate`` fits
    them from a real run's trace; the defaults are typical of large GPU deployments."""

    rollout_mfu: float = Field(default=0.5, gt=0, le=1, description="compute efficiency of prefill and decode")
    hbm_efficiency: float = Field(default=0.8, gt=0, le=1, description="achieved fraction of HBM bandwidth in decode")
    kv_memory_fraction: float = Field(default=0.9, gt=0, le=1, description="device memory an engine may use")
    decode_step_overhead_s: float = Field(
        default=0.003, ge=0, description="fixed cost of one engine iteration (scheduling, launches)"
    )
    request_overhead_s: float = Field(
        default=0.0,
        ge=0,
        description="latency a generate call adds beside its engine's work (the calls to it and back)",
    )
    train_step_overhead_s: float = Field(default=1.0, ge=0)
    sync_overhead_s: float = Field(default=0.5, ge=0)
    switch_overhead_s: float = Field(default=0.5, ge=0, description="fixed cost of an offload or a reload")
    weight_export_s: float = Field(
        default=0.0,
        ge=0,
        description="the harness's copy of the weights after each train step of a real run (the audit replays "
        "from it), which the train call waits for; calibration fits it, 0 where a target only ever simulates",
    )
    engine_devices: int | None = Field(
        default=None, gt=0, description="devices per rollout engine; default: the fewest that fit the weights"
    )
    batching: Literal["continuous", "static"] = Field(
        default="continuous",
        description="continuous: requests join the running batch (vLLM); static: a batch runs to its end first",
    )


class LimitsSpec(Strict):
    """What the judge's child process (harness, reference model, candidate processes) may use. Unset,
    they follow the model's size: host memory holds a float32 reference copy, the trainer's offloaded
    float32 state (weights, gradients, AdamW moments) and the weight snapshots the audit replays
    training from, about 48 bytes per parameter over a 16 GB base (the processes' CUDA and torch
    libraries); time grows with billions of parameters."""

    host_memory_mb: float | None = Field(default=None, gt=0, description="resident memory of the child's process tree")
    time_s: float | None = Field(
        default=None, gt=0, description="seconds one child run (a check, a measurement) may take"
    )

    def resolved(self, parameters: int) -> tuple[float, float]:
        """(host memory in MB, seconds) for a model of ``parameters``."""
        memory = self.host_memory_mb or 16_000 + 48 * parameters / 1e6
        seconds = self.time_s or 600 * max(1.0, parameters / 1e9)
        return memory, seconds


class HeadlineMetric(Strict):
    name: str
    direction: Literal["maximize", "minimize"]


class TargetSpec(Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    description: str
    headline_metric: HeadlineMetric
    noise_threshold: float = Field(ge=0, lt=1, description="relative change below which results are noise")
    model: ModelSpec
    hardware: HardwareSpec
    workload: WorkloadSpec
    execution: Literal["real", "simulated", "auto"]
    baselines: list[BaselineSpec] = Field(min_length=1)
    accuracy: AccuracySpec = AccuracySpec()
    simulator: SimulatorSpec = SimulatorSpec()
    limits: LimitsSpec = LimitsSpec()

    @model_validator(mode="after")
    def _user_environment_speaks_the_models_text(self) -> TargetSpec:
        entry = self.workload.environment.entry
        if entry is not None and self.execution == "simulated":
            raise ValueError(f"workload.environment {entry} is the user's own: it runs for real (execution: real)")
        words, directory = self.model.tokenizer_kind == "words", self.model.random_seed is None
        if entry is not None and (words or (directory and not has_chat_template(Path(self.model.weights)))):
            raise ValueError(
                f"workload.environment {entry} speaks its own text: the model needs a tokenizer with a chat "
                "template (model.tokenizer: bpe, or a model directory whose tokenizer has one)"
            )
        return self

    @model_validator(mode="after")
    def _baselines_fit(self) -> TargetSpec:
        for i, baseline in enumerate(self.baselines):
            used = (baseline.rollout_devices or 0) + (baseline.train_devices or 0)
            if baseline.name == "static_split" and used > self.hardware.count:
                raise ValueError(
                    f"baselines[{i}] static_split uses {used} devices but hardware.count is {self.hardware.count}"
                )
            if baseline.rollout_devices and baseline.rollout_devices > self.hardware.count:
                raise ValueError(
                    f"baselines[{i}] rollout_devices {baseline.rollout_devices} exceeds hardware.count "
                    f"{self.hardware.count}"
                )
        return self


# -- Loading -------------------------------------------------------------------------------


def _format_errors(source: str, error: ValidationError) -> str:
    lines = [f"invalid target spec {source}:"]
    for item in error.errors():
        path = ".".join(str(p) for p in item["loc"]) or "<top level>"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field (check its spelling)"
        shown = item.get("input")
        shown = repr(shown) if not isinstance(shown, (dict, list)) else type(shown).__name__
        lines.append(f"  field `{path}`: {message} (got {shown})")
    return "\n".join(lines)


def parse_target(data: Any, source: str = "<dict>", base_dir: Path | None = None) -> TargetSpec:
    """Validate an already-parsed spec; raises SpecError naming every bad field."""
    if not isinstance(data, dict):
        raise SpecError(f"invalid target spec {source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return TargetSpec.model_validate(data, context={"base_dir": base_dir or Path.cwd()})
    except ValidationError as error:
        raise SpecError(_format_errors(source, error)) from None


def load_target_file(path: Path) -> TargetSpec:
    try:
        text = path.read_text()
    except OSError as error:
        raise SpecError(f"cannot read target spec {path}: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise SpecError(f"target spec {path} is not valid YAML: {error}") from None
    return parse_target(data, source=str(path), base_dir=path.parent)


def catalog_ids() -> list[str]:
    return sorted(p.stem for p in CATALOG_DIR.glob("*.yaml"))


def resolve_target_path(ref: str | Path) -> Path:
    """The YAML file behind a catalog id (``tiny-qwen3-cpu``) or a path."""
    path = Path(ref)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise SpecError(f"target spec file not found: {path}")
        return path
    catalog_path = CATALOG_DIR / f"{ref}.yaml"
    if not catalog_path.exists():
        raise SpecError(
            f"unknown target {str(ref)!r}: not a catalog id (known: {', '.join(catalog_ids())}) and no such file"
        )
    return catalog_path


def load_target(ref: str | Path) -> TargetSpec:
    """A catalog id (``tiny-qwen3-cpu``) or a path to a YAML file."""
    return load_target_file(resolve_target_path(ref))
