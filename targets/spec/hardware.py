"""The devices a target runs on: one pool of one kind (``kind``, ``count`` and any overrides of the
catalog's numbers), or several named pools and the links between them (``docs/targets.md``).

Devices are named ``pool:index`` everywhere; a single pool is named by its kind, so a one-pool
target's devices are ``kind:index``. Pools are a list, in the order their devices are numbered, which
is the order a stack's controllers see them in (``targets.api.Runtime.devices``).
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, model_validator

from targets.hardware import GIB, HARDWARE_CATALOG
from targets.spec.base import Strict
from targets.spec.serving import ServingSpec

POOL_NAME = r"^[a-z][a-z0-9_]*$"


class HardwareSpec(Strict):
    """One pool: a device kind from ``targets.hardware`` plus any per-spec overrides of its numbers."""

    kind: str
    count: int = Field(gt=0, le=1_000_000)  # past any cluster: 1e30 ran a bench silently for minutes
    memory_gb: float = Field(gt=0)
    bf16_tflops: float = Field(gt=0)
    hbm_bandwidth_gbs: float = Field(gt=0)
    intra_node_bandwidth_gbs: float = Field(gt=0)
    inter_node_bandwidth_gbs: float = Field(gt=0)
    host_link_bandwidth_gbs: float = Field(gt=0)
    host_memory_gb: float = Field(gt=0)  # a device's share of its node's host memory
    devices_per_node: int = Field(gt=0)
    mfu: float = Field(default=0.4, gt=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _fill_from_catalog(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "kind" not in data:
            return data
        kind = data["kind"]
        if kind not in HARDWARE_CATALOG:
            raise ValueError(f"unknown hardware kind {kind!r}; known kinds: {sorted(HARDWARE_CATALOG)}")
        return {**HARDWARE_CATALOG[kind], **data}

    @property
    def memory_bytes(self) -> int:
        """A device's memory: ``memory_gb`` binary gigabytes (``targets/hardware.py`` says why)."""
        return int(self.memory_gb * GIB)

    @property
    def host_memory_bytes(self) -> int:
        """A device's share of its node's host memory, in bytes (binary gigabytes, as ``memory_gb``)."""
        return int(self.host_memory_gb * GIB)

    # -- what every hardware spec answers (``PooledHardwareSpec`` too) ---------------------------
    @property
    def by_name(self) -> dict[str, HardwareSpec]:
        """Each pool by its name (a single pool is named by its kind), in device order."""
        return {self.kind: self}

    @property
    def links(self) -> tuple[LinkSpec, ...]:
        return ()

    @property
    def summary(self) -> str:
        """How a person reads it: ``8x h100``."""
        return f"{self.count}x {self.kind}"

    def device_ids(self) -> list[str]:
        """The devices' names, ``kind:index``: the one way they are written everywhere."""
        return [f"{self.kind}:{i}" for i in range(self.count)]

    @property
    def serving_pools(self) -> tuple[PoolSpec, ...]:
        """Pools whose devices serve production traffic (none here)."""
        return ()

    def serving_device_ids(self) -> list[str]:
        """The devices of serving pools, which rollout may borrow and training never uses (none here)."""
        return []

    def pool_name(self, device: str) -> str:
        """The name of the pool ``device`` (one of ``device_ids`` or ``serving_device_ids``) is in:
        ``by_name``'s key."""
        return self.kind

    def pool_of(self, device: str) -> HardwareSpec:
        return self


class PoolSpec(HardwareSpec):
    """One of several pools: a device kind and count as a single pool has, and a name. With
    ``serving`` it is a serving pool: its devices serve that traffic and are not the job's; rollout
    may borrow them (``Runtime.serving_devices``)."""

    name: str = Field(pattern=POOL_NAME)
    serving: ServingSpec | None = None


class LinkSpec(Strict):
    """The bandwidth between two pools' devices: what each device can send to the other pool (a NIC's
    share, GB/s), which weights crossing from a training pool to a rollout pool travel over."""

    between: tuple[str, str]
    bandwidth_gbs: float = Field(gt=0)


class PooledHardwareSpec(Strict):
    """Several pools, named, of possibly different kinds (a compute-rich training pool beside a
    bandwidth-rich rollout pool, or beside a serving pool), and a link between every two of them.
    The job's devices are those of the pools that do not serve."""

    pools: tuple[PoolSpec, ...] = Field(min_length=2)
    links: tuple[LinkSpec, ...]

    @property
    def by_name(self) -> dict[str, HardwareSpec]:
        return {pool.name: pool for pool in self.pools}

    @model_validator(mode="after")
    def _links_join_the_pools(self) -> PooledHardwareSpec:
        names = [pool.name for pool in self.pools]
        if len(set(names)) < len(names):
            raise ValueError(f"pools: two pools are named {next(n for n in names if names.count(n) > 1)!r}")
        seen: set[frozenset[str]] = set()
        for i, link in enumerate(self.links):
            unknown = [name for name in link.between if name not in self.by_name]
            if unknown:
                raise ValueError(f"links.{i}.between names the pool {unknown[0]!r}; the pools are {names}")
            pair = frozenset(link.between)
            if len(pair) != 2:
                raise ValueError(f"links.{i}.between joins the pool {link.between[0]!r} to itself")
            if pair in seen:
                raise ValueError(f"links.{i}.between joins {' and '.join(sorted(pair))} a second time")
            seen.add(pair)
        for a, b in itertools.combinations(names, 2):
            if frozenset((a, b)) not in seen:
                raise ValueError(f"no link between the pools {a!r} and {b!r}: weights could not reach one of them")
        if not self.job_pools:
            raise ValueError("every pool serves: the job needs at least one pool without serving")
        if len(self.serving_pools) > 1:
            raise ValueError(f"pools: {len(self.serving_pools)} serving pools; a target may have one")
        return self

    @property
    def job_pools(self) -> tuple[PoolSpec, ...]:
        """The pools the job owns (rollout and training), in device order."""
        return tuple(pool for pool in self.pools if pool.serving is None)

    @property
    def serving_pools(self) -> tuple[PoolSpec, ...]:
        return tuple(pool for pool in self.pools if pool.serving is not None)

    @property
    def count(self) -> int:
        """The job's devices (a serving pool's are lent, never owned)."""
        return sum(pool.count for pool in self.job_pools)

    @property
    def kind(self) -> str:
        """The one kind every pool of the job has, else ``mixed``."""
        kinds = {pool.kind for pool in self.job_pools}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def summary(self) -> str:
        def one(pool: PoolSpec) -> str:
            return f"{pool.count}x {pool.kind} ({pool.name}{', serving' if pool.serving else ''})"

        return " + ".join(one(pool) for pool in self.pools)

    def device_ids(self) -> list[str]:
        return [f"{pool.name}:{i}" for pool in self.job_pools for i in range(pool.count)]

    def serving_device_ids(self) -> list[str]:
        return [f"{pool.name}:{i}" for pool in self.serving_pools for i in range(pool.count)]

    def pool_name(self, device: str) -> str:
        name = device.partition(":")[0]  # pool:index
        if name not in self.by_name:
            raise ValueError(f"device {device!r} is in none of the pools {list(self.by_name)}")
        return name

    def pool_of(self, device: str) -> HardwareSpec:
        return self.by_name[self.pool_name(device)]

    def link_gbs(self, a: str, b: str) -> float:
        """The bandwidth between the pools ``a`` and ``b`` (GB/s per device)."""
        for link in self.links:
            if set(link.between) == {a, b}:
                return link.bandwidth_gbs
        raise ValueError(f"no link between the pools {a!r} and {b!r}")


def _form(data: Any) -> str:
    """Which form: pydantic asks with the YAML's mapping when validating, with the model when dumping."""
    pooled = isinstance(data, PooledHardwareSpec) or (isinstance(data, dict) and "pools" in data)
    return "pooled" if pooled else "single"


AnyHardware = Annotated[
    Annotated[HardwareSpec, Tag("single")] | Annotated[PooledHardwareSpec, Tag("pooled")], Discriminator(_form)
]
HARDWARE_FORMS = ("single", "pooled")  # the tags pydantic puts in an error's path; a person never wrote them
