"""Workload profiles: the distributions a simulated target draws from, fitted to a real run of an
environment (``vibetrain workload profile``), named by a spec (``workload: {profile: FILE}``) with
each key set in one place; the calibrated twin of a target whose environment is the user's plays the
profile on the stand-in."""

from __future__ import annotations

import math

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli import app
from targets.api import TraceEvent
from targets.harness.sim.calibrate import Calibration, write_calibrated_spec
from targets.harness.sim.profile_fit import ProfileError, fit_profile, stand_in_workload
from targets.spec import ResponseLengthSpec, SimulatorSpec, SpecError, load_target, parse_target

runner = CliRunner()
MEASURED_KEYS = ("turns", "env_latency_s", "env_latency_max_s", "env_failure_rate")


def _episode(
    group: int,
    member: int,
    turns: int,
    latency: float,
    response: int,
    failures: int = 0,
    timed_out: bool = False,
    lost: bool = False,
    capped: bool = False,
    reset: float | None = None,
    env_truncated: bool = False,
) -> list:
    """A finished episode's events as the harness records them (token lists kept; ``lost``, ``capped``
    and the reset's latency only where set, as a trace from before them has none)."""
    episode = f"g{group}/{member}"
    began = {"episode": episode, "group": f"g{group}", "observation": [1] * 10}
    events = [TraceEvent("env_reset", 0.0, began | ({"latency": reset} if reset is not None else {}))]
    for turn in range(1, turns + 1):
        events.append(
            TraceEvent(
                "generate",
                0.0,
                {"episode": episode, "tokens": [2] * response, "aborted": False},
            )
        )
        done = turn == turns
        events.append(
            TraceEvent(
                "env_step",
                0.0,
                {
                    "episode": episode,
                    "turn": turn,
                    "action": [2] * response,
                    "observation": [] if done else [3] * 6,
                    "reward": 0.0,
                    "done": done,
                    "latency": latency,
                    "failures": failures,
                    "timed_out": timed_out and done,
                    "truncated": False,
                }
                | ({"lost": True} if lost and done else {})
                | ({"capped": True} if capped and done else {})
                | ({"env_truncated": True} if env_truncated and done else {}),
            )
        )
    return events


def test_a_profile_is_fitted_from_the_episodes_a_run_finished(tiny_spec):
    events = []
    for group, (turns, latency) in enumerate([(1, 0.01), (2, 0.02), (4, 0.04), (8, 0.08)]):
        for member in range(2):
            events += _episode(group, member, turns, latency, response=4 + group, failures=member)
    unfinished = _episode(9, 0, 3, 0.5, response=16)[:-1]  # its last step never came: not fitted
    cut = _episode(10, 0, 20, 0.01, response=4, timed_out=True)  # the clock ended it: not a turn count
    crashed = _episode(11, 0, 10, 0.01, response=4, lost=True)  # a crash lost its state: nor is this
    profile = fit_profile(tiny_spec, [events + unfinished + cut + crashed], "planted")
    samples = profile["samples"]
    assert (samples["episodes"], samples["ended_by_the_environment"], samples["steps"]) == (10, 8, 60)
    assert samples["failed_attempts"] == 15 and samples["response_budget"] == tiny_spec.workload.tokens.response
    # the unfinished episode's 3 turns of 16 reached the budget of 16, of 63 whole turns
    assert samples["turns_at_budget"] == round(3 / 63, 4)
    assert profile["turns"]["max"] == 8 and profile["turns"]["dist"]["kind"] == "empirical"
    assert profile["turns"]["dist"] == {"kind": "empirical", "values": [1, 2, 4, 8], "counts": [2, 2, 2, 2]}
    assert profile["tokens"]["prompt"] == 10 and profile["tokens"]["observation"] == 6
    assert profile["env_latency_max_s"] == 0.08 and profile["env_failure_rate"] == round(15 / 75, 6)
    latency = profile["env_latency_s"]
    # the steps no failure slowed (member 0's, and the cut and lost episodes' 30 at 0.01 s): 8 of 45 at 0.08 s
    assert latency["kind"] == "lognormal" and math.isclose(latency["median"], 0.01, rel_tol=1e-6)
    lengths = profile["tokens"]["response_length"]
    assert lengths["task_sigma"] > 0 and lengths["turn_sigma"] == 0  # each group's turns are alike here
    single = fit_profile(tiny_spec, [_episode(0, 0, 1, 0.01, 5) + _episode(1, 0, 1, 0.02, 5)], "planted")
    assert single["turns"] == {"max": 1, "dist": {"kind": "fixed", "value": 1.0}}
    with pytest.raises(ProfileError, match="finished no episode"):
        fit_profile(tiny_spec, [unfinished], "planted")
    cut = _episode(0, 0, 2, 0.01, 5, timed_out=True) + _episode(0, 1, 2, 0.01, 5, lost=True)
    with pytest.raises(ProfileError, match=r"\(1 timed out \(workload.trajectory_timeout_s.*; 1 lost their state"):
        fit_profile(tiny_spec, [cut], "planted")  # each said: it was "finished no episode" alone


def test_a_two_peaked_turn_count_keeps_both_peaks_in_simulation(catalog_yaml):
    """80% of episodes end at 2 turns, 20% at 40: a lognormal fitted by median and spread drew a mean of about
    4 turns with 3% at 20 or more, where the run had 9.6 and 20% (a review of profiles). The fitted counts
    are drawn as seen."""
    import random

    from targets.harness.environments.base import drawn_turns
    from targets.spec import parse_target

    catalog_yaml["workload"]["turns"] = {"max": 40, "dist": {"kind": "fixed", "value": 1}}
    spec = parse_target(catalog_yaml)
    events = [e for k in range(50) for e in _episode(k, 0, 40 if k % 5 == 0 else 2, 0.01, 4)]
    profile = fit_profile(spec, [events], "planted")
    catalog_yaml["workload"]["turns"] = profile["turns"]
    workload = parse_target(catalog_yaml).workload
    rng = random.Random(0)
    drawn = [drawn_turns(workload, rng) for _ in range(20_000)]
    assert abs(sum(drawn) / len(drawn) - 9.6) < 0.4
    assert abs(sum(d >= 20 for d in drawn) / len(drawn) - 0.2) < 0.02


def test_episodes_the_turn_cap_ended_and_slow_resets_are_said_in_the_profile(tiny_spec):
    """An environment that never ended by itself was profiled as one that ends at the cap ('ended by the
    environment: 8 of 8'), and a reset that took 0.4 s appeared nowhere."""
    cap = tiny_spec.workload.turns.max
    capped = [e for member in range(3) for e in _episode(0, member, cap, 0.01, 4, capped=True, reset=0.4)]
    ended = [e for e in _episode(1, 0, 1, 0.01, 4, reset=0.4)]
    profile = fit_profile(tiny_spec, [capped + ended], "planted")
    samples = profile["samples"]
    assert (samples["ended_by_the_environment"], samples["ended_at_max_turns"]) == (1, 3)
    assert profile["turns"]["max"] == cap  # counted at the cap, as lengths at their budget
    assert samples["reset_latency_s"] == {"median": 0.4, "max": 0.4}
    assert profile["env_reset_s"] == {"kind": "lognormal", "median": 0.4, "sigma": 0.0}  # the stand-in resets as long
    notes = " ".join(samples["notes"])
    assert f"3 of 4 episodes ran to workload.turns.max ({cap}) without the environment ending them" in notes
    with pytest.raises(ProfileError, match=f"3 ran to workload.turns.max, {cap}: raise it"):
        fit_profile(tiny_spec, [capped], "planted")


def test_episodes_the_environment_truncated_are_counted_apart_from_those_its_play_ended(tiny_spec):
    """A gymnasium environment's own limit (its ``truncated``) ends an episode its play would have gone on
    with: counted at its length and said, as the turn cap's; a run where every episode was cut so is refused."""
    limited = [e for member in range(2) for e in _episode(0, member, 2, 0.01, 4, env_truncated=True)]
    ended = _episode(1, 0, 1, 0.01, 4)
    samples = fit_profile(tiny_spec, [limited + ended], "planted")["samples"]
    assert (samples["ended_by_the_environment"], samples["truncated_by_the_environment"]) == (1, 2)
    assert "2 of 3 episodes the environment truncated (a limit of its own" in " ".join(samples["notes"])
    with pytest.raises(ProfileError, match=r"the environment truncated 2 \(a limit of its own\): raise it"):
        fit_profile(tiny_spec, [limited], "planted")


def test_response_lengths_spread_past_the_specs_cap_are_held_at_it(catalog_yaml):
    """Groups of one-token and 2000-token turns spread wider (sigma 5.4) than a spec may say: the fit
    raised pydantic's ValidationError (a traceback from ``workload profile``, relabelled by calibrate as
    a trace of another harness)."""
    catalog_yaml["workload"]["tokens"].update(response=4096, max_sequence=16384)
    spec = parse_target(catalog_yaml)
    events = [
        e for group in range(2) for member, n in enumerate((1, 2000)) for e in _episode(group, member, 1, 0.01, n)
    ]
    profile = fit_profile(spec, [events], "planted")
    lengths = profile["tokens"]["response_length"]
    assert lengths["turn_sigma"] == 3.0 and lengths["mean"] == 1000.5
    (note,) = profile["samples"]["notes"]  # and `workload profile` prints it
    assert note == "response lengths spread wider than the simulator models: their sigma held at 3"


def _profiled_spec(catalog_yaml, tmp_path, fragment: dict, **workload) -> dict:
    (tmp_path / "profiles").mkdir(exist_ok=True)
    (tmp_path / "profiles" / "env.yaml").write_text(yaml.safe_dump(fragment))
    data = dict(catalog_yaml)
    kept = {k: v for k, v in data["workload"].items() if k not in MEASURED_KEYS}
    kept["tokens"] = {k: v for k, v in kept["tokens"].items() if k in ("response", "max_sequence")}
    data["workload"] = {**kept, "profile": "profiles/env.yaml", **workload}
    data["execution"] = "simulated"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    return data


FRAGMENT = {
    "measured_on": "planted",
    "samples": {"episodes": 8, "steps": 30, "failed_attempts": 0},
    "turns": {"max": 6, "dist": {"kind": "lognormal", "median": 2.0, "sigma": 0.7}},
    "tokens": {"prompt": 40, "observation": 12, "response_length": {"mean": 9.5, "task_sigma": 0.3, "turn_sigma": 0.2}},
    "env_latency_s": {"kind": "lognormal", "median": 0.03, "sigma": 1.1},
    "env_latency_max_s": 0.4,
    "env_failure_rate": 0.01,
}


def _cut(budget: object = 12, share: object = 0.2) -> dict:
    """FRAGMENT measured under a response budget of ``budget`` tokens, ``share`` of its turns cut there."""
    return {**FRAGMENT, "samples": {**FRAGMENT["samples"], "response_budget": budget, "turns_at_budget": share}}


CUT = _cut()  # the spec's budget is tiny-qwen3-cpu's 16


@pytest.mark.parametrize(
    ("fragment", "response"),
    [(_cut(share=0.01), 16), (_cut(budget=16), 16), (_cut(budget=32), 16)],
    ids=["few turns cut", "the same budget", "a smaller budget"],
)
def test_lengths_measured_under_a_budget_serve_a_spec_they_were_not_cut_for(catalog_yaml, tmp_path, fragment, response):
    """A spec with a larger budget takes lengths that seldom reached the measured one; with the same or
    a smaller budget the simulator cuts the lengths where the real engine would."""
    catalog_yaml["workload"]["tokens"]["response"] = response
    _profiled_spec(catalog_yaml, tmp_path, fragment)
    assert load_target(tmp_path / "spec.yaml").workload.tokens.response_length.mean == 9.5


def test_a_spec_takes_its_profiles_keys_from_the_file_beside_it(catalog_yaml, tmp_path):
    _profiled_spec(catalog_yaml, tmp_path, FRAGMENT)
    spec = load_target(tmp_path / "spec.yaml")  # the profile's path is relative to the spec's own folder
    w = spec.workload
    assert w.profile == str(tmp_path / "profiles" / "env.yaml")
    assert (w.turns.max, w.turns.dist.median, w.tokens.prompt, w.tokens.observation) == (6, 2.0, 40, 12)
    assert w.tokens.response == catalog_yaml["workload"]["tokens"]["response"]  # the spec's own budget
    assert (w.env_latency_s.median, w.env_latency_max_s, w.env_failure_rate) == (0.03, 0.4, 0.01)
    assert w.tokens.response_length.mean == 9.5


def test_a_profiled_spec_resolves_to_one_that_stands_alone(catalog_yaml, tmp_path):
    """What ``target show`` prints (and export writes, and provenance hashes) carries the measured
    keys themselves: it validates anywhere, and its calibrated twin is refitted from it."""
    _profiled_spec(catalog_yaml, tmp_path, FRAGMENT)
    shown = runner.invoke(app, ["target", "show", str(tmp_path / "spec.yaml")])
    assert shown.exit_code == 0 and "profile" not in shown.output
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "shown.yaml").write_text(shown.output)
    again = load_target(tmp_path / "elsewhere" / "shown.yaml")
    assert again.model_dump() == load_target(tmp_path / "spec.yaml").model_dump()

    fitted = Calibration(SimulatorSpec(), 0.5, 1.0, ResponseLengthSpec(mean=7.0, turn_sigma=0.1))
    twin = load_target(write_calibrated_spec(str(tmp_path / "spec.yaml"), fitted, tmp_path / "elsewhere" / "t.yaml"))
    assert twin.workload.turns.dist.median == 2.0 and twin.workload.tokens.prompt == 40  # the profile's
    assert twin.workload.tokens.response_length.mean == 7.0  # refitted


def test_a_calibrated_twin_written_elsewhere_finds_a_model_named_relative_to_its_spec(catalog_yaml, tmp_path):
    """The twin's YAML is written to the run's folder: a ``weights: m`` read beside the spec was read
    beside the copy, and the calibration failed after its whole real run."""
    import shutil

    from targets.harness.model import model_dir

    shutil.copytree(model_dir(parse_target(catalog_yaml).model), tmp_path / "m")
    catalog_yaml["model"]["weights"] = "m"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(catalog_yaml))
    (tmp_path / "run").mkdir()
    fitted = Calibration(SimulatorSpec(), 0.5, 1.0, ResponseLengthSpec(mean=7.0, turn_sigma=0.1))
    twin = load_target(write_calibrated_spec(str(tmp_path / "spec.yaml"), fitted, tmp_path / "run" / "t.yaml"))
    assert twin.model.weights == str(tmp_path / "m")


@pytest.mark.parametrize(
    ("fragment", "workload", "message"),
    [
        (FRAGMENT, {"env_latency_max_s": 1.0}, "measured env_latency_max_s: set each in one place"),
        (FRAGMENT, {"tokens": {"response": 16, "max_sequence": 256, "prompt": 8}}, "measured tokens.prompt"),
        ({**FRAGMENT, "batch_size": 4}, {}, "batch_size are not what a profile measures"),
        ({**FRAGMENT, "tokens": {"response": 4}}, {}, "tokens.response are not what a profile measures"),
        ([1, 2], {}, "a mapping of workload keys, got list"),
        (
            {**FRAGMENT, "env_latency_s": {"kind": "normal"}},
            {},
            "workload.env_latency_s` (from the profile profiles/env.yaml)",
        ),
        (
            {**FRAGMENT, "tokens": {**FRAGMENT["tokens"], "prompt": -3}},
            {},
            "field `workload.tokens.prompt` (from the profile profiles/env.yaml): Input should be greater",
        ),
        (FRAGMENT, {"profile": "nowhere.yaml"}, "nowhere.yaml: cannot read it"),
        ({**FRAGMENT, "tokens": [1]}, {}, "tokens: a mapping of workload keys, got list"),
        (FRAGMENT, {"tokens": "prompt"}, "tokens: a mapping (prompt, response, ...), got str"),
        (CUT, {}, "20% of its turns ran to the response budget it was measured under (12 tokens"),
        (_cut(budget="8"), {}, "samples.response_budget: the lengths' budget, a positive integer, got '8'"),
        (_cut(share=20), {}, "samples.turns_at_budget: a share between 0 and 1, got 20"),
        (
            _cut(budget=32),
            {"tokens": {"response": 9, "max_sequence": 256}},
            "profiles/env.yaml: its turns' response lengths average 9.5 tokens (tokens.response_length.mean), which "
            "a budget of 9 (tokens.response) cannot hold",
        ),
        (
            FRAGMENT,
            {"environment": {"name": "guess_number"}},
            "profiles/env.yaml measured turn counts for one that draws them",
        ),
    ],
    ids=[
        "set twice",
        "token set twice",
        "not measured",
        "budget not measured",
        "not a mapping",
        "bad value",
        "bad token count",
        "missing",
        "tokens not a mapping",
        "spec tokens not a mapping",
        "lengths cut below the spec's budget",
        "budget not a number",
        "share not a share",
        "a budget under the lengths' mean",
        "turn counts for an environment that plays",
    ],
)
def test_a_bad_profile_is_a_spec_error_naming_the_file_or_key(catalog_yaml, tmp_path, fragment, workload, message):
    _profiled_spec(catalog_yaml, tmp_path, fragment, **workload)
    with pytest.raises(SpecError) as caught:
        load_target(tmp_path / "spec.yaml")
    assert message in str(caught.value)
    result = runner.invoke(app, ["target", "validate", str(tmp_path / "spec.yaml")])
    assert result.exit_code == 2 and message.split(":")[0] in result.output and "Traceback" not in result.output


def test_a_profile_with_a_key_twice_or_that_is_no_text_names_its_file(catalog_yaml, tmp_path):
    _profiled_spec(catalog_yaml, tmp_path, FRAGMENT)
    profile = tmp_path / "profiles" / "env.yaml"
    text = profile.read_text()
    profile.write_text(text + text.splitlines()[0] + "\n")  # its first key again
    with pytest.raises(SpecError, match=f"(?s)profile {profile}: not valid YAML .* twice"):
        load_target(tmp_path / "spec.yaml")
    profile.write_bytes(b"\xff\xfe turns")
    with pytest.raises(SpecError, match=f"profile {profile}: not UTF-8 text"):
        load_target(tmp_path / "spec.yaml")


def test_the_calibrated_twin_of_a_user_environment_target_loads_as_written(tmp_path):
    """The twin of a target with a BPE tokenizer plays its environment on the built-in stand-in, which a
    real run refuses with that tokenizer: written as a real target, it could not be loaded (the pre-screen
    stopped every run of the arithmetic targets after round 0)."""
    from targets.harness.target import Target

    fitted = Calibration(SimulatorSpec(), 0.5, 1.0, ResponseLengthSpec(mean=7.0, turn_sigma=0.1), profile=FRAGMENT)
    path = write_calibrated_spec("tiny-qwen3-cpu-arithmetic", fitted, tmp_path / "twin.yaml")
    twin = Target.load(path, simulate=True)
    assert twin.simulated and twin.spec.workload.environment.name == "synthetic_agent"
    assert twin.spec.model.tokenizer == "bpe" and twin.spec.execution == "simulated"


def test_the_stand_in_plays_a_users_environment_from_its_profile(catalog_yaml):
    """What the calibrated twin of a user-environment target simulates: the stand-in, with the
    profile's keys in place of the spec's, the spec's own budgets and batch kept."""
    arithmetic = yaml.safe_load(load_target("tiny-qwen3-cpu-arithmetic").model_dump_json())
    workload = stand_in_workload(arithmetic["workload"], FRAGMENT)
    spec = parse_target({**arithmetic, "workload": workload, "execution": "simulated"})
    assert spec.workload.environment.name == "synthetic_agent"
    assert spec.workload.turns.dist.median == 2.0 and spec.workload.tokens.prompt == 40
    assert spec.workload.batch_size == arithmetic["workload"]["batch_size"]
    assert spec.workload.tokens.max_sequence == arithmetic["workload"]["tokens"]["max_sequence"]


def test_a_users_environment_is_never_simulated_as_it_is():
    result = runner.invoke(app, ["check", "tiny-qwen3-cpu-arithmetic", "--simulate"])
    assert result.exit_code != 0 and "only runs for real: simulate its calibrated twin" in result.output
    assert "Traceback" not in result.output
