"""The skills library as data: each ``skills/<name>/SKILL.md`` opens with YAML front matter (what
kind of component it is, its recipe module, the evaluator hints that trigger it, and its tunable
parameters with their ranges); the Markdown below is the knowledge agents read."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

SKILLS_DIR = Path(__file__).parent


class ParamRange(BaseModel):
    """A tunable parameter of ``params.json``: an int or float range. ``max_fraction`` bounds it by
    a fraction of the target's device count; ``step_engines`` makes device counts move in whole
    rollout engines; ``simulated`` says whether the cluster simulator models it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["int", "float"]
    min: float
    max: float | None = None
    max_fraction: float | None = Field(default=None, gt=0, le=1)
    step_engines: int | None = Field(default=None, gt=0)
    simulated: bool = Field(default=False, description="the cluster simulator models it (else tuning it there is moot)")


class Skill(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    kind: Literal["controller", "engine", "trainer", "mechanism"]
    recipe: str
    triggers: list[str] = []
    params: dict[str, ParamRange] = {}
    text: str = ""

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
    return {p.parent.name: parse_skill(p) for p in sorted(directory.glob("*/SKILL.md"))}


def search_skills(query: str, skills: dict[str, Skill] | None = None) -> list[Skill]:
    """Skills whose name, triggers or text mention every word of ``query`` (case-insensitive)."""
    words = query.lower().split()
    found = []
    for skill in (skills or load_skills()).values():
        haystack = " ".join([skill.name, *skill.triggers, skill.text]).lower()
        if all(w in haystack for w in words):
            found.append(skill)
    return found
