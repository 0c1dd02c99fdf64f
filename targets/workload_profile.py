"""Workload profiles: a simulated target's workload distributions measured on a real environment
rather than typed in. ``vibetrain workload profile TARGET`` writes one (a YAML fragment of
``workload`` keys, see ``targets/harness/sim/profile_fit.py``); a spec names it with
``workload: {profile: FILE}`` (relative to the spec's own file) and sets the rest itself (the
environment stand-in, batch, group, token budgets: what scaling to another cluster changes).

A key is set one way: a spec that sets a key its profile measured is an error naming the key, never
a silent override of a measurement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MEASURED = ("turns", "env_latency_s", "env_latency_max_s", "env_failure_rate")
MEASURED_TOKENS = ("prompt", "observation", "response_length")
PROVENANCE = ("measured_on", "samples")  # what the fragment says of itself: kept, never merged


def with_profile(workload: Any, base_dir: Path) -> Any:
    """``workload`` with its profile's measured keys in place (unchanged if it names none). Raises
    ``ValueError`` naming the file or the key, which the spec reports under ``workload``. A resolved
    spec's dump carries the keys themselves, not the file (``WorkloadSpec.profile`` is not dumped)."""
    if not isinstance(workload, dict) or workload.get("profile") is None:
        return workload
    path = Path(str(workload["profile"])).expanduser()
    path = path if path.is_absolute() else base_dir / path
    try:
        fragment = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ValueError(f"profile {path}: cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise ValueError(f"profile {path}: not valid YAML ({error})") from None
    if not isinstance(fragment, dict):
        raise ValueError(f"profile {path}: a mapping of workload keys, got {type(fragment).__name__}")
    if not isinstance(fragment.get("tokens", {}), dict):
        raise ValueError(f"profile {path}: tokens: a mapping of workload keys, got {type(fragment['tokens']).__name__}")
    if not isinstance(workload.get("tokens", {}), dict):
        raise ValueError(f"tokens: a mapping (prompt, response, ...), got {type(workload['tokens']).__name__}")
    unknown = sorted(set(fragment) - {*MEASURED, "tokens", *PROVENANCE})
    unknown += sorted(f"tokens.{k}" for k in set(fragment.get("tokens") or {}) - set(MEASURED_TOKENS))
    if unknown:
        raise ValueError(f"profile {path}: {', '.join(unknown)} are not what a profile measures")
    merged = {**workload, "profile": str(path)}
    both = sorted(k for k in MEASURED if k in fragment and k in workload)
    both += sorted(f"tokens.{k}" for k in fragment.get("tokens") or {} if k in (workload.get("tokens") or {}))
    if both:
        raise ValueError(f"profile {path} measured {', '.join(both)}: set each in one place (drop it from the spec)")
    merged.update({k: fragment[k] for k in MEASURED if k in fragment})
    merged["tokens"] = {**(workload.get("tokens") or {}), **(fragment.get("tokens") or {})}
    return merged
