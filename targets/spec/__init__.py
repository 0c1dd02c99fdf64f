"""Target specs: pydantic models of the YAML (one file per part of it) and the loader (catalog id or path).

Every model forbids unknown fields, so a misspelled key fails with its full field path instead of
being silently ignored. ``SpecError`` carries one readable line per problem.
"""

from targets.spec.base import SpecError, Strict
from targets.spec.distributions import Distribution, Fixed, Geometric, Lognormal
from targets.spec.hardware import HardwareSpec, LinkSpec, PooledHardwareSpec
from targets.spec.loading import (
    CATALOG_DIR,
    catalog_ids,
    load_target,
    load_target_file,
    parse_target,
    resolve_target_path,
)
from targets.spec.model import RANDOM_WEIGHTS, ModelConfig, ModelSpec, ParamCounts
from targets.spec.reward import RewardModelSpec, ServerlessSpec
from targets.spec.target import (
    AccuracySpec,
    BaselineSpec,
    HeadlineMetric,
    LimitsSpec,
    SimulatorSpec,
    TargetSpec,
)
from targets.spec.workload import (
    EnvironmentRef,
    EnvStateSpec,
    ResponseLengthSpec,
    TokensSpec,
    TrainingSpec,
    TurnsSpec,
    WorkloadSpec,
)

__all__ = [
    "CATALOG_DIR",
    "RANDOM_WEIGHTS",
    "AccuracySpec",
    "BaselineSpec",
    "Distribution",
    "EnvironmentRef",
    "EnvStateSpec",
    "Fixed",
    "Geometric",
    "HardwareSpec",
    "LinkSpec",
    "PooledHardwareSpec",
    "HeadlineMetric",
    "LimitsSpec",
    "Lognormal",
    "ModelConfig",
    "ModelSpec",
    "ParamCounts",
    "ResponseLengthSpec",
    "RewardModelSpec",
    "ServerlessSpec",
    "SimulatorSpec",
    "SpecError",
    "Strict",
    "TargetSpec",
    "TokensSpec",
    "TrainingSpec",
    "TurnsSpec",
    "WorkloadSpec",
    "catalog_ids",
    "load_target",
    "load_target_file",
    "parse_target",
    "resolve_target_path",
]
