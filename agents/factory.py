"""One place that turns a run's ``--agents`` choice into the four roles: ``offline``; ``openai`` or
``anthropic`` (LLM implementer, LLM review on top of the deterministic judge, LLM hints on top of the
offline evaluator, and an LLM planner for ``--policy llm``); ``cli:claude`` or ``cli:codex`` (a
coding-agent CLI as implementer and, read-only, as the LLM review on top of the deterministic judge;
offline for the rest)."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import yaml

from agents import workspace_git
from agents.offline import make_offline_agents
from agents.roles import Agents
from targets.harness.measure.session import Session
from targets.yaml_text import load_yaml

BACKENDS = ("offline", "openai", "anthropic", "cli:claude", "cli:codex")


def api_key_env(backend: str, llm: dict) -> str:
    """The variable that holds the backend's API key: --api-key-env, else the provider's usual one."""
    return llm.get("api_key_env") or ("OPENAI_API_KEY" if backend == "openai" else "ANTHROPIC_API_KEY")


def _is_price(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def load_prices(path: str | None) -> dict[str, tuple[float, float]]:
    """The default price table, overridden by a YAML file of ``model: [input, output]`` USD per Mtok."""
    from agents.llm.accounting import DEFAULT_PRICES

    prices = dict(DEFAULT_PRICES)
    if path:
        try:
            data = load_yaml(Path(path).read_text(), str(path)) or {}
        except OSError as error:
            raise ValueError(f"{path}: {error.strerror or error}") from None
        except yaml.YAMLError as error:
            raise ValueError(f"{path}: not YAML ({error})") from None
        if not isinstance(data, dict):
            raise ValueError(
                f"{path}: a price table maps each model to [input, output] USD per million tokens, "
                f"not a {type(data).__name__}"
            )
        for model, pair in data.items():
            prices_ok = isinstance(pair, list) and len(pair) == 2 and all(_is_price(x) for x in pair)
            if not prices_ok:  # a negative price would lower the spend: --max-cost could never stop the run
                raise ValueError(
                    f"{path}: price of {model!r} must be [input, output] USD per million tokens, two numbers "
                    f"of at least 0, got {pair!r}"
                )
            prices[model] = (float(pair[0]), float(pair[1]))
    return prices


def make_agents(
    backend: str,
    session: Session,
    *,
    engine_devices: int,
    seed: int,
    repeat: int,
    llm: dict | None = None,
    llm_review_required: bool = False,
) -> Agents:
    """``llm_review_required``: an LLM review that cannot be had rejects the candidate (otherwise the
    deterministic gate decides alone, and the round records that the review was unavailable)."""
    offline = make_offline_agents(session, engine_devices=engine_devices, seed=seed, repeat=repeat)
    if backend == "offline":
        return offline
    from agents.llm.accounting import Accounting
    from agents.llm.agents import DEFAULT_MAX_TURNS, LLMEvaluator, LLMImplementer, LLMPlanner
    from agents.llm.client import DEFAULT_MAX_OUTPUT_TOKENS, ClientConfig, make_client
    from agents.llm.judge import LLMJudge

    spec = session.target.spec
    llm = llm or {}
    accounting = Accounting(prices=load_prices(llm.get("prices")))
    if backend.startswith("cli:"):  # the CLI implements; the same CLI, read-only, reviews on top of the gate
        from agents.cli_agent import CLIChatClient, CLIImplementer
        from agents.cli_tools import cli_tool

        tool = cli_tool(backend.split(":", 1)[1])
        model = llm.get("model")
        implementer = CLIImplementer(session, tool, accounting, offline.implementer, model=model)
        judge = LLMJudge(
            offline.judge,
            CLIChatClient(tool, accounting, model=model),
            spec=spec,
            review_required=llm_review_required,
            file_access=False,  # the CLI review client answers in text only
        )
        return Agents(backend, offline.planner, implementer, judge, offline.evaluator, accounting)
    if not llm.get("model"):
        raise ValueError(f"--agents {backend} needs --model")
    config = ClientConfig(
        provider=backend,
        model=llm["model"],
        base_url=llm.get("base_url"),
        api_key_env=api_key_env(backend, llm),
        stream=llm.get("stream", True),
        backoff_s=llm.get("backoff_s", 1.0),
        max_output_tokens=llm.get("max_output_tokens", DEFAULT_MAX_OUTPUT_TOKENS),
    )
    client = make_client(config, accounting)

    # The tools' runs write outside the workspace: a folder there could be a link the agent planted.
    def checks(workspace: Path) -> str:
        out = Path(tempfile.mkdtemp(prefix="vibetrain-tool-check-"))
        try:
            verdict = offline.judge.judge(workspace, out, seed=TOOL_SEED)
        finally:
            shutil.rmtree(out)
        lines = [f"{c.name}: {'pass' if c.passed else 'FAIL'} {'; '.join(c.reasons)}" for c in verdict.checks]
        return ("PASSED\n" if verdict.passed else "FAILED\n") + "\n".join(lines)

    def benchmark(workspace: Path) -> str:
        return benchmark_tool(session, workspace)

    implementer = LLMImplementer(
        spec,
        client,
        session.sandbox,
        offline.implementer,
        checks,
        benchmark,
        max_turns=llm.get("max_turns") or DEFAULT_MAX_TURNS,
        accounting=accounting,
    )
    return Agents(
        backend,
        offline.planner,
        implementer,
        LLMJudge(offline.judge, client, spec=spec, review_required=llm_review_required),
        LLMEvaluator(spec, offline.evaluator, client),
        accounting,
        LLMPlanner(spec, client),
    )


# The LLM implementer's tools run on a workload of their own: on the twin's (``prescreen.TWIN_SEED``), what
# they quote back taught a candidate the workload its pre-screen would be run on (a review of the judge)
TOOL_SEED = 1


def benchmark_tool(session: Session, workspace: Path) -> str:
    """The LLM implementer's benchmark of its live workspace, refused as the judge refuses it first (a link
    there is the host's file, which the scan would read and quote back)."""
    tampered = workspace_git.tampering(workspace)
    if tampered:
        return "FAILED: " + "; ".join(tampered[:5])
    out = Path(tempfile.mkdtemp(prefix="vibetrain-tool-bench-"))
    try:
        measurement = session.measure(workspace, out, seed=TOOL_SEED)
    finally:
        shutil.rmtree(out)
    if not measurement.ok:
        return "FAILED: " + "; ".join(measurement.reasons[:5])
    return "\n".join(f"{k}: {v:.4g}" for k, v in measurement.metrics.items() if isinstance(v, (int, float)))
