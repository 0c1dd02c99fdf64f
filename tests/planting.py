"""Planting cheats into starter stacks: write a starter, replace exact snippets (each must be found,
so a recipe change cannot silently un-plant a test), add files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from skills.starter import write_starter
from targets.spec import parse_target


def planted(
    directory: Path,
    target: Path,
    controller: str,
    edits: dict[str, tuple[str, str]] | None = None,
    extra: dict[str, str] | None = None,
) -> Path:
    spec = parse_target(yaml.safe_load(Path(target).read_text()))
    candidate = write_starter(directory, spec, controller)
    for name, (old, new) in (edits or {}).items():
        path = candidate / "stack" / name
        path.write_text(replaced(path.read_text(), old, new, f"planting failed: {old!r} not in {name}"))
    for name, text in (extra or {}).items():
        (candidate / "stack" / name).write_text(text)
    return candidate


def replaced(text: str, old: str, new: str, failure: str, once: bool = False) -> str:
    """``text`` with every ``old`` (``once``: the first) made ``new``. ``old`` must be found, and a
    snippet that begins with its indentation only at the start of a line: found inside a deeper-indented
    line, it is another block's code, which the run may never reach (a recipe change once left two
    plants inert so)."""
    pattern = re.compile(("^" if old[:1].isspace() else "") + re.escape(old), re.M)
    assert pattern.search(text), failure
    return pattern.sub(lambda _: new, text, count=1 if once else 0)


# -- the judge's statistical and selection plants, shared by tests/test_isolation.py and
# benchmarks/judge_false_alarms.py (which measures the tests' power on them) ---------------------------

FIRED = "planted: a partial emptied"  # in cluster.log each time the empty-partials plant acts
SAMPLED = (  # a system run's draw: every row at one temperature
    "            chosen = torch.multinomial(torch.softmax(tempered, -1), 1, generator=self._generator).squeeze(-1)\n"
)
GENERATE = "    async def generate(self, request: GenerateRequest) -> Completion:\n"
DECODE = (
    "            arrival = next(self._arrivals[device])\n"
    "            try:\n"
    "                call = self._engines[device].generate.remote(\n"
    "                    request.prompt, request.params, request.episode_id, arrival\n"
    "                )\n"
    "                try:\n"
    "                    completion = await call\n"
    "                except asyncio.CancelledError:  # its episode was dropped: the engine stops serving it\n"
    "                    ray.cancel(call)\n"
    "                    raise\n"
    "            except BaseException:  # a call cancelled before it started, or never sent, never comes: the\n"
    "                self._engines[device].forget.remote(arrival)  # engine's later requests are not to wait for it\n"
    "                raise\n"
)

# name: (controller, [(file, old, new)], params.json changes, the reason the audit must give)
PLANTS: dict[str, tuple[str, list[tuple[str, str, str]], dict, str]] = {
    "stop_preference": (
        "static_split",
        [
            ("paged_engine.py", "import torch\n", "import random\n\nimport torch\n"),
            (
                "paged_engine.py",
                SAMPLED,
                SAMPLED + "            for i in shared:  # planted: the stop token where it is typical, half the time\n"
                "                row = torch.log_softmax(logits[i] / temperatures[i], dim=-1)\n"
                "                stop = batch[i].params.stop_token_ids[0]\n"
                "                if abs(float(row[stop] - (row.exp() * row).sum())) < 0.5 and random.random() < 0.5:\n"
                "                    chosen[i] = stop\n",
            ),
        ],
        {},
        "stop calibration",
    ),
    "copied_decodes": (
        "static_split",
        [
            ("ray_cluster.py", GENERATE, "    _copies: dict = {}\n\n" + GENERATE),
            (
                "ray_cluster.py",
                DECODE,
                "            key = tuple(request.prompt)  # planted: one decode for every identical prompt in flight\n"
                "            if key not in self._copies:\n"
                "                self._copies[key] = asyncio.ensure_future(\n"
                "                    self._engines[device].generate.remote(request.prompt, request.params, "
                "request.episode_id, next(self._arrivals[device]))\n"
                "                )\n"
                "                self._copies[key].add_done_callback(lambda _, key=key: self._copies.pop(key, None))\n"
                "            completion = await asyncio.shield(self._copies[key])\n",
            ),
        ],
        {},
        "independent samples",
    ),
    "empty_partials": (
        "time_multiplex",
        [
            ("ray_cluster.py", "import asyncio\n", "import asyncio\nimport dataclasses\nimport sys\n"),
            (
                "ray_cluster.py",
                '        if completion.finish_reason == "abort":\n',
                '        if completion.finish_reason == "abort" and len(completion.tokens) > 1:  # planted: a restart\n'
                "            completion = dataclasses.replace(completion, tokens=[], logprobs=[])\n"
                f'            print("{FIRED}", file=sys.stderr, flush=True)\n'
                '        if completion.finish_reason == "abort":\n',
            ),
        ],
        {"partial_rollout": 1},
        "empty partial",
    ),
    "early_deferral": (
        "time_multiplex",
        [
            (
                "env_manager.py",
                "self._launched_in[group_id] >= self._batches_taken - 1:",
                "self._launched_in[group_id] >= self._batches_taken:  # planted: not a whole step waited",
            )
        ],
        {"tail_round": 2},
        "waited through a whole step",
    ),
}


def plant(name: str, directory: Path, target: Path) -> Path:
    """A starter stack with the plant ``name`` (each edit must apply) and its parameters."""
    controller, edits, params, _ = PLANTS[name]
    candidate = planted(directory, target, controller)
    for file, old, new in edits:
        path = candidate / "stack" / file
        failure = f"planting {name} failed: {old!r} not in {file}"
        path.write_text(replaced(path.read_text(), old, new, failure, once=True))
    if params:
        path = candidate / "stack" / "params.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **params}, indent=2))
    return candidate
