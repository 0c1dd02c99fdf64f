"""The whole target: model, hardware, workload, baselines, the judge's tolerances, the simulator's terms, limits."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from targets.harness.tokenizer import has_chat_template, speaks_harness_words
from targets.spec.base import Strict
from targets.spec.hardware import AnyHardware
from targets.spec.model import ModelSpec
from targets.spec.workload import WorkloadSpec


class BaselineSpec(Strict):
    """A starter schedule the bench compares against: on the target's hardware, or with ``hardware``
    on other hardware of the same cost (a single-kind cluster beside a mixed one), or with ``params``
    carrying techniques of the skills library (an elastic baseline: ``serving_harvest: 1``); either is
    named by ``label``."""

    name: Literal["colocate", "static_split", "time_multiplex"]
    rollout_devices: int | None = Field(default=None, gt=0)
    train_devices: int | None = Field(default=None, gt=0)
    label: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9_-]*$")
    hardware: AnyHardware | None = Field(
        default=None, description="other hardware of the target's cost this baseline runs on (simulated)"
    )
    params: dict[str, bool | int | float | str | None] = Field(
        default_factory=dict,
        description="parameters its starter carries (checked against the skills' ranges and the recipes' options)",
    )

    @model_validator(mode="after")
    def _split_given(self) -> BaselineSpec:
        if self.name == "static_split" and (self.rollout_devices is None or self.train_devices is None):
            raise ValueError("static_split needs rollout_devices and train_devices")
        if self.hardware is not None and self.label is None:
            raise ValueError("a baseline on other hardware needs a label (how the bench names it)")
        if self.params and self.label is None:
            raise ValueError("a baseline with technique params needs a label (how the bench names it)")
        return self

    @property
    def title(self) -> str:
        return self.label or self.name


class AccuracySpec(Strict):
    """Tolerances of the judge's deterministic checks (fp32 CPU defaults)."""

    logprob_atol: float = Field(default=1e-3, gt=0)
    # below 1: at 1 a trainer whose update is a sliver of the reference step's (rel ~ 0.99) would pass
    update_rtol: float = Field(default=2e-2, gt=0, lt=1, description="relative error of a train step's update")
    greedy_tie_margin: float = Field(default=1e-3, ge=0, description="top-2 logit gap under which greedy may differ")
    prompts: int = Field(default=4, gt=0)
    new_tokens: int = Field(default=12, gt=0)
    selection_task_shortfall: float | None = Field(
        default=None,
        ge=0,
        lt=1,  # a shortfall is never over 1: at 1 the check could not trip
        description="how much shorter (a fraction of the mean, in turns or response tokens) the tasks trained may be "
        "than the tasks launched; default 0.20",
    )
    selection_member_shortfall: float | None = Field(
        default=None,
        ge=0,
        lt=1,  # a shortfall is never over 1: at 1 the check could not trip
        description="how much shorter the members trained may be than every member of their groups; default 0.07 "
        "plus 0.06 for each spare a group the stack declares",
    )
    selection_bias: float | None = Field(
        default=None,
        ge=0,
        description="how much better rewarded (in standard deviations) the trained episodes may be than every "
        "finished episode; default: what the stack's declared techniques are documented to bias",
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
    max_engine_scale: Literal[1, 2, 4] = Field(
        default=1,
        description="how many times engine_devices a stack's engines may span (EngineSettings.engine_scale): "
        "larger engines decode each sequence faster and pay their tensor-parallel traffic",
    )
    inter_node_latency_s: float = Field(
        default=30e-6,
        ge=0,
        description="fixed cost of one collective across nodes: each all-reduce of an engine that spans nodes",
    )
    batching: Literal["continuous", "static"] = Field(
        default="continuous",
        description="continuous: requests join the running batch (vLLM); static: a batch runs to its end first",
    )


class LimitsSpec(Strict):
    """What the judge's child process (harness, reference model, candidate processes) may use. Unset,
    they follow the model's size: host memory holds a float32 reference copy, the trainer's offloaded
    float32 state (weights, gradients, AdamW moments), the weight snapshots the audit replays
    training from and the export region the cluster maps while a step trains (4 bytes a parameter),
    about 48 bytes per parameter over a 16 GB base (the processes' CUDA and torch libraries); time
    grows with billions of parameters."""

    host_memory_mb: float | None = Field(default=None, gt=0, description="resident memory of the child's process tree")
    time_s: float | None = Field(
        default=None, gt=0, description="seconds one child run (a check, a measurement) may take"
    )

    def resolved(self, parameters: int) -> tuple[float, float]:
        """(host memory in MB, seconds) for a model of ``parameters``."""
        memory = self.host_memory_mb or 16_000 + 48 * parameters / 1e6
        seconds = self.time_s or 600 * max(1.0, parameters / 1e9)
        return memory, seconds


# what a round's summary keeps that may rank candidates, and what each is (targets/harness/measure/metrics.py)
HEADLINE_METRICS = {
    "goodput": "trajectories trained on that neither timed out nor were lost, per second",
    "trained_tokens_per_s": "the response tokens of the trajectories trained that neither timed out nor were lost, "
    "per second",
    "rollout_throughput": "episodes the environments saw finish, per second",
    "tokens_per_s": "response tokens the environments saw, per second",
    "step_time_s": "seconds a training step takes",
}


class HeadlineMetric(Strict):
    name: str
    direction: Literal["maximize", "minimize"]

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in HEADLINE_METRICS:
            raise ValueError(f"unknown metric {name!r}: a headline is one of {', '.join(HEADLINE_METRICS)}")
        return name


class TargetSpec(Strict):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    description: str
    headline_metric: HeadlineMetric
    noise_threshold: float = Field(ge=0, lt=1, description="relative change below which results are noise")
    model: ModelSpec
    hardware: AnyHardware
    workload: WorkloadSpec
    execution: Literal["real", "simulated", "auto"]
    baselines: list[BaselineSpec] = Field(min_length=1)
    accuracy: AccuracySpec = AccuracySpec()
    simulator: SimulatorSpec = SimulatorSpec()
    limits: LimitsSpec = LimitsSpec()

    @model_validator(mode="after")
    def _sequences_within_the_models_positions(self) -> TargetSpec:
        """A trained model's (a directory's): its positions past ``max_position_embeddings`` were never
        trained, and vLLM refuses such a ``max_model_len``. (Random weights were trained on none.)"""
        longest, positions = self.workload.tokens.max_sequence, self.model.config.max_position_embeddings
        if self.model.random_seed is None and longest > positions:
            raise ValueError(
                f"workload.tokens.max_sequence {longest} is past the model's max_position_embeddings {positions}: "
                "positions beyond it were never trained (and scaled RoPE is not supported)"
            )
        return self

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
    def _builtin_environment_speaks_the_harness_words(self) -> TargetSpec:
        """A built-in environment writes and reads token ids of the harness's word vocabulary: through any
        other tokenizer (a BPE, a user's model's own) its prompts are other text, and its rewards mean
        nothing to the model. (A simulated run draws what the model answers: there, the text is not read.)"""
        env = self.workload.environment
        if env.entry is not None or self.model.tokenizer_kind == "words" or self.execution == "simulated":
            return self
        if self.model.tokenizer_kind is None and speaks_harness_words(Path(self.model.weights)):
            return self  # a directory vibetrain built with the word tokenizer
        tokenizer = f"model.tokenizer: {self.model.tokenizer}" if self.model.tokenizer else f"{self.model.weights}'s"
        raise ValueError(
            f"workload.environment {env.name} is a built-in stand-in written in the harness's word vocabulary; "
            f"{tokenizer} tokenizer would read its token ids as other text. Bring an environment that speaks "
            "text (workload.environment.entry, docs/targets.md), or use random weights with the word tokenizer"
        )

    @model_validator(mode="after")
    def _serving_runs_here(self) -> TargetSpec:
        """A real run's serving pool lends real devices (the candidate's engines there) while the
        harness serves the pool's traffic on the wall clock by the cost model: on CPU targets, where
        both are tested; a GPU target's is simulated."""
        if self.execution == "simulated":
            return self
        kinds = sorted({h.kind for h in self.hardware.by_name.values()})
        for i, pool in enumerate(getattr(self.hardware, "pools", ())):
            if pool.serving is not None and kinds != ["cpu"]:
                raise ValueError(
                    f"hardware.pools.{i}.serving: a serving pool runs for real on CPU targets only (this one's "
                    f"devices are {', '.join(kinds)}); simulate it (execution: simulated)"
                )
        return self

    @model_validator(mode="after")
    def _reward_model_runs_here(self) -> TargetSpec:
        judge = self.workload.reward_model
        if judge is None or self.execution == "simulated":
            return self
        kinds = sorted({h.kind for h in self.hardware.by_name.values()})
        if kinds != ["cpu"]:
            raise ValueError(
                f"workload.reward_model: a reward model runs for real on CPU targets only (this one's devices "
                f"are {', '.join(kinds)}); simulate it (execution: simulated)"
            )
        if judge.output_tokens != 1:
            raise ValueError(
                f"workload.reward_model.output_tokens: a real judge gives a score, one token; got {judge.output_tokens}"
            )
        return self

    @model_validator(mode="after")
    def _baselines_fit(self) -> TargetSpec:
        for i, baseline in enumerate(self.baselines):
            count = (baseline.hardware or self.hardware).count
            where = f"baselines[{i}].hardware" if baseline.hardware else "hardware"
            used = (baseline.rollout_devices or 0) + (baseline.train_devices or 0)
            if baseline.name == "static_split" and used > count:
                raise ValueError(f"baselines[{i}] static_split uses {used} devices but {where}.count is {count}")
            if baseline.rollout_devices and baseline.rollout_devices > count:
                raise ValueError(
                    f"baselines[{i}] rollout_devices {baseline.rollout_devices} exceeds {where}.count {count}"
                )
        titles = [b.title for b in self.baselines]
        if len(set(titles)) < len(titles):
            raise ValueError(f"two baselines are named {next(t for t in titles if titles.count(t) > 1)!r}: label one")
        return self

    def on_hardware(self, baseline: BaselineSpec) -> TargetSpec:
        """This target as ``baseline`` runs it: on its other hardware, with it as the only baseline."""
        plain = baseline.model_copy(update={"hardware": None, "label": None, "params": {}})  # the bench applies params
        return self.model_copy(
            update={"id": f"{self.id}-{baseline.label}", "hardware": baseline.hardware, "baselines": [plain]}
        )
