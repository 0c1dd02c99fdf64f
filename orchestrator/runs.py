"""Setting a run up: a new one (fresh repository and state) or a resumed one (state, repository and
the same agents), and reading candidates back out of a run (``RUN@best``, ``RUN@round-3``)."""

from __future__ import annotations

import difflib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from agents.factory import BACKENDS, api_key_env, load_prices, make_agents
from agents.roles import AgentError
from orchestrator.history import History, HistoryError
from orchestrator.policies import make_policy
from orchestrator.rounds import Loop
from orchestrator.state import RunConfig, RunState, new_state
from skills.starter import CONTROLLERS
from targets.harness.launch import Limits
from targets.harness.sandbox import Sandbox, SandboxUnavailable
from targets.harness.session import Session
from targets.harness.sim.cost_model import CostModel
from targets.harness.target import Target, TargetUnavailable

POLICIES = ("backlog", "evolve", "llm")


class RunSetupError(ValueError):
    """A run cannot start or resume as asked (the message says why and what to do)."""


def unknown(what: str, name: str, known) -> str:
    """``unknown starter 'colocat' (did you mean 'colocate'?); known: ...``"""
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {what} {name!r}{hint}; known: {', '.join(known)}"


def _loop(
    target: Target,
    state: RunState,
    history: History,
    run_dir: Path,
    workspaces: Path,
    on_event: Callable[..., None],
    time_limit_s: float | None,
) -> Loop:
    config = state.config
    try:
        target.runtime()  # builds (and caches) the model files here: the sandbox cannot write them
    except OSError as error:
        raise RunSetupError(
            f"cannot write the model cache ({error}): set $VIBETRAIN_CACHE to a writable directory"
        ) from None
    engine_devices = CostModel.from_spec(target.spec).engine_devices if target.simulated else 1
    try:
        sandbox = Sandbox.detect(config.sandbox)
    except SandboxUnavailable as error:
        raise RunSetupError(str(error)) from None
    session = Session(target, sandbox, Limits.of(target, time_limit_s))
    try:
        agents = make_agents(
            config.agents,
            session,
            engine_devices=engine_devices,
            seed=config.seed,
            repeat=config.repeat,
            llm=config.llm,
            llm_review_required=config.llm_review_required,
        )
    except (AgentError, ValueError) as error:
        raise RunSetupError(str(error)) from None
    if agents.accounting is not None:  # checked before every LLM call, not only between rounds
        agents.accounting.max_cost, agents.accounting.max_tokens = config.max_cost, config.max_tokens
        agents.accounting.spent_before = dict(state.llm_used)  # the run's earlier sessions

    def design_of(record) -> str:
        return history.read(record.commit, "DESIGN.md")

    policy = make_policy(config.policy, agents.planner, config.seed, agents.llm_planner, design_of)
    loop = Loop(target, state, history, agents, policy, run_dir, workspaces / run_dir.name, on_event, session)
    if agents.accounting is not None:
        agents.accounting.on_call = loop.save_llm_spend
    on_event("setup", sandbox=sandbox.backend, simulated=target.simulated)
    return loop


def _check_backend(agents: str, llm: dict, max_cost: float | None = None) -> None:
    """What an agent backend needs, checked before the run writes anything."""
    import os
    import shutil

    if agents in ("openai", "anthropic"):
        if not llm.get("model"):
            raise RunSetupError(f"--agents {agents} needs --model")
        env = api_key_env(agents, llm)
        if not os.environ.get(env):
            raise RunSetupError(
                f"--agents {agents}: no API key in ${env} (set it, or name another variable with --api-key-env)"
            )
        _check_priced(llm, max_cost)
    if agents.startswith("cli:") and shutil.which(agents[4:]) is None:
        raise RunSetupError(f"--agents {agents}: the {agents[4:]} CLI is not installed (no `{agents[4:]}` on PATH)")
    if agents == "cli:codex" and max_cost is not None:  # Codex reports tokens, never dollars: priced here
        if not llm.get("model"):
            raise RunSetupError(
                "--agents cli:codex --max-cost: Codex reports no cost, so its tokens are priced by model; "
                "give --model (with --prices if the table lacks it), or budget tokens with --max-tokens instead"
            )
        _check_priced(llm, max_cost)


def _check_priced(llm: dict, max_cost: float | None) -> None:
    """``--max-cost`` needs the model's price: without one every call would count $0 and the budget
    would never stop the run."""
    if max_cost is None:
        return
    from agents.llm.client import Accounting

    try:
        prices = load_prices(llm.get("prices"))
    except ValueError as error:  # load_prices names the file, whatever went wrong reading it
        raise RunSetupError(f"--prices: {error}") from None
    model = llm["model"]
    if Accounting(prices=prices).priced_as(model) is None:
        raise RunSetupError(
            f"--max-cost {max_cost:g}: no price known for model {model!r}, so its calls would count $0 and "
            f"the budget could never stop the run; give its price with --prices FILE (YAML: {model}: "
            "[input, output] USD per million tokens), or budget tokens with --max-tokens instead"
        )


def start_run(
    target: str,
    run_dir: Path,
    workspaces: Path,
    *,
    rounds: int,
    policy: str,
    agents: str,
    seed: int,
    max_minutes: float | None,
    max_attempts: int,
    repeat: int | None,
    starter: str,
    sandbox: str,
    simulate: bool,
    time_limit_s: float | None,
    on_event: Callable[..., None],
    llm: dict | None = None,
    max_cost: float | None = None,
    max_tokens: int | None = None,
    prescreen: bool = True,
    prescreen_margin: float = 0.05,
    llm_review_required: bool = False,
) -> Loop:
    """``prescreen``: on a real target, candidates run on the calibrated twin before the judge (a
    simulated target has nothing to screen with: its measurement is the simulation).
    ``llm_review_required``: a candidate whose LLM review cannot be had is rejected (an LLM or CLI
    backend only; otherwise the gate decides alone and the round records the missing review)."""
    try:
        resolved = Target.load(target, simulate=simulate)
    except TargetUnavailable as error:
        raise RunSetupError(str(error)) from None
    spec = resolved.spec
    run_dir, workspaces = run_dir.resolve(), workspaces.resolve()  # git and the sandbox run elsewhere
    if run_dir.exists() and any(run_dir.iterdir()):
        raise RunSetupError(f"{run_dir} already exists: continue it with --resume, or choose another --out")
    if policy not in POLICIES:
        raise RunSetupError(unknown("policy", policy, POLICIES))
    if agents not in BACKENDS:
        raise RunSetupError(unknown("agent backend", agents, BACKENDS))
    if starter not in CONTROLLERS:
        raise RunSetupError(unknown("starter", starter, CONTROLLERS))
    if policy == "llm" and agents not in ("openai", "anthropic"):
        raise RunSetupError("--policy llm needs an LLM backend (--agents openai or anthropic)")
    if llm_review_required and agents == "offline":
        raise RunSetupError(
            "--require-llm-review needs a backend with an LLM review (--agents openai, anthropic or cli:...)"
        )
    if not 0 <= prescreen_margin <= 1:
        raise RunSetupError(f"--prescreen-margin {prescreen_margin:g}: a fraction of the best's prediction, 0 to 1")
    _check_backend(agents, llm or {}, max_cost)
    config = RunConfig(
        target=resolved.ref,
        target_id=spec.id,
        policy=policy,
        agents=agents,
        seed=seed,
        rounds=rounds,
        max_minutes=max_minutes,
        max_attempts=max_attempts,
        repeat=repeat or (1 if resolved.simulated else 3),
        starter=starter,
        simulated=resolved.simulated,
        sandbox=sandbox,
        llm=llm or {},
        max_cost=max_cost,
        max_tokens=max_tokens,
        prescreen=prescreen and not resolved.simulated,
        prescreen_margin=prescreen_margin,
        llm_review_required=llm_review_required,
    )
    history = History.create(run_dir, f"vibetrain run: {spec.id}\n\npolicy {policy}, agents {agents}, seed {seed}")
    state = new_state(config)
    state.save(run_dir)
    try:
        return _loop(resolved, state, history, run_dir, workspaces, on_event, time_limit_s)
    except RunSetupError:  # nothing ran: take the new repository back, so the same command can be retried
        shutil.rmtree(run_dir)
        raise


def resume_run(
    run_dir: Path,
    workspaces: Path,
    *,
    target: str,
    rounds: int | None,
    max_minutes: float | None,
    time_limit_s: float | None,
    on_event: Callable[..., None],
    max_cost: float | None = None,
    max_tokens: int | None = None,
    prescreen: bool | None = None,
) -> Loop:
    """``prescreen=False`` turns the twin pre-screen off from here on (it cannot be turned on later:
    the twin is calibrated from round 0)."""
    run_dir, workspaces = run_dir.resolve(), workspaces.resolve()  # git and the sandbox run elsewhere
    if not run_dir.exists():
        raise RunSetupError(f"{run_dir} does not exist: nothing to resume (start it without --resume)")
    try:
        history = History.open(run_dir)
    except HistoryError as error:
        raise RunSetupError(str(error)) from None
    dirty = history.dirty()
    if dirty:
        raise RunSetupError(
            f"{run_dir} has uncommitted changes ({len(dirty)}: {', '.join(dirty[:3])}): the run owns that "
            f"worktree; discard them (git -C {run_dir} reset --hard best) or copy them elsewhere first"
        )
    state = RunState.load(run_dir)
    given = str(Path(target).resolve()) if Path(target).exists() else target
    if given not in (state.config.target, state.config.target_id):
        raise RunSetupError(f"{run_dir} is a run for {state.config.target_id} ({state.config.target}), not {target}")
    starter = state.record(0)
    if starter is not None and state.best is None:
        raise RunSetupError(
            f"{run_dir}: its starter stack was not validated ({starter.verdict}: "
            f"{'; '.join(starter.reasons[:2]) or 'no reason recorded'}), and every round derives from a "
            f"validated one, so --resume has nothing to go on from. Fix the cause and start the run again "
            f"(remove {run_dir}, or give another --out); vibetrain log {run_dir} shows the attempt"
        )
    updates = {
        k: v
        for k, v in {
            "rounds": rounds,
            "max_minutes": max_minutes,
            "max_cost": max_cost,
            "max_tokens": max_tokens,
            "prescreen": False if prescreen is False else None,
        }.items()
        if v is not None
    }
    if max_cost is not None and state.config.agents in ("openai", "anthropic"):
        _check_priced(state.config.llm, max_cost)
    state.config = state.config.model_copy(update=updates)
    try:
        resolved = Target.load(state.config.target, simulate=state.config.simulated)
    except TargetUnavailable as error:
        raise RunSetupError(str(error)) from None
    return _loop(resolved, state, history, run_dir, workspaces, on_event, time_limit_s)


def export_candidate(ref: str) -> Path:
    """``RUN@best``, ``RUN@round-N`` or ``RUN@<commit>``: the candidate's files in a temporary directory."""
    run, _, which = ref.rpartition("@")
    run_dir = Path(run)
    try:
        history = History.open(run_dir)
    except HistoryError as error:
        raise RunSetupError(f"{ref}: {error}") from None
    if which == "best":
        commit = history.best()
    elif which.startswith("round-") and which[6:].isdigit():
        commit = history.round_commit(int(which[6:]))
    else:
        commit = which
    if not commit:
        raise RunSetupError(f"{ref}: no such candidate in {run_dir}")
    try:
        return history.export(commit, Path(tempfile.mkdtemp(prefix="vibetrain-candidate-")) / f"{run_dir.name}@{which}")
    except HistoryError as error:
        raise RunSetupError(f"{ref}: {error}") from None
