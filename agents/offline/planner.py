"""Offline planner: maps the evaluator's hints to skills by their triggers and writes tasks; it
composes techniques (add one the stack's controller and techniques allow, or remove one) and
proposes parameter perturbations within each skill's ranges. Deterministic for a seed."""

from __future__ import annotations

import random

from agents.roles import Hint, Task
from skills.library import ParamRange, Skill, applicable, defaults, legal, load_skills
from skills.starter import starter_params, unfit
from targets.spec import TargetSpec

# How a hint moves a parameter of the skill it triggers (factor for floats/ints, or engines +-).
PARAM_MOVES = {
    ("small_engine_batches", "train_devices"): +1,  # fewer, fuller engines: continuous batching needs company
    ("slow_sync", "bucket_bytes"): 4.0,
    ("slow_sync", "overlap_sync"): +1,  # expand the training devices while the others drain for the sync
    ("many_aborts", "train_devices"): -1,
    ("timeouts", "train_devices"): -1,
    ("tail_idle", "redundant_envs"): +1,  # spares let a group finish with its fastest members
    ("tail_idle", "shrink_at"): 0.7,  # start the switch while the tail still runs
    ("tail_idle", "kv_routing"): +1,  # balance engines by KV, admit the long turns first
    ("many_aborts", "partial_rollout"): +1,  # keep what interrupted turns decoded
    ("tail_idle", "partial_rollout"): +1,  # sync without waiting for the longest running turns
    ("stale_drops", "abort_stale"): +1,  # stop generating groups nobody can train
    ("stale_drops", "async_ratio"): +1,  # where the target allows it: let samples lag one more version
    ("stale_drops", "tail_round"): +1,  # defer the groups that overrun a step, rerun their tasks together
    ("tail_idle", "tail_round"): +1,
    ("train_devices_idle", "async_ratio"): +1,  # sampling further ahead keeps the trainer fed
}


CONTROLLER_PRIORITY = 10  # a hinted controller switch comes first (one more for each further finding it answers)
ADDITION_PRIORITY = 8  # a hinted technique (one finding answered; one more for each further finding)
MOVE_PRIORITY = 8  # a hinted move of a parameter


def _fmt(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


class OfflinePlanner:
    def __init__(self, spec: TargetSpec, engine_devices: int = 1, seed: int = 0, simulated: bool = False) -> None:
        self.spec, self.engine_devices, self.simulated = spec, engine_devices, simulated
        self.skills = load_skills()
        self.rng = random.Random(seed)

    # -- ranges ------------------------------------------------------------------------------------
    def legal(self, name: str, value, skills: list[str] | None = None) -> bool:
        """The library's answer on this target (its device count, its engines' size, what its workload
        lets a stack declare)."""
        w = self.spec.workload
        return legal(self.skills, name, value, self.spec.hardware.count, self.engine_devices, w.declared_limits, skills)

    def fits(self, params: dict) -> bool:
        """The stack's devices add up on this target, as its controller's build checks: a static split's
        two pools, and a dedicated judge's devices, within the job's; time_multiplex keeping a device that
        never trains (a range per parameter cannot say it: 9 training devices fit 16, not beside 8 rolling);
        an engine_scale the target allows, with the device counts in whole engines of that size."""
        count = self.spec.hardware.count
        judge = params.get("reward_devices", 0) if params.get("reward_placement") == 1 else 0
        train = params.get("train_devices", 0)
        scale = params.get("engine_scale", 1)  # larger engines, where the target lets a stack choose: moved whole
        engine = self.engine_devices * scale
        rollout = params.get("rollout_devices", 0)
        if scale != 1 and (scale > self.spec.simulator.max_engine_scale or train % engine or rollout % engine):
            return False
        if params.get("affinity_ratio", 0.0) and self._rollout_kinds(params) < 2:
            return False  # hardware affinity on engines of one kind: the router refuses it (nothing to prefer)
        on = {n for n, s in self.skills.items() if s.kind == "technique" and s.is_on(params)}
        if any(not set(self.skills[n].requires) <= on for n in on):
            return False  # a move switched off what a technique requires (stream training's partial shrink)
        if params.get("controller") == "static_split":
            return rollout + train + judge <= count
        if params.get("controller") == "time_multiplex":
            return train + judge < count
        return judge < count

    def _rollout_kinds(self, params: dict) -> int:
        """How many device kinds the controller's rollout engines span: a static split rolls out on its
        first ``rollout_devices``, the others on every device."""
        hardware = self.spec.hardware
        devices = hardware.device_ids()
        if params.get("controller") == "static_split":
            devices = devices[: params.get("rollout_devices", len(devices))]
        return len({hardware.by_name[hardware.pool_name(d)].kind for d in devices})

    def tunable(self, param: ParamRange) -> bool:
        return param.simulated or not self.simulated

    # -- tasks -------------------------------------------------------------------------------------
    def _controller_task(self, skill: Skill, hint: Hint | None, params: dict) -> Task | None:
        if params.get("controller") == skill.name or unfit(self.spec, skill.name) is not None:
            return None
        changes = {
            k: v
            for k, v in starter_params(self.spec, skill.name).items()
            if k in ("controller", "train_devices", "rollout_devices")
        }
        dropped = self._switch_off_stranded(params, changes)  # what the new controller cannot run goes off with it
        why = f"{hint.said}; " if hint else ""
        off = f"; off with it, as {skill.name} cannot run them: {', '.join(dropped)}" if dropped else ""
        return Task(
            id=f"controller={skill.name}",
            title=f"switch the controller to {skill.name}",
            rationale=f"{why}the {skill.name} skill is triggered by {', '.join(skill.triggers)}{off}",
            skills=[skill.name],
            changes=changes,
            priority=CONTROLLER_PRIORITY if hint else 1,
            source=f"trigger:{hint.code}" if hint else "skill",
            acceptance=self._acceptance(),
        )

    def as_on(self, task: Task, params: dict) -> Task:
        """``task`` as this planner would write it on ``params``: a controller switch queued under an earlier
        best carries the switch-offs of what it would strand here (else it no longer applies, and its id,
        known to the backlog, kept the switch from being queued again)."""
        skill = self.skills.get(task.skills[0]) if len(task.skills) == 1 else None
        if skill is None or not task.id.startswith("controller="):
            return task
        fresh = self._controller_task(skill, None, params)
        return task if fresh is None else task.model_copy(update={"changes": fresh.changes})

    def stranded(self, params: dict) -> list[str]:
        """The techniques on in ``params`` that may not be on there (their controller, what they require,
        what they conflict with): on in name only."""
        return [
            s.name
            for s in self.skills.values()
            if s.kind == "technique" and s.enable and s.is_on(params) and not applicable(self.skills, s, params)
        ]

    def _switch_off_stranded(self, params: dict, changes: dict) -> list[str]:
        """Switch off in ``changes`` each technique stranded once they apply (at its defaults, until none is:
        one off may strand another that required it); their names. Left on, a switch from time_multiplex
        kept progress_shrink or stream_training, which no other controller reads."""
        dropped: list[str] = []
        while names := self.stranded({**params, **changes}):
            for name in names:
                changes |= self._defaults(self.skills[name])
                dropped.append(name)
        return dropped

    def _defaults(self, skill: Skill) -> dict:
        """The changes that switch ``skill`` off: each of its parameters back to its default."""
        return {k: self._typed(skill, k, p.default) for k, p in skill.params.items() if p.default is not None}

    def _acceptance(self) -> list[str]:
        """What every offline task must show: the gate passes and the headline clears the noise."""
        return ["vibetrain check passes", f"{self.spec.headline_metric.name} improves beyond the noise threshold"]

    def _param_task(self, skill: Skill, name: str, value, reason: str, source: str, priority: int) -> Task:
        return Task(
            id=f"{name}={_fmt(value)}",
            title=f"set {name} to {_fmt(value)}",
            rationale=reason,
            skills=[skill.name],
            changes={name: value},
            priority=priority,
            source=source,
            acceptance=self._acceptance(),
        )

    def _moved(self, name: str, current, move, param: ParamRange):
        if name.endswith("_devices"):
            return int(current + move * self.engine_devices)
        if param.step is not None:  # a count that may start at 0: moves add steps
            value = current + move * param.step
            return int(value) if param.type == "int" else round(value, 6)
        value = current * move
        return int(value) if isinstance(current, int) else round(value, 6)

    def composition_tasks(self, params: dict) -> list[Task]:
        """Add each technique that is off and may go on top of ``params`` (its controller, what it
        requires, nothing it conflicts with), or remove one that is on (unless another requires it)."""
        tasks = []
        for skill in self.skills.values():
            if skill.kind != "technique" or not skill.enable:
                continue
            if not skill.is_on(params):
                task = self._addition(skill, params, 5)
                if task:
                    tasks.append(task)
            elif not self._required(skill, params):
                tasks.append(self._composition_task(skill, "remove", self._defaults(skill), 2))
        return tasks

    def _resets_take_time(self) -> bool:
        """The harness's environments draw a reset time, or the environment is the user's (its resets its own)."""
        workload = self.spec.workload
        return workload.env_reset_s is not None or workload.environment.entry is not None

    def _addition(self, skill: Skill, params: dict, priority: int) -> Task | None:
        """Switch a technique that is off on the way its skill's ``enable`` says, where it may go on top of
        ``params`` (its controller, what it requires, nothing it conflicts with) and its values are legal."""
        changes = {k: self._within_target(skill, k, self._typed(skill, k, v)) for k, v in skill.enable.items()}
        if (
            not skill.is_on(changes)
            or (skill.hardware == "mixed" and self._rollout_kinds(params) < 2)
            or (skill.hardware == "serving" and not self.spec.hardware.serving_device_ids())
            or (skill.environments == "stateful" and self.spec.workload.env_state is None)
            or (skill.environments == "resetting" and not self._resets_take_time())
            or (skill.rewards == "serverless" and not self._serverless_judge())
            or not applicable(self.skills, skill, params)
            or not all(self.legal(k, v, [skill.name]) and self.tunable(skill.params[k]) for k, v in changes.items())
            or not self.fits({**params, **changes})
        ):
            return None
        return self._composition_task(skill, "add", changes, priority)

    def _serverless_judge(self) -> bool:
        judge = self.spec.workload.reward_model
        return judge is not None and judge.serverless is not None

    def _within_target(self, skill: Skill, name: str, value):
        """An ``enable`` value over what this target lets a stack declare comes down to that limit
        (tail_round 8 is 4 where a step has 4 groups)."""
        declares = skill.params[name].declares
        return value if declares is None else min(value, self.spec.workload.declared_limits[declares][1])

    def _typed(self, skill: Skill, name: str, value):
        return int(value) if skill.params[name].type == "int" else value

    def _composition_task(self, skill: Skill, verb: str, changes: dict, priority: int) -> Task:
        summary = ", ".join(f"{k} {_fmt(v)}" for k, v in changes.items())
        return Task(
            id=f"{verb}-{skill.name}",
            title=f"{verb} the {skill.name} technique ({summary})",
            rationale=f"compose: {verb} {skill.name} on top of the parent's techniques",
            skills=[skill.name],
            changes=changes,
            priority=priority,
            source="composition",
            acceptance=self._acceptance(),
        )

    def tasks_from_hints(self, hints: list[Hint], params: dict) -> list[Task]:
        """Tasks for the skills the evaluator's hints trigger: switch to a controller; switch on a technique
        that is off (the very task composition proposes, so one id whichever way it is reached), ranked by
        how many of the findings it answers; move a parameter of one that is on."""
        tasks: list[Task] = []
        codes = {hint.code for hint in hints}
        for hint in hints:
            for skill in self.skills.values():
                if hint.code not in skill.triggers:
                    continue
                if skill.kind == "technique" and not (skill.is_on(params) or applicable(self.skills, skill, params)):
                    continue  # not under this controller, or beside a technique it conflicts with
                if skill.kind == "controller":
                    task = self._controller_task(skill, hint, params)
                    if task and task.id not in {t.id for t in tasks}:
                        # the switch that answers the most findings first, then the one whose skill
                        # answers more kinds of finding (time_multiplex's idle devices and tails over
                        # the static split's idle devices alone)
                        answered = len(codes & set(skill.triggers))
                        tasks.append(task.model_copy(update={"priority": CONTROLLER_PRIORITY + answered - 1}))
                if skill.kind == "technique" and skill.enable and not skill.is_on(params):
                    answered = len(codes & set(skill.triggers))  # 8 for one finding, 9 for more: below a controller
                    task = self._addition(skill, params, min(ADDITION_PRIORITY + answered - 1, CONTROLLER_PRIORITY - 1))
                    if task and task.id not in {t.id for t in tasks}:
                        why = {"rationale": f"{hint.said}: {task.title}", "source": f"trigger:{hint.code}"}
                        tasks.append(task.model_copy(update=why))
                    continue  # while it is off its parameters are moot: later hints move them
                for name in skill.params:
                    move = PARAM_MOVES.get((hint.code, name))
                    if move is None or (skill.kind == "controller" and params.get("controller") != skill.name):
                        continue  # a controller's parameters matter only under that controller
                    current = params.get(name, self.default(name))
                    if current is None:
                        continue
                    value = self._moved(name, current, move, skill.params[name])
                    if (
                        value != current
                        and self.legal(name, value, [skill.name])
                        and self.tunable(skill.params[name])
                        and self.fits({**params, name: value})
                    ):
                        tasks.append(
                            self._param_task(
                                skill,
                                name,
                                value,
                                f"{hint.said}: move {name} {_fmt(current)} -> {_fmt(value)}",
                                f"trigger:{hint.code}",
                                MOVE_PRIORITY,
                            )
                        )
        breadth = {name: len(s.triggers) for name, s in self.skills.items() if s.kind == "controller"}
        return sorted(tasks, key=lambda t: (-t.priority, -breadth.get(t.skills[0], 0) if t.skills else 0))

    def applies(self, task: Task, params: dict) -> bool:
        """Whether a task written for one parent still means what it says on ``params`` (a backlog task
        may wait while the best changes): an addition of a technique that is off and may go on, a removal
        of one that is on and nothing requires, a switch to another controller, a move of a parameter of
        a skill in use, to a value it does not have. Other tasks (an LLM planner's) are not judged here."""
        skill = self.skills.get(task.skills[0]) if len(task.skills) == 1 else None
        if skill is None:
            return True
        if task.id.startswith("add-"):
            return (
                not skill.is_on(params)
                and applicable(self.skills, skill, params)
                and self.fits({**params, **task.changes})
            )
        if task.id.startswith("remove-"):
            return skill.is_on(params) and not self._required(skill, params)
        if task.id.startswith("controller="):  # and nothing left on that the new controller cannot run
            after = {**params, **task.changes}
            return params.get("controller") != skill.name and self.fits(after) and not self.stranded(after)
        return (
            self._in_use(skill, params)
            and any(params.get(k, self.default(k)) != v for k, v in task.changes.items())
            and self.fits({**params, **task.changes})
        )

    def _required(self, skill: Skill, params: dict) -> bool:
        """Another technique that is on in ``params`` requires ``skill``."""
        return any(skill.name in other.requires and other.is_on(params) for other in self.skills.values())

    def _in_use(self, skill: Skill, params: dict) -> bool:
        """Whether ``skill``'s parameters matter in ``params``: a controller's under that controller, a
        switchable technique's while it is on, the others' always."""
        if skill.kind == "controller":
            return params.get("controller") == skill.name
        return not (skill.kind == "technique" and skill.enable) or skill.is_on(params)

    def perturbation(self, params: dict) -> Task | None:
        """A random legal move of one tunable parameter that applies to ``params`` (evolve's mutation)."""
        moves = self.parameter_moves(params)
        return self.rng.choice(moves) if moves else None

    def parameter_moves(self, params: dict) -> list[Task]:
        """Every legal one-step move of a tunable parameter in use on ``params`` (a device count by one
        engine, a stepped count by one step, anything else halved or doubled), in a fixed order."""
        tasks = []
        for skill in self.skills.values():
            if not self._in_use(skill, params):
                continue  # another controller's, or a technique that is off (adding it is a composition task)
            for name, param in skill.params.items():
                current = params.get(name, self.default(name))
                if current is None or not self.tunable(param):
                    continue
                moves = (-1, 1) if name.endswith("_devices") or param.step is not None else (0.5, 2.0)
                for move in moves:
                    value = self._moved(name, current, move, param)
                    if (
                        value != current
                        and self.legal(name, value, [skill.name])
                        and self.fits({**params, name: value})
                    ):
                        reason = f"explore: {name} {_fmt(current)} -> {_fmt(value)}"
                        tasks.append(self._param_task(skill, name, value, reason, "mutation", 0))
        return tasks

    def default(self, name: str):
        """A parameter's value where params.json leaves it out."""
        if name == "async_ratio":  # the target's own bound, which a stack runs under unless it declares one
            return self.spec.workload.async_ratio
        return defaults(self.skills).get(name)
