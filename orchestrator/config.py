"""A run's configuration: one model from the command line (or ``--config run.yaml``) to the run state.

Every name is checked here and nowhere else (a wrong one gets the closest right one); a field that
``--resume`` may change says so (``resumable``); everything else is fixed when the run starts, and
a resume that asks to change it is refused by name.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from agents.factory import BACKENDS
from skills.starter import CONTROLLERS, DEFAULT_CONTROLLER
from targets.errors import UserError
from targets.harness.isolation.sandbox import BACKENDS as SANDBOX_BACKENDS

POLICIES = ("backlog", "evolve", "llm")
SELECTIONS = ("fitness", "pareto")  # evolve's parent selection
SANDBOXES = ("auto", *SANDBOX_BACKENDS)
CHOICES = {  # a field -> what its value names, and the names known
    "policy": ("policy", POLICIES),
    "agents": ("agent backend", BACKENDS),
    "sandbox": ("sandbox", SANDBOXES),
    "starter": ("starter", CONTROLLERS),
    "selection": ("parent selection", SELECTIONS),
}
LLM_BACKENDS = ("openai", "anthropic")
LLM_BUDGETS = ("max_cost", "max_tokens")  # the run's budgets for LLM calls (resumable)
FLAGS = {  # field -> its option
    "time_limit_s": "time_limit",
    "llm_review_required": "require_llm_review",
    "starter_params": "starter_param",
}


def flag(name: str) -> str:
    """A setting's command-line flag: ``max_cost`` -> ``--max-cost``, ``time_limit_s`` -> ``--time-limit``."""
    return "--" + FLAGS.get(name, name).replace("_", "-")


def unknown(what: str, name: str, known: Iterable[str]) -> str:
    """``unknown starter 'colocat' (did you mean 'colocate'?); known: ...``"""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {what} {name!r}{hint}; known: {', '.join(known)}"


def resumable(default: Any, **kwargs) -> Any:
    """A field ``--resume`` may change."""
    return Field(default, json_schema_extra={"resumable": True}, **kwargs)


class LLMConfig(BaseModel):
    """An LLM backend's settings (never a key: only the name of the variable that holds it)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # JSON keeps no inf: saved, it came back None
    model: str | None = None
    base_url: str | None = None  # an OpenAI-compatible server (vLLM, llama.cpp) or a proxy
    api_key_env: str | None = None  # default OPENAI_API_KEY / ANTHROPIC_API_KEY
    prices: str | None = None  # YAML of model: [input, output] USD per million tokens
    stream: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    max_turns: int | None = Field(None, ge=1)  # an implementer attempt's model turns (default 40)


class RunConfig(BaseModel):
    """``target``, ``target_id`` and ``simulated`` are resolved when the run starts; ``repeat``
    defaults to 3 measured pairs on a real target, 1 on a simulated one (exact for its seed);
    ``held_out`` to 3 on a simulated target, 0 on a real one (each seed is four more real runs)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # JSON keeps no inf: saved, it came back None
    target: str = ""  # as given (catalog id, or a spec path made absolute)
    target_id: str = ""
    simulated: bool = False
    policy: str = "backlog"
    selection: str = "fitness"  # evolve's parents: a tournament on the headline, or the Pareto front
    agents: str = "offline"
    seed: int = 0  # of the agents and the search
    rounds: int = resumable(3, ge=0)  # after the starter (round 0)
    max_minutes: float | None = resumable(None, gt=0)  # wall time; the run stops cleanly between rounds
    max_attempts: int = Field(2, ge=1)  # implementer attempts per round, each fed the judge's reasons
    repeat: int | None = Field(None, ge=1)  # measured pairs per candidate
    held_out: int | None = resumable(None, ge=0)  # seeds no round used, the best measured on at the end
    starter: str = DEFAULT_CONTROLLER  # round 0's controller
    starter_params: dict[str, bool | int | float | str | None] = {}  # round 0's params.json over its defaults
    sandbox: str = "auto"
    llm: LLMConfig = Field(default_factory=LLMConfig)
    max_cost: float | None = resumable(None, ge=0)  # USD; checked before each LLM call
    max_tokens: int | None = resumable(None, ge=1)  # input + output, likewise
    prescreen: bool = resumable(True)  # a real target's candidates run on the calibrated twin first (off for good)
    prescreen_margin: float = Field(0.05, ge=0, le=1)  # how far below the best's prediction still goes on
    llm_review_required: bool = False  # an LLM review that cannot be had rejects (else the gate decides alone)
    time_limit_s: float | None = resumable(None, ge=1)  # per candidate child run (default: the target's)

    def recorded_target(self, run_dir: Path, or_else: str = "") -> str:
        """The target the run started on. A spec file no longer where it was is said as the run's own
        (a bare "file not found" named a path the user never typed, and no way out); ``or_else``: what
        else the command can be given."""
        if Path(self.target).is_absolute() and not Path(self.target).is_file():
            raise ConfigError(
                f"{run_dir} was started from the target spec {self.target}, which is no longer there: put it "
                f"back (the run's records were measured under it){or_else}"
            )
        return self.target

    @field_validator("policy", "agents", "sandbox", "starter", "selection")
    @classmethod
    def _known(cls, value: str, info: ValidationInfo) -> str:
        what, known = CHOICES[info.field_name]
        if value not in known:
            raise ValueError(unknown(what, value, known))
        return value

    @model_validator(mode="after")
    def _together(self) -> RunConfig:
        if self.policy == "llm" and self.agents not in LLM_BACKENDS:
            raise ValueError("--policy llm needs an LLM backend (--agents openai or anthropic)")
        if self.selection != "fitness" and self.policy != "evolve":
            raise ValueError(f"--selection {self.selection} chooses the evolve policy's parents: add --policy evolve")
        if self.llm_review_required and self.agents == "offline":
            raise ValueError(
                "--require-llm-review needs a backend with an LLM review (--agents openai, anthropic or cli:...)"
            )
        return self

    def llm_options_given(self) -> list[str]:
        """The flags of LLM-only settings this config holds (``--model``, ``--max-cost``, ...)."""
        given = [name for name, value in self.llm if value is not None and name != "stream"]
        given += [name for name in LLM_BUDGETS if getattr(self, name) is not None]
        return [flag(name) for name in given]

    @classmethod
    def resumable_fields(cls) -> tuple[str, ...]:
        return tuple(
            name
            for name, info in cls.model_fields.items()
            if isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("resumable")
        )

    @classmethod
    def parse(cls, values: dict, given: Mapping[str, str] | None = None) -> RunConfig:
        """From user values: a bad one is a ``ConfigError`` naming each field and what is wrong. ``given``: how
        a field was given where not by its flag (``--config run.yaml: policy``)."""
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            raise ConfigError(described(error, given or {})) from None

    def resumed(self, overrides: dict) -> RunConfig:
        """This run's configuration with what a resume asks to change; a change to a field that is
        fixed for the run is a ``ConfigError`` naming it and its value."""
        stored, fixed = self.model_dump(), []
        # a field given as None is one left unset (a --print-config file of defaults): the run's stands (no
        # option takes None on the command line, so a file cannot clear a limit the run was given either)
        overrides = {k: v for k, v in overrides.items() if v is not None}
        RunConfig.parse({**stored, **overrides})  # a value no run takes is said so first, not as a change
        for name, value in overrides.items():
            if name in self.resumable_fields() or value == stored.get(name):
                continue
            pairs = (
                [(key, given, stored[name].get(key)) for key, given in value.items() if given != stored[name].get(key)]
                if name == "llm"  # the LLM settings: name each that changed
                else [(name, value, stored.get(name))]
            )
            fixed += [f"{flag(key)} {given} (this run's: {was})" for key, given, was in pairs]
        if fixed:
            raise ConfigError("a resumed run keeps what it started with, so these cannot change: " + "; ".join(fixed))
        if self.simulated:  # a simulated run has no twin to screen on: the setting means nothing there
            overrides.pop("prescreen", None)
        if overrides.get("prescreen") is True and not self.prescreen:
            raise ConfigError("prescreen cannot be turned back on: the twin is calibrated from round 0")
        return RunConfig.parse({**self.model_dump(), **overrides})


class ConfigError(UserError, ValueError):
    """A run configuration that cannot be (what is wrong, by field)."""


def described(error: ValidationError, given: Mapping[str, str]) -> str:
    """One line per bad field, by the option that sets it (``--policy evolv: unknown policy 'evolv' (did you
    mean 'evolve'?)``), or by ``given``'s word for how it was set (``--config run.yaml: policy evolv: ...``)."""
    lines = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        if not item["loc"]:
            lines.append(message)
            continue
        field = str(item["loc"][-1])
        lines.append(f"{given.get(field) or flag(field)} {item.get('input')}: {message}")
    return "; ".join(lines)
