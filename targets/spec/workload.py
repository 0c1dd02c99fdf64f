"""The agentic-RL job: the environment, turns, token budgets, latencies, batch and staleness, training."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from targets.api import TrainingConfig
from targets.spec.base import Strict
from targets.spec.distributions import Distribution
from targets.spec.reward import RewardModelSpec
from targets.workload_profile import with_profile


class EnvironmentRef(Strict):
    """A harness environment by ``name``, or the user's own by ``entry`` (``package.module:callable``,
    called with ``params``) spoken to through an ``adapter`` (``docs/targets.md``)."""

    name: str | None = None
    entry: str | None = None
    adapter: Literal["gymnasium", "tasks", "text"] | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    # what a chat model is told and what the environment reads of its answer (a user's entry only): the
    # system message of each episode's first turn, and a regular expression whose last match (its group,
    # where it has one) is the text the environment reads, "" where none matches (reasoning-gym scores an
    # extracted answer: the whole response paid partial credit for any text holding the digits)
    system: str | None = None
    answer: str | None = None
    # the folders a user's environment writes to (its logs, a cache): under bubblewrap it runs with the
    # filesystem read-only but for a private /tmp and these (docs/targets.md)
    writable: list[Path] = Field(default_factory=list)
    network: bool = False  # whether it reaches the network (a service it calls): it does not by default

    @field_validator("writable")
    @classmethod
    def _absolute(cls, folders: list[Path]) -> list[Path]:
        folders = [folder.expanduser() for folder in folders]
        relative = [str(folder) for folder in folders if not folder.is_absolute()]
        if relative:
            raise ValueError(f"writable {', '.join(relative)}: give each folder as an absolute path (or ~/...)")
        return folders

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
            if self.answer is not None:
                try:
                    groups = re.compile(self.answer).groups
                except re.error as error:
                    raise ValueError(f"answer {self.answer!r} is not a regular expression ({error})") from None
                if groups > 1:
                    raise ValueError(f"answer {self.answer!r} has {groups} groups: give one (the answer) or none")
            return self
        for field in ("writable", "network"):
            if getattr(self, field):
                raise ValueError(
                    f"{field} is for a user's entry (where its code writes, what it reaches), not a harness one"
                )
        for field in ("system", "answer"):
            if getattr(self, field) is not None:
                raise ValueError(f"{field} is for a user's entry (a chat model's text), not the harness environment")
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


LENGTH_SIGMA_MAX = 3.0  # a response length's log-space spread: e^3 (20x) a standard deviation at most


class ResponseLengthSpec(Strict):
    """How many of a turn's ``tokens.response`` budget the simulated model generates (a real model
    decides for itself, so real execution ignores this). Lognormal, cut at the budget: the product of
    a per-task factor (``task_sigma``; shared by a group's members and by every turn of their
    episodes, so a hard task stays long) and a per-turn factor (``turn_sigma``). ``mean`` is the mean
    after the cut; ``targets/harness/sim/response_length.py`` solves for the median that gives it."""

    mean: float = Field(gt=0, description="mean tokens a turn generates, after the cut at the budget")
    task_sigma: float = Field(default=0.0, ge=0, le=LENGTH_SIGMA_MAX, description="log-space spread between tasks")
    turn_sigma: float = Field(
        default=0.0, ge=0, le=LENGTH_SIGMA_MAX, description="log-space spread between turns of one task"
    )


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
            lr=self.lr,
            clip_eps=self.clip_eps,
            kl_coef=self.kl_coef,
            max_grad_norm=self.max_grad_norm,
            temperature=self.temperature,
        )


class EnvStateSpec(Strict):
    """Environments whose state a crash loses (Crab's agent sandboxes): a failed step takes the
    sandbox with it, and the harness can bring it back only from the episode's own last checkpoint,
    and only when no turn since changed state; otherwise the episode is lost (it ends with what it
    has, trained on, never counted as goodput). A stack checkpoints through ``EnvHandle.checkpoint``."""

    change_rate: float = Field(ge=0, le=1, description="chance a turn changes state a crash would lose")
    checkpoint_s: float = Field(ge=0, description="seconds one checkpoint takes, at a turn boundary")
    restore_s: float = Field(ge=0, description="seconds to restore a sandbox from its checkpoint")
    checkpoint_mb: float = Field(default=0.0, ge=0, description="size of one checkpoint (reported as traffic)")


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
    env_reset_s: Distribution | None = Field(
        default=None,
        description="seconds an environment takes to reset (a sandbox's start: pulling its image, cloning the "
        "repository), drawn per episode; none: a reset answers at once",
    )
    env_state: EnvStateSpec | None = Field(
        default=None, description="crashes lose the environment's state unless it was checkpointed"
    )
    reward_model: RewardModelSpec | None = Field(
        default=None, description="an LLM judge scores each finished trajectory before its reward is known"
    )
    trajectory_timeout_s: float = Field(gt=0)
    batch_size: int = Field(gt=0, le=10_000_000, description="trajectories per training step")
    group_size: int = Field(ge=2, le=1_000_000, description="trajectories per GRPO group (same task)")
    async_ratio: int = Field(ge=0, description="max weight versions a sample may lag behind")
    max_async_ratio: int | None = Field(
        default=None, ge=0, description="the largest async_ratio a stack may choose for itself (default: async_ratio)"
    )
    train_steps: int = Field(gt=0, le=1_000_000, description="training steps a benchmark run measures")
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
            if self.profile is not None:  # the profile measured it: the user wrote no turns.dist to remove
                raise ValueError(
                    f"environment {env.label} ends episodes by play, not by a drawn count, and the profile "
                    f"{self.profile} measured turn counts for one that draws them: use a stand-in that does "
                    "(synthetic_agent), or no profile"
                )
            raise ValueError(f"environment {env.label} ends episodes by play, not by a drawn count: remove turns.dist")
        return self

    @model_validator(mode="after")
    def _state_is_the_harness_s(self) -> WorkloadSpec:
        if self.env_state is not None and self.environment.entry is not None:
            raise ValueError(
                f"env_state models crashes of the harness's environments; {self.environment.label} is the user's "
                "and crashes (or not) on its own: remove env_state"
            )
        if self.env_reset_s is not None and self.environment.entry is not None:
            raise ValueError(
                f"env_reset_s models the resets of the harness's environments; {self.environment.label} is the "
                "user's and resets in its own time: remove env_reset_s"
            )
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

    def staleness_bound(self, declared) -> int:
        """The bound a run is held to: the stack's declared ``async_ratio`` (a ``targets.api.Declared``'s, never
        above ``staleness_limit``; the harness refuses more at hello), else the workload's."""
        return self.async_ratio if declared.async_ratio is None else min(declared.async_ratio, self.staleness_limit)

    def groups_in_flight_bound(self, declared) -> int:
        """The most groups a run may have outstanding (a group while any member is): what the staleness bound
        needs, ``groups_per_step x (1 + staleness bound)``, and a step's groups more where the stack declares
        ``env_prestart`` (launched before the step they are for, their samples no staler)."""
        return self.groups_per_step * (1 + self.staleness_bound(declared) + int(declared.env_prestart))

    def in_flight_bound(self, declared) -> int:
        """The most episodes a run may have outstanding (created, neither trained nor dropped): its groups'
        bound, each of ``group_size`` plus the declared spares."""
        return self.groups_in_flight_bound(declared) * (self.group_size + declared.redundant_per_group)

    def over_declared_limits(self, declared) -> str | None:
        """Why ``declared`` (a ``targets.api.Declared``) asks for more than this workload allows, or None."""
        for field, (what, limit) in self.declared_limits.items():
            value = getattr(declared, field)
            if value is not None and value > limit:
                return f"the stack declares {field} {value}, over the target's {what} {limit}"
        return None
