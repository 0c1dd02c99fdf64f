"""A target as a command or a run resolves it once: the validated spec, how it was named (what a
child process loads again), and whether it executes for real or on the simulator here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from targets.api import Device, Runtime, Workload
from targets.errors import UserError
from targets.spec import ModelSpec, TargetSpec, load_target

DEVICE_RESOURCE = "vt_device_"


class TargetUnavailable(UserError, RuntimeError):
    """The target cannot execute as asked on this machine (the message says what is missing)."""


def gpus_here() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_execution(spec: TargetSpec, simulate: bool = False) -> Literal["real", "simulated"]:
    """``auto`` is real when this machine has the target's devices; ``real`` on a GPU target without
    enough GPUs is an error that names both counts."""
    if simulate or spec.execution == "simulated":
        return _simulable(spec, "as asked")
    if spec.hardware.kind == "cpu":
        return "real"
    real_only = spec.workload.environment.entry is not None  # a user's environment: _simulable refuses it
    if spec.hardware.kind == "mixed":  # pools of several kinds: one machine's cards would stand for all of them
        if spec.execution == "auto":
            return _simulable(spec, "as its pools are of several kinds of GPU")
        raise TargetUnavailable(
            f"target {spec.id} has pools of several kinds of GPU ({spec.hardware.summary}): it cannot run for real "
            f"on one machine's cards; {'' if real_only else 'pass --simulate, or '}give it one kind"
        )
    have = gpus_here()
    if have >= spec.hardware.count:
        return "real"
    if spec.execution == "auto":
        return _simulable(spec, f"as this machine has {have} of its {spec.hardware.count} GPUs")
    raise TargetUnavailable(
        f"target {spec.id} executes for real on {spec.hardware.summary} GPU(s), "
        f"and this machine has {have}: run it on a machine with them{'' if real_only else ', or pass --simulate'}"
    )


def _simulable(spec: TargetSpec, why: str) -> Literal["simulated"]:
    """Simulated, unless the environment is the user's, which only runs for real."""
    if spec.workload.environment.entry is not None:
        raise TargetUnavailable(
            f"target {spec.id} would be simulated {why}, but its environment {spec.workload.environment.entry} "
            "is the user's and only runs for real: simulate its calibrated twin (vibetrain calibrate) or a spec "
            "with its workload profile instead"
        )
    return "simulated"


def workload_view(spec: TargetSpec) -> Workload:
    w = spec.workload
    return Workload(
        batch_size=w.batch_size,
        group_size=w.group_size,
        async_ratio=w.async_ratio,
        max_async_ratio=w.staleness_limit,
        prompt_tokens=w.tokens.prompt,
        observation_tokens=w.tokens.observation,
        response_tokens=w.tokens.response,
        max_sequence=w.tokens.max_sequence,
        training=w.training.config(),
        env_state=w.env_state is not None,
        reward_model=w.reward_model is not None,
    )


@dataclass(frozen=True)
class Target:
    spec: TargetSpec
    ref: str  # a catalog id or an absolute path to the YAML
    execution: Literal["real", "simulated"]

    @classmethod
    def load(cls, ref: str | Path, simulate: bool = False) -> Target:
        spec = load_target(ref)
        if spec.hardware.serving_pools:  # what its pool can serve: said with the spec, not as every run fails
            from targets.harness.sim.serving import serving_cost

            serving_cost(spec)
        path = Path(ref)
        named = str(path.resolve()) if path.is_file() else str(ref)  # a catalog id, even beside a folder of its name
        return cls(spec, named, resolve_execution(spec, simulate))

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def simulated(self) -> bool:
        return self.execution == "simulated"

    @property
    def gpu(self) -> bool:
        """Candidate processes see the GPUs (real execution on a GPU target)."""
        return self.spec.hardware.kind != "cpu" and not self.simulated

    def devices(self, serving: bool = False) -> tuple[Device, ...]:
        """The job's devices, or with ``serving`` the serving pools' (numbered after the job's)."""
        hardware = self.spec.hardware
        names = hardware.serving_device_ids() if serving else hardware.device_ids()
        first = len(hardware.device_ids()) if serving else 0
        return tuple(
            Device(name, pool.kind, first + i, pool.bf16_tflops, pool.hbm_bandwidth_gbs)
            for i, name in enumerate(names)
            for pool in [hardware.pool_of(name)]
        )

    @property
    def engine_devices(self) -> int:
        """How many devices a rollout engine spans: one in a real stack; in a simulated one, as many
        as the model's weights need (the cost model's)."""
        if not self.simulated:
            return 1
        from targets.harness.sim.cost_model import ClusterCosts

        return ClusterCosts.from_spec(self.spec).engine_devices

    def components_model(self) -> ModelSpec:
        """The model the components run (and the checks compare against): on a simulated target a tiny model
        of the same family, since the checks prove the code right and the target's own model may not fit."""
        from targets.harness.model import proxy_model

        return self.spec.model if not self.simulated else proxy_model(self.spec.model)

    def model_path(self) -> Path:
        """``Runtime.model_path``: the components model's directory (built, for random weights, once)."""
        from targets.harness.model import model_dir

        return model_dir(self.components_model())

    def runtime(self) -> Runtime:
        from targets.harness.tokenizer import stop_token_ids

        model, path = self.components_model(), self.model_path()
        return Runtime(
            str(path),
            model.dtype,
            self.devices(),
            DEVICE_RESOURCE,
            stop_token_ids(path),
            workload_view(self.spec),
            "cuda" if self.gpu else "cpu",
            min(p.memory_bytes for p in self.spec.hardware.by_name.values()) if self.gpu else 0,
            self.engine_devices,
            self.devices(serving=True),
        )

    def reference_model(self):
        """The model the checks and the audit compare against, on the same device and dtype."""
        from targets.harness.model import load_model

        loaded = load_model(self.model_path(), self.components_model().dtype)
        return loaded.to("cuda") if self.gpu else loaded
