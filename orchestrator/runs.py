"""Setting a run up: a new one (fresh repository and state) or a resumed one (state, repository and
the same agents), and reading candidates back out of a run (``RUN@best``, ``RUN@round-3``)."""

from __future__ import annotations

import difflib
import hashlib
import os
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

from agents.factory import api_key_env, load_prices, make_agents
from agents.llm.tools import MAX_DESIGN, truncated
from agents.roles import AgentError
from orchestrator import writer_lock
from orchestrator.config import LLM_BACKENDS, LLM_BUDGETS, ConfigError, LLMConfig, RunConfig, flag
from orchestrator.history import History, HistoryError
from orchestrator.policies import make_policy
from orchestrator.rounds import Loop
from orchestrator.run_dir import RunDir
from orchestrator.scratch import scratch_folder
from orchestrator.state import RunState, new_state
from skills.starter import unfit, with_params
from targets.cache import CacheError
from targets.errors import UserError
from targets.harness.environments.hosted import check_environment
from targets.harness.isolation.sandbox import SandboxUnavailable
from targets.harness.measure.session import Session
from targets.harness.target import Target, TargetUnavailable
from targets.spec import SpecError

WORKSPACES = Path("workspaces")  # where each run's round worktrees go, under a folder of the run's own


class RunSetupError(UserError, ValueError):
    """A run cannot start or resume as asked (the message says why and what to do)."""


def run_workspaces(workspaces: Path, run_dir: Path) -> Path:
    """The run's own folder of round worktrees: named by the run and its absolute path, so two runs
    named alike (``/a/run``, ``/b/run``) never meet."""
    tag = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return workspaces.resolve() / f"{run_dir.name}-{tag}"


def _loop(
    target: Target, state: RunState, history: History, run_dir: Path, workspaces: Path, on_event: Callable[..., None]
) -> Loop:
    config = state.config
    try:
        target.runtime()  # builds (and caches) the model files here: the sandbox cannot write them
    except CacheError:
        raise
    except OSError as error:  # the build's own writes (a full disk)
        raise RunSetupError(
            f"cannot write the model cache ({error}): set $VIBETRAIN_CACHE to a writable directory"
        ) from None
    engine_devices = target.engine_devices
    try:
        session = Session.open(target, config.sandbox, config.time_limit_s)
    except SandboxUnavailable as error:
        raise RunSetupError(str(error)) from None
    try:
        agents = make_agents(
            config.agents,
            session,
            engine_devices=engine_devices,
            seed=config.seed,
            repeat=config.repeat,
            llm=config.llm.model_dump(exclude_none=True),
            llm_review_required=config.llm_review_required,
        )
    except (AgentError, ValueError) as error:
        raise RunSetupError(str(error)) from None
    if agents.accounting is not None:  # checked before every LLM call, not only between rounds
        agents.accounting.max_cost, agents.accounting.max_tokens = config.max_cost, config.max_tokens
        agents.accounting.spent_before = dict(state.llm_used)  # the run's earlier sessions

    def design_of(record) -> str:  # in the planner's prompt: cut as the implementer's is
        return truncated(history.read(record.commit, "DESIGN.md"), MAX_DESIGN)

    policy = make_policy(config.policy, agents.planner, config.seed, agents.llm_planner, design_of, config.selection)
    loop = Loop(target, state, history, agents, policy, run_dir, run_workspaces(workspaces, run_dir), on_event, session)
    if agents.accounting is not None:
        agents.accounting.on_call = loop.save_llm_spend
    on_event("setup", sandbox=session.sandbox.backend, simulated=target.simulated)
    return loop


def _refuse_llm_options_offline(agents: str, flags: list[str]) -> None:
    """A forgotten ``--agents`` would otherwise run the offline agents without a word about the model."""
    if agents == "offline" and flags:
        raise RunSetupError(
            f"{', '.join(flags)} given with the offline agents, which call no LLM: give --agents openai, "
            f"anthropic or cli:..., or leave {'them' if len(flags) > 1 else 'it'} out"
        )


def _check_backend(agents: str, llm: LLMConfig) -> None:
    """What an agent backend needs of this machine (a model named, its key, its CLI), checked before the run
    writes anything (a cost cap's price is ``check_config``'s)."""
    if agents in LLM_BACKENDS:
        if not llm.model:
            raise RunSetupError(f"--agents {agents} needs --model")
        env = api_key_env(agents, llm.model_dump(exclude_none=True))
        if not os.environ.get(env):
            raise RunSetupError(
                f"--agents {agents}: no API key in ${env} (set it, or name another variable with --api-key-env)"
            )
    if agents.startswith("cli:") and shutil.which(agents[4:]) is None:
        raise RunSetupError(f"--agents {agents}: the {agents[4:]} CLI is not installed (no `{agents[4:]}` on PATH)")


def _check_cost_counted(agents: str, llm: LLMConfig, max_cost: float | None) -> None:
    """Where the run counts dollars from tokens (an LLM backend's calls, Codex's, which reports tokens
    only), ``--max-cost`` needs the model's price: at the start and on a resume that sets it."""
    if agents in LLM_BACKENDS:
        _check_priced(llm, max_cost)
    elif agents == "cli:codex" and max_cost is not None:
        if not llm.model:
            raise RunSetupError(
                "--agents cli:codex --max-cost: Codex reports no cost, so its tokens are priced by model; "
                "give --model (with --prices if the table lacks it), or budget tokens with --max-tokens instead"
            )
        _check_priced(llm, max_cost)


def _check_priced(llm: LLMConfig, max_cost: float | None) -> None:
    """``--prices`` must read (checked before the run starts, naming the option), and ``--max-cost``
    needs the model's price: without one every call would count $0 and the budget would never stop the
    run."""
    from agents.llm.accounting import Accounting

    try:
        prices = load_prices(llm.prices)
    except ValueError as error:  # load_prices names the file, whatever went wrong reading it
        raise RunSetupError(f"--prices: {error}") from None
    if max_cost is None:
        return
    model = llm.model
    if Accounting(prices=prices).priced_as(model) is None:
        raise RunSetupError(
            f"--max-cost {max_cost:g}: no price known for model {model!r}, so its calls would count $0 and "
            f"the budget could never stop the run; give its price with --prices FILE (YAML: {model}: "
            "[input, output] USD per million tokens), or budget tokens with --max-tokens instead"
        )


def check_config(
    target: str,
    config: RunConfig,
    simulate: bool = False,
    starter_params_from: str = "--starter-param",
    here: bool = True,
) -> Target | None:
    """What a run refuses in its settings (``--print-config`` writes no file a run would refuse): LLM
    options without an LLM, a cost cap without a price, the target, the starter and its params. Returns
    the target as it loads. ``here`` False: for the machine the run will have, so a target this one
    cannot run is checked as its simulated self, or not at all where it cannot be simulated (None)."""
    _refuse_llm_options_offline(config.agents, config.llm_options_given())
    _check_cost_counted(config.agents, config.llm, config.max_cost)
    try:
        resolved = Target.load(target, simulate=simulate)
    except TargetUnavailable as error:
        if here:
            raise RunSetupError(str(error)) from None
        try:
            resolved = Target.load(target, simulate=True)
        except TargetUnavailable:  # a user's environment runs for real only: the rest is the run's to check
            return None
    except SpecError as error:
        raise RunSetupError(str(error)) from None
    if (why := unfit(resolved.spec, config.starter)) is not None:
        raise RunSetupError(f"--starter {config.starter}: {why}")
    try:  # round 0 writes them; refused now, by name, rather than as a rejected starter
        with_params(resolved.spec, config.starter, config.starter_params, starter_params_from, resolved.engine_devices)
    except ValueError as error:
        raise RunSetupError(str(error)) from None
    return resolved


def start_run(
    target: str,
    run_dir: Path,
    config: RunConfig,
    on_event: Callable[..., None],
    workspaces: Path = WORKSPACES,
    simulate: bool = False,
    starter_params_from: str = "--starter-param",
) -> Loop:
    """A new run of ``config`` on ``target`` (a catalog id or a spec path) in ``run_dir``; ``simulate``
    runs it on the cluster simulator whatever the target's execution says. The twin pre-screen
    applies to a real target only (a simulated one's measurement is the simulation).
    ``starter_params_from``: how the starter's params were given, which an error in them names."""
    resolved = check_config(target, config, simulate, starter_params_from)
    _check_backend(config.agents, config.llm)
    check_environment(resolved.spec.workload.environment)  # one that cannot be made: said before any folder
    run_dir = run_dir.resolve()  # git and the sandbox run elsewhere
    if run_dir.exists() and any(run_dir.iterdir()):
        if not _never_started(run_dir):
            raise RunSetupError(f"{run_dir} already exists: continue it with --resume, or choose another --out")
        writer_lock.claim(run_dir).release()  # refused while another start holds it (before its first state)
        shutil.rmtree(run_dir)  # a start killed before its first state: nothing in it to keep
    config = config.model_copy(
        update={
            "target": resolved.ref,
            "target_id": resolved.spec.id,
            "simulated": resolved.simulated,
            "repeat": config.repeat or (1 if resolved.simulated else 3),
            "held_out": config.held_out if config.held_out is not None else (3 if resolved.simulated else 0),
            "prescreen": config.prescreen and not resolved.simulated,
        }
    )
    about = f"policy {config.policy}, agents {config.agents}, seed {config.seed}"
    made = run_dir  # the outermost folder this run makes (generated/ too on a first run); None: the user's
    while not made.parent.exists():
        made = made.parent
    made = None if run_dir.exists() else made
    # the run's lock before its repository: of two starts on one --out, the second is refused here (taken
    # after, both made the repository and the second committed a root of its own on the first's)
    lock = writer_lock.claim(run_dir)
    if (run_dir / ".git" / "HEAD").exists():  # a start that went first and has ended: its run, not ours
        lock.release()
        raise RunSetupError(f"{run_dir} already exists: continue it with --resume, or choose another --out")
    history = History.create(run_dir, f"vibetrain run: {config.target_id}\n\n{about}")
    history.claim()  # the lock this process holds; a new repository: nothing a killed git left yet
    state = new_state(config)
    state.spec_at_start = resolved.spec.model_dump(mode="json")
    state.save(run_dir)
    try:
        return _loop(resolved, state, history, run_dir, workspaces, on_event)
    except RunSetupError:  # nothing ran: take back what it made, so the same command can be retried
        history.release()
        for path in [made] if made is not None else list(run_dir.iterdir()):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        raise


def _never_started(run_dir: Path) -> bool:
    """A start killed before saving its first state: only the run's lock (killed before its repository),
    or a repository History made (its ``vibetrain`` committer, at most its ``best`` branch and root commit
    ``vibetrain run: ...``) and nothing else, no state, no round. ``--resume`` cannot go on from it ("never
    started"), and it held the folder against a new start ("already exists"). Any other folder is not
    taken back."""
    if RunDir(run_dir).state_file.exists() or [p.name for p in run_dir.iterdir()] != [".git"]:
        return False
    if not (run_dir / ".git").is_dir():
        return False
    lock = RunDir(run_dir).writer_lock
    if set((run_dir / ".git").rglob("*")) == {lock.parent, lock}:
        return True
    try:
        repo = History.open(run_dir).repo
    except HistoryError:
        return False
    if repo.config_reader().get_value("user", "name", "") != "vibetrain":
        return False
    if [ref.path for ref in repo.refs] not in ([], ["refs/heads/best"]):
        return False
    unborn = not repo.head.is_valid()
    return unborn or (not repo.head.commit.parents and repo.head.commit.message.startswith("vibetrain run: "))


def resume_run(
    run_dir: Path,
    overrides: dict,
    on_event: Callable[..., None],
    workspaces: Path = WORKSPACES,
    target: str | None = None,
) -> Loop:
    """The run in ``run_dir``, going on with ``overrides`` (only ``RunConfig.resumable_fields``
    may differ from what it started with). ``target``, when given, must be the run's."""
    run_dir = run_dir.resolve()  # git and the sandbox run elsewhere
    if not run_dir.exists():
        raise RunSetupError(f"{run_dir} does not exist: nothing to resume (start it without --resume)")
    try:
        history = History.open(run_dir)
    except HistoryError as error:
        raise RunSetupError(str(error)) from None
    for made_good in history.claim():  # before anything reads the repository: a kill's leavings refuse git
        on_event("recovered", reason=made_good)
    try:
        return _resumed(history, run_dir, overrides, on_event, workspaces, target)
    except BaseException:  # refused, or failed before its loop: the run is not this process's to hold
        history.release()
        raise


def _resumed(
    history: History,
    run_dir: Path,
    overrides: dict,
    on_event: Callable[..., None],
    workspaces: Path,
    target: str | None,
) -> Loop:
    """``resume_run`` once the run is this process's: its checks, then its loop."""
    dirty = history.dirty()
    if dirty:
        raise RunSetupError(
            f"{run_dir} has uncommitted changes ({len(dirty)}: {', '.join(dirty[:3])}): the run owns that "
            f"worktree; discard them (git -C {run_dir} reset --hard best) or copy them elsewhere first"
        )
    state = RunState.load(run_dir)
    if target is not None:
        given = str(Path(target).resolve()) if Path(target).is_file() else target
        if given not in (state.config.target, state.config.target_id):
            recorded = Path(state.config.target)
            way = (  # a spec moved since: its records were measured under the one it was started from
                f"; the spec it was started from is no longer there: put it back at {recorded}"
                if recorded.is_absolute() and not recorded.is_file()
                else f": resume it with its own (vibetrain generate {shlex.quote(state.config.target)} "
                f"--out {shlex.quote(str(run_dir))} --resume)"
            )
            raise RunSetupError(
                f"{run_dir} is a run for {state.config.target_id} ({state.config.target}), not {target}{way}"
            )
    starter = state.record(0)
    if starter is not None and state.best is None:
        raise RunSetupError(
            f"{run_dir}: its starter stack was not validated ({starter.verdict}: "
            f"{'; '.join(starter.reasons[:2]) or 'no reason recorded'}), and every round derives from a "
            f"validated one, so --resume has nothing to go on from. Fix the cause and start the run again "
            f"(remove {run_dir}, or give another --out); vibetrain log {run_dir} shows the attempt"
        )
    budgets = [flag(name) for name in LLM_BUDGETS if overrides.get(name) is not None]
    _refuse_llm_options_offline(state.config.agents, budgets)
    try:
        state.config = state.config.resumed(overrides)
    except ConfigError as error:
        raise RunSetupError(str(error)) from None
    if "max_cost" in overrides:
        _check_cost_counted(state.config.agents, state.config.llm, state.config.max_cost)
    try:
        resolved = Target.load(state.config.recorded_target(run_dir), simulate=state.config.simulated)
    except (TargetUnavailable, ConfigError) as error:
        raise RunSetupError(str(error)) from None
    changed = changed_values(state.spec_at_start, resolved.spec.model_dump(mode="json"))
    if changed:
        raise RunSetupError(
            f"{run_dir}: its target spec ({state.config.target}) changed since the run started: "
            f"{'; '.join(changed[:6])}{' ...' if len(changed) > 6 else ''}. Its next rounds would be measured "
            "under another target than its records and paired with them; restore the spec, or start a new run"
        )
    return _loop(resolved, state, history, run_dir, workspaces, on_event)


def changed_values(before: dict, now: dict, where: str = "") -> list[str]:
    """``path: old -> new`` for each value both specs hold and that differs (a field one of them lacks
    is a newer or older vibetrain's schema, not the user's change)."""
    changed = []
    for key in before.keys() & now.keys():
        path = f"{where}.{key}" if where else key
        was, is_ = before[key], now[key]
        if isinstance(was, list) and isinstance(is_, list) and len(was) == len(is_):  # baselines, pools: by item
            was, is_ = dict(enumerate(was)), dict(enumerate(is_))
        if isinstance(was, dict) and isinstance(is_, dict):
            changed += changed_values(was, is_, path)
        elif was != is_:
            changed.append(f"{path}: {was!r} -> {is_!r}")
    return sorted(changed)


NAMES_A_CANDIDATE = "RUN@best, RUN@latest, RUN@round-N or RUN@<commit>"


def export_candidate(ref: str) -> Path:
    """``RUN@best``, ``RUN@latest``, ``RUN@round-N`` or ``RUN@<commit>``: the candidate's files in a
    temporary directory."""
    return export_candidate_at(ref)[0]


def export_candidate_at(ref: str) -> tuple[Path, str]:
    """``export_candidate``, with the commit ``ref`` named when it was read (``best`` moves on)."""
    run, _, which = ref.rpartition("@")
    run_dir = Path(run)
    try:
        history = History.open(run_dir)
    except HistoryError as error:
        raise RunSetupError(f"{ref}: {error}") from None
    if which == "latest":  # the last round with a commit, as vibetrain show's ``latest``
        rounds = history.round_numbers()
        if not rounds:
            raise RunSetupError(f"{ref}: {run_dir} has no round with a commit yet")
        which = f"round-{rounds[-1]}"
    if which == "best":
        commit = history.best()
        if commit is None:
            raise RunSetupError(f"{ref}: {run_dir} has no validated candidate yet (vibetrain log {run} says why)")
    elif which.startswith("round-") and which[6:].isascii() and which[6:].isdigit():
        commit = history.round_commit(int(which[6:]))
        rejected = None if commit else history.rejected_commit(int(which[6:]))
        if rejected:  # the judge's reasons are with it: a reviewer reads it by its commit
            raise RunSetupError(f"{ref}: round {which[6:]} was rejected (its attempt: {run}@{rejected[:12]})")
    else:
        commit = which
    if not commit:
        raise RunSetupError(f"{ref}: no such candidate in {run_dir}")
    try:
        exported = history.export(commit, scratch_folder("vibetrain-candidate-") / f"{run_dir.name}@{which}")
        return exported, history.repo.commit(commit).hexsha
    except HistoryError as error:
        if which == "best" or which.startswith("round-"):
            raise RunSetupError(f"{ref}: {error}") from None
        close = difflib.get_close_matches(which, ["best", "latest"], n=1)
        hint = f"did you mean {run}@{close[0]}?" if close else f"write {NAMES_A_CANDIDATE}"
        raise RunSetupError(f"{ref}: {run_dir} has no commit {which!r} ({hint})") from None
