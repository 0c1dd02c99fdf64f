"""The devices a target runs on: a kind from ``targets.hardware``'s catalog, its count and any overrides."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from targets.hardware import HARDWARE_CATALOG
from targets.spec.base import Strict


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
