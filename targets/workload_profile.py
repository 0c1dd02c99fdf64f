"""Workload profiles: a simulated target's workload distributions measured on a real environment
rather than typed in. ``vibetrain workload profile TARGET`` writes one (a YAML fragment of
``workload`` keys, see ``targets/harness/sim/profile_fit.py``); a spec names it with
``workload: {profile: FILE}`` (relative to the spec's own file) and sets the rest itself (the
environment stand-in, batch, group, token budgets: what scaling to another cluster changes).

A key is set one way: a spec that sets a key its profile measured is an error naming the key, never
a silent override of a measurement. Response lengths are measured under a budget (``samples``:
``response_budget``, and ``turns_at_budget``, the share of turns cut there): a spec with a larger
``tokens.response`` refuses a profile that cut more than ``CENSORED_SHARE`` of its turns, since what
the policy generates past the measured budget was never seen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from targets.yaml_text import load_yaml

MEASURED = ("turns", "env_latency_s", "env_latency_max_s", "env_failure_rate", "env_reset_s")
MEASURED_TOKENS = ("prompt", "observation", "response_length")
PROVENANCE = ("measured_on", "samples")  # what the fragment says of itself: kept, never merged
CENSORED_SHARE = 0.01  # turns cut at the measured budget, at most, for a spec with a larger one


def with_profile(workload: Any, base_dir: Path) -> Any:
    """``workload`` with its profile's measured keys in place (unchanged if it names none). Raises
    ``ValueError`` naming the file or the key, which the spec reports under ``workload``. A resolved
    spec's dump carries the keys themselves, not the file (``WorkloadSpec.profile`` is not dumped)."""
    if not isinstance(workload, dict) or workload.get("profile") is None:
        return workload
    path = Path(str(workload["profile"])).expanduser()
    path = path if path.is_absolute() else base_dir / path
    try:
        fragment = load_yaml(path.read_text(), str(path))
    except OSError as error:
        raise ValueError(f"profile {path}: cannot read it ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"profile {path}: not UTF-8 text (byte {error.start}): is it the profile's YAML?") from None
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
    censored = _censored_lengths(fragment, workload)
    if censored:
        raise ValueError(f"profile {path}: {censored}")
    merged = {**workload, "profile": str(path)}
    both = sorted(k for k in MEASURED if k in fragment and k in workload)
    both += sorted(f"tokens.{k}" for k in fragment.get("tokens") or {} if k in (workload.get("tokens") or {}))
    if both:
        raise ValueError(f"profile {path} measured {', '.join(both)}: set each in one place (drop it from the spec)")
    merged.update({k: fragment[k] for k in MEASURED if k in fragment})
    merged["tokens"] = {**(workload.get("tokens") or {}), **(fragment.get("tokens") or {})}
    return merged


def _censored_lengths(fragment: dict, workload: dict) -> str | None:
    """Why the profile's response lengths cannot serve the spec's budget, or None when they can: the same
    budget, a larger one where few turns reached the measured one, or a smaller one the lengths' mean fits
    under (the simulator cuts each at it). A profile from before ``turns_at_budget`` was recorded cannot say
    about a larger budget: it is taken as it is."""
    lengths = (fragment.get("tokens") or {}).get("response_length")
    response = (workload.get("tokens") or {}).get("response")
    mean = lengths.get("mean") if isinstance(lengths, dict) else None
    spread = isinstance(lengths, dict) and any(lengths.get(k) for k in ("task_sigma", "turn_sigma"))
    numbers = isinstance(response, int) and isinstance(mean, (int, float)) and not isinstance(mean, bool)
    if numbers and (mean > response or (spread and mean >= response)):  # the spec's own check, said of the profile
        return (
            f"its turns' response lengths average {mean:g} tokens (tokens.response_length.mean), which a budget of "
            f"{response} (tokens.response) cannot hold: set tokens.response {'above' if spread else 'to at least'} "
            f"{mean:g}, or profile a run with a budget of {response}"
        )
    samples = fragment.get("samples")
    if not isinstance(samples, dict) or "turns_at_budget" not in samples:
        return None
    if "response_length" not in (fragment.get("tokens") or {}):
        return None  # the lengths are the spec's own
    measured, share = samples.get("response_budget"), samples["turns_at_budget"]
    if not isinstance(measured, int) or isinstance(measured, bool) or measured <= 0:
        return f"samples.response_budget: the lengths' budget, a positive integer, got {measured!r}"
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 <= share <= 1:
        return f"samples.turns_at_budget: a share between 0 and 1, got {share!r}"
    response = (workload.get("tokens") or {}).get("response")
    if not isinstance(response, int) or response <= measured or share <= CENSORED_SHARE:
        return None  # a budget that is no integer is the spec's own error, reported as such
    return (
        f"{share:.0%} of its turns ran to the response budget it was measured under ({measured} tokens, "
        f"samples.response_budget), so its response lengths stop there; tokens.response is {response}. "
        f"Set tokens.response to at most {measured}, or profile a run with a budget of {response}"
    )
