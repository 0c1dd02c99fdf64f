"""The skills library as data: each ``skills/<name>/SKILL.md`` opens with YAML front matter (what
kind of component it is, its recipe module, the evaluator hints that trigger it, and its tunable
parameters with their ranges; a technique also says how to switch it on, under which controllers it
works, and which other techniques it requires or conflicts with); the Markdown below is the knowledge
agents read."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from skills.recipes.build import STRUCTURE

SKILLS_DIR = Path(__file__).parent


class ParamRange(BaseModel):
    """A tunable parameter of ``params.json``: an int or float range. ``max_fraction`` bounds it by
    a fraction of the target's device count; ``step_engines`` makes device counts move in whole
    rollout engines; ``declares`` names the ``Declared`` field the stack sets from it, which the
    target's workload bounds too (``WorkloadSpec.declared_limits``); ``simulated`` says whether the
    cluster simulator models it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["int", "float"]
    min: float
    max: float | None = None
    max_fraction: float | None = Field(default=None, gt=0, le=1)
    step_engines: int | None = Field(default=None, gt=0)
    declares: Literal["async_ratio", "redundant_per_group", "tail_round"] | None = None
    simulated: bool = Field(default=False, description="the cluster simulator models it (else tuning it there is moot)")
    default: float | None = Field(default=None, description="the value a starter stack uses")
    step: float | None = Field(default=None, gt=0, description="moves add or subtract this (a count may start at 0)")

    def bounds(self, device_count: int, declared_limits: Mapping[str, tuple[str, int]]) -> tuple[float, float]:
        high = self.max if self.max is not None else float("inf")
        if self.max_fraction is not None:
            high = min(high, self.max_fraction * device_count)
        if self.declares is not None:
            high = min(high, declared_limits[self.declares][1])
        return self.min, high

    def allows(self, value, device_count: int, engine_devices: int, declared_limits: Mapping) -> bool:
        low, high = self.bounds(device_count, declared_limits)
        step = (self.step_engines or 0) * engine_devices
        return low <= value <= high and (not step or value % step == 0)


class Skill(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    kind: Literal["controller", "engine", "trainer", "mechanism", "technique"]  # technique: adds onto a controller
    recipe: str
    triggers: list[str] = []
    params: dict[str, ParamRange] = {}
    enable: dict[str, int | float] = {}  # a technique: the params.json changes that switch it on
    controllers: list[str] = []  # a technique: the controllers it works under (empty: every one)
    requires: list[str] = []  # techniques that must be on with it
    conflicts: list[str] = []  # techniques that must be off with it
    # mixed: only where the target's devices are of several kinds; serving: only beside a serving pool
    hardware: Literal["any", "mixed", "serving"] = "any"
    # stateful: only where a crash loses state (env_state); resetting: where a reset takes time (env_reset_s, or
    # a user's environment, which resets in its own)
    environments: Literal["any", "stateful", "resetting"] = "any"
    rewards: Literal["any", "serverless"] = "any"  # serverless: only where a reward model offers a serverless service
    text: str = ""

    def is_on(self, params: dict) -> bool:
        """A technique is on when a parameter that switches it on differs from its default."""
        return any(params.get(name, self.params[name].default) != self.params[name].default for name in self.enable)

    @property
    def path(self) -> Path:
        return SKILLS_DIR / self.name / "SKILL.md"


def parse_skill(path: Path) -> Skill:
    text = path.read_text()
    if not text.startswith("---\n"):
        raise ValueError(f"{path}: a SKILL.md must open with YAML front matter between '---' lines")
    front, _, body = text[4:].partition("\n---\n")
    data = yaml.safe_load(front) or {}
    if data.get("name") != path.parent.name:
        raise ValueError(
            f"{path}: front matter name {data.get('name')!r} differs from its directory {path.parent.name!r}"
        )
    return Skill.model_validate({**data, "text": body.strip()})


def load_skills(directory: Path = SKILLS_DIR) -> dict[str, Skill]:
    skills = {p.parent.name: parse_skill(p) for p in sorted(directory.glob("*/SKILL.md"))}
    controllers = {n for n, s in skills.items() if s.kind == "controller"}
    techniques = {n for n, s in skills.items() if s.kind == "technique"}
    for skill in skills.values():
        unknown = [
            *(f"controllers: {c}" for c in skill.controllers if c not in controllers),
            *(f"requires: {t}" for t in skill.requires if t not in techniques),
            *(f"conflicts: {t}" for t in skill.conflicts if t not in techniques),
            *(f"enable: {p}" for p in skill.enable if p not in skill.params),
        ]
        if unknown:
            raise ValueError(f"{skill.path}: front matter names what the library does not have: {unknown}")
    return skills


def applicable(skills: dict[str, Skill], technique: Skill, params: dict) -> bool:
    """Whether ``technique`` may be on in a stack with ``params``: its controller, the techniques it
    requires on, none it conflicts with on (either side's conflict counts)."""
    return not_applicable(skills, technique, params) is None


def not_applicable(skills: dict[str, Skill], technique: Skill, params: dict) -> str | None:
    """Why ``technique`` may not be on in a stack with ``params`` (``applicable``'s rules), or None."""
    on = {n for n, s in skills.items() if s.kind == "technique" and s.name != technique.name and s.is_on(params)}
    controller = params.get("controller")

    def named(names) -> str:  # a technique by its name and the params that switch it on (is_on's)
        return " and ".join(f"{n} ({', '.join(skills[n].enable) or 'never on'})" for n in sorted(names))

    if technique.controllers and controller not in technique.controllers:
        return f"it runs under {' or '.join(technique.controllers)} only, not {controller}"
    if missing := set(technique.requires) - on:
        return f"it needs {named(missing)} on too"
    if clashing := on & set(technique.conflicts) | {n for n in on if technique.name in skills[n].conflicts}:
        return f"it conflicts with {named(clashing)}, on too"
    return None


def legal(
    skills: dict[str, Skill],
    name: str,
    value,
    device_count: int,
    engine_devices: int,
    declared_limits: Mapping[str, tuple[str, int]],
    among: list[str] | None = None,
) -> bool:
    """Within the range every skill (of ``among``, if given) that declares ``name`` allows, on a
    target of ``device_count`` devices whose rollout engines span ``engine_devices`` each and whose
    workload bounds what a stack declares by ``declared_limits`` (``WorkloadSpec.declared_limits``).
    A name no skill declares is legal only if it is one of the stack's structure (``controller``, the
    device split: the planner checks those values itself); any other name nothing would read."""
    if not any(name in skill.params for skill in skills.values()):
        return name in STRUCTURE
    return all(
        skill.params[name].allows(value, device_count, engine_devices, declared_limits)
        for skill in skills.values()
        if name in skill.params and (among is None or skill.name in among)
    )


def defaults(skills: dict[str, Skill] | None = None) -> dict[str, int | float]:
    """Every parameter's starter value, as the skills' front matter states it."""
    found: dict[str, int | float] = {}
    for skill in (skills or load_skills()).values():
        for name, param in skill.params.items():
            if param.default is not None:
                found[name] = int(param.default) if param.type == "int" else param.default
    return found


def search_skills(query: str, skills: dict[str, Skill] | None = None) -> list[Skill]:
    """Skills whose name, triggers or text mention every word of ``query`` (case-insensitive)."""
    words = query.lower().split()
    found = []
    for skill in (skills or load_skills()).values():
        haystack = " ".join([skill.name, *skill.triggers, skill.text]).lower()
        if all(w in haystack for w in words):
            found.append(skill)
    return found
