"""The review commands as a reviewer uses them, on a run built without a model: ``log`` and
``show`` whole in a pipe (one row per round, grep-able), JSON for scripts, the stack's own diff
rather than the bookkeeping, the judge's evidence kept for validated rounds, why a validated round
was not promoted; ``--config``/``--print-config``, ``-h`` and ``--version``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.config import RunConfig
from orchestrator.state import RunState
from orchestrator.tables import rounds_table
from tests.review_run import make_review_run

runner = CliRunner()
NARROW = {"COLUMNS": "80"}


def _ok(*args: str, env=NARROW) -> str:
    result = runner.invoke(app, list(args), env=env)
    assert result.exit_code == 0, result.output
    return result.output


def test_log_in_a_pipe_is_one_whole_row_per_round(tmp_path):
    """At 80 columns the table split words mid-token and ``log | grep -c time_multiplex`` printed 0."""
    run = make_review_run(tmp_path)
    terminal = Console(width=80, force_terminal=True, color_system=None, record=True)
    terminal.print(rounds_table(run, RunState.load(run)))
    text = terminal.export_text()
    assert {"time_multiplex", "rollout_stalls", "trajectories"} <= set(text.split())  # never folded mid-word
    # what the headline counts, and per what (a bare 24.2 said neither)
    assert "headline: goodput, trajectories trained on that neither timed out nor were lost, per second" in " ".join(
        text.split()
    )
    lines = _ok("log", str(run)).splitlines()
    assert lines[0].split("\t") == ["round", "verdict", "headline", "vs parent", "commit", "task / why"]
    rows = [line.split("\t") for line in lines[1:]]
    assert [row[0] for row in rows] == ["0", "1", "2"]
    assert sum("time_multiplex" in line for line in lines) == 1
    assert "hints: rollout_stalls" in lines[2]  # the evaluator's hints, said as such (they read as a reason)
    # why round 1 is validated but not best: the pair and the rule it had to clear
    assert "not promoted: +2.4% [-3.0%, +8.0%], needs low > +5%" in lines[2]
    assert rows[2][1] == "rejected" and "never trained" in lines[3]


def test_every_table_prints_an_interval_as_what_it_is_and_gains_in_the_metric_s_direction(tmp_path):
    """The generalization table and the report printed one simulated seed as a zero-width '95% CI'
    ([1.30, 1.30]), bench printed a headline of zero over three pairs as '[n=1]', and log's 'vs parent'
    showed a 10% faster step_time_s candidate as -10%."""
    from orchestrator.tables import interval_of
    from targets.harness.measure.session import Paired

    assert interval_of(Paired.of([13.0], [10.0], deterministic=True)) == "[1 seed]"
    assert interval_of(Paired.of([13.0], [10.0])) == "[unbounded: 1 pair]"
    assert interval_of(Paired.of([0.0, 12.0, 11.0], [10.0] * 3)) == "[none: a headline was 0 or infinite]"
    assert interval_of(Paired.of([12.0, 13.0, 12.5], [10.0] * 3)).startswith("[1.")
    assert interval_of(Paired.of([0.0], [10.0])) == "[none: a headline was 0 or infinite]"  # not "1 pair"
    from orchestrator.state import Promotion
    from orchestrator.tables import paired_cell

    zero = Promotion(**Paired.of([0.0, 12.0, 11.0], [10.0] * 3).as_dict())  # log and the commit trailers too
    assert "[none: a headline was 0 or infinite]" in paired_cell(zero) and "unbounded" not in paired_cell(zero)
    run = make_review_run(tmp_path)
    state = RunState.load(run)
    state.spec_at_start = {"headline_metric": {"name": "step_time_s", "direction": "minimize"}}
    faster = state.rounds[1].model_copy(update={"headline": 9.0, "parent_headline": 10.0})
    state.rounds[1] = faster
    terminal = Console(width=200, record=True)
    terminal.print(rounds_table(run, state))
    assert "+11.1%" in terminal.export_text() and "-10.0%" not in terminal.export_text()


def test_log_and_show_json_are_the_records(tmp_path):
    run = make_review_run(tmp_path)
    log = json.loads(_ok("log", str(run), "--json"))
    assert log["best_round"] == 0 and [r["verdict"] for r in log["rounds"]] == ["accepted", "accepted", "rejected"]
    shown = json.loads(_ok("show", str(run), "1", "--json"))
    assert shown["round"] == 1 and shown["judge"]["checks"][1]["details"]["relative_update_error"] == 3.1e-7
    assert '+ "controller": "time_multiplex"' in shown["diff"] and ".vibetrain" not in shown["diff"]
    targets = json.loads(_ok("targets", "--json"))
    assert "tiny-qwen3-cpu" in [t["id"] for t in targets] and all(t["params"] for t in targets)


def test_show_cuts_a_long_diff_as_the_report_does_and_says_how_to_see_it_whole(tmp_path, monkeypatch):
    """``show RUN 0`` printed round 0's whole diff (the starter stack: 5,680 lines) to the terminal, where
    the report cuts it at ``DIFF_LINES``; --json keeps it whole, for scripts."""
    from orchestrator import tables

    run = make_review_run(tmp_path)
    whole = json.loads(_ok("show", str(run), "1", "--json"))["diff"].splitlines()
    monkeypatch.setattr(tables, "DIFF_LINES", 5)  # read by cut_diff, the one place a diff is cut
    shown = _ok("show", str(run), "1").splitlines()
    cut = shown.index(next(line for line in shown if line.startswith("diff against the parent")))
    assert shown[cut + 1 : cut + 6] == whole[:5] and len(whole) > 5
    assert shown[cut + 6].startswith(f"The diff is cut at 5 of its {len(whole)} lines; the whole of it: git -C")
    assert len(json.loads(_ok("show", str(run), "1", "--json"))["diff"].splitlines()) == len(whole)


def test_show_prints_the_change_and_the_evidence_not_the_bookkeeping(tmp_path):
    """``show RUN 2`` printed a diffstat dominated by .vibetrain/round.json, never the one-line change,
    and an accepted round kept no judge evidence."""
    run = make_review_run(tmp_path)
    shown = _ok("show", str(run), "1")
    assert '- "controller": "colocate"' in shown and '+ "controller": "time_multiplex"' in shown
    assert ".vibetrain/" not in shown.replace(f"git -C {run}", "")
    assert "implementer: set controller to time_multiplex" in shown
    assert "pass trainer: relative_update_error 3.10e-07, steps 2" in shown
    assert "not promoted: +2.4%" in shown and "goodput 43.5 (spread 6.57)" in shown
    rejected = _ok("show", str(run), "2")
    assert "FAIL system_audit" in rejected and "12 never trained" in rejected
    assert "profile: none (this round ran no benchmark)" in _ok("show", str(run), "2", "--profile")  # was silent
    assert "Round 2: skip training of [/bold] long [red]episodes" in rejected  # a title crashed show
    assert _ok("show", str(run)) == _ok("show", str(run), "best")
    assert "Round 0 (best)" in _ok("show", str(run), "best")
    assert "parent: the run's start (" in _ok("show", str(run), "0")  # it printed "round None"
    assert "Round 2:" in _ok("show", str(run), "latest")
    for bad, said in (("7", "has no round 7"), ("-1", "not '-1'"), ("newest", "not 'newest'")):
        result = runner.invoke(app, ["show", str(run), "--", bad], env=NARROW)
        assert result.exit_code == 2 and said in result.output, result.output
    result = runner.invoke(app, ["show", str(tmp_path / "no\x1b[2Kthere")], env=NARROW)
    assert result.exit_code == 2 and "no\\x1b[2Kthere does not exist" in result.output  # an error quotes it escaped


def test_print_config_round_trips_through_config(tmp_path):
    printed = _ok("generate", "tiny-qwen3-cpu", "--seed", "4", "--rounds", "5", "--print-config")
    values = yaml.safe_load(printed)
    assert values["target"] == "tiny-qwen3-cpu" and values["seed"] == 4 and values["rounds"] == 5
    path = tmp_path / "run.yaml"
    path.write_text(printed)
    again = yaml.safe_load(_ok("generate", "--config", str(path), "--policy", "evolve", "--print-config"))
    assert again == {**values, "policy": "evolve"}  # the file's values, the flag on top
    path.write_text("rounds: 2\npolciy: evolve\n")
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--config", str(path)], env=NARROW)
    assert result.exit_code == 2 and "unknown option 'polciy' (did you mean 'policy'?)" in result.output
    path.write_text("rounds: [1, 2\n")  # the YAML error's own brackets were read as markup and lost
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--config", str(path)], env=NARROW)
    assert result.exit_code == 2 and "rounds: [1, 2" in result.output and "expected ','" in result.output
    path.write_text("policy: greedy\n")  # a value the run's own checks refuse was blamed on a flag never typed
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--config", str(path), "--print-config"], env=NARROW)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and f"--config {path}: policy greedy: unknown policy 'greedy'" in said, said
    path.write_text("starter_param: [partial_rollout=9]\n")  # the starter's params too, checked as the run starts
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--config", str(path), "--out", str(tmp_path / "r")])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and f"--config {path}: starter_param: partial_rollout = 9 is outside" in said, said
    assert not (tmp_path / "r").exists()
    path.write_text("rounds: 2\nseed: 1\nrounds: 5\n")  # the last one won, unsaid
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--config", str(path)], env=NARROW)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "found the key 'rounds' twice (first on line 1)" in said, said
    path.write_bytes(b"\xff\xfe\x00")  # not text: a UnicodeDecodeError traceback before
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--config", str(path)], env=NARROW)
    assert result.exit_code == 2 and "can't decode byte 0xff" in result.output, result.output
    # a bad value is named by the file and its key (it was named as a flag the user never typed), and a
    # missing file plainly (it was a raw "[Errno 2] ...")
    path.write_text("rounds: -2\n")
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--config", str(path)], env=NARROW)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and f"--config {path}: rounds: -2: Input should be greater" in said, said
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--config", str(tmp_path / "nosuch.yaml")], env=NARROW)
    assert result.exit_code == 2 and "cannot read it (No such file or directory)" in " ".join(result.output.split())
    # a file --config would refuse is not printed (it was, and refused only when it was used)
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--max-minutes", "0", "--print-config"], env=NARROW)
    assert result.exit_code == 2 and "--max-minutes 0.0: Input should be greater than 0" in result.output
    # nor one the run refuses at its start: a starter's unknown param, LLM options with the offline agents,
    # a cost cap on a model with no price (each was printed, and refused when the file was used)
    for args, said in (
        (["--starter-param", "foo=1"], "--starter-param: foo is no parameter"),
        (["--model", "gpt"], "--model given with the offline agents"),
        (["--agents", "openai", "--model", "gpt-x", "--max-cost", "5"], "no price known for model 'gpt-x'"),
    ):
        result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", *args, "--print-config"], env=NARROW)
        assert result.exit_code == 2 and said in " ".join(result.output.split()), (args, result.output)
    # but what only this machine lacks is the run's machine's business: a GPU target's file prints here
    from targets.spec import CATALOG_DIR

    gpu = yaml.safe_load((CATALOG_DIR / "qwen3-0.6b-h100x1.yaml").read_text()) | {"execution": "real"}
    (tmp_path / "gpu.yaml").write_text(yaml.safe_dump(gpu))
    printed = runner.invoke(app, ["generate", str(tmp_path / "gpu.yaml"), "--print-config"], env=NARROW)
    assert printed.exit_code == 0 and yaml.safe_load(printed.output)["rounds"] == 3, printed.output
    refused = runner.invoke(app, ["generate", str(tmp_path / "gpu.yaml"), "--out", str(tmp_path / "gpu-run")])
    assert refused.exit_code == 2 and "this machine has 0" in refused.output, refused.output


def test_print_config_of_a_run_reproduces_its_stored_configuration(tmp_path):
    run = make_review_run(tmp_path)
    values = yaml.safe_load(_ok("generate", "tiny-qwen3-cpu", "--out", str(run), "--resume", "--print-config"))
    assert values["repeat"] == 3 and values["sandbox"] == "subprocess" and values["out"] == str(run)


def test_the_live_view_names_the_run_start_and_a_twins_verdict_as_such(tiny_spec):
    """generate printed "(from round None)" for round 0 and "judge failed: twin_prescreen ..." for a candidate
    the twin screened out, which the judge never saw."""
    from agents.roles import Task
    from orchestrator.tables import RoundsView

    view = RoundsView(tiny_spec)
    view.event("round_start", round=0, task=Task(id="starter", title="starter", rationale="r"), parent=None)
    assert view.status == "round 0: starter (from the run's start)"
    reasons = ["twin_prescreen: predicted goodput 56.3 against the best's 60.2 (-6.5%)"]
    view.event("verdict", round=2, attempt=1, passed=False, reasons=reasons)
    # and "twin failed", which read as the twin's own failure: the twin ran and screened it out
    assert view.status.startswith("round 2 attempt 1: screened out by the twin, not judged: twin_prescreen")
    # a prediction not trusted says why (it said 'a cost it has only guessed' whatever the reason was)
    from orchestrator.state import Prediction

    why = "fitted to what the harness timed alone ... within the margin"
    untrusted = Prediction(metric="goodput", headline=57.5, best=60.6, margin=0.05, passed=True, untrusted=why)
    view.event("prescreen", round=2, prediction=untrusted)
    assert view.status.endswith(f"not trusted, goes on to the judge ({why})"), view.status
    # each finished round says how long it took (a run of rounds of minutes each showed no time at all)
    from orchestrator.state import RoundRecord

    done = RoundRecord(
        round=2,
        task=Task(id="t", title="t", rationale="r"),
        parent_round=0,
        parent_commit="c",
        verdict="rejected",
        seconds=252.4,
    )
    view.event("round_end", record=done, best=None)
    assert view.rows[-1][-1] == "4 min 12 s" and view.line("round_end").endswith("4 min 12 s")


def test_every_command_and_group_shows_an_example_in_its_help():
    """The README says every command takes ``-h`` with an example: each command and group, walked from
    the CLI itself (a new one is held to it without being listed here)."""
    import typer.main

    def paths(command, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:  # typer's own click: a group has commands
        found = [prefix] if prefix else []
        for name, sub in getattr(command, "commands", {}).items():
            found += paths(sub, (*prefix, name))
        return found

    commands = paths(typer.main.get_command(app), ())
    assert {("generate",), ("target", "show"), ("workload",)} <= set(commands)
    missing = [" ".join(c) for c in commands if "Example:" not in _ok(*c, "-h", env={"COLUMNS": "200"})]
    assert not missing, f"no example in the help of: {missing}"


def test_short_help_and_version():
    assert "show [OPTIONS] {RUN} [ROUND]" in _ok("show", "-h") and "Example:" in _ok("show", "-h")
    assert _ok("--version").startswith("vibetrain 0.")
    # the command list joins a docstring's source lines (it broke calibrate's at "and print", whatever the width)
    listed = _ok("--help", env={"COLUMNS": "200"})
    assert "print the prediction error; the calibrated spec is written for" in listed, listed


def test_provenance_names_the_code_the_machine_and_the_exact_spec():
    from orchestrator.provenance import provenance, spec_hash
    from targets.spec import load_target

    spec = load_target("tiny-qwen3-cpu")
    source = provenance(spec, simulated=False, sandbox="bubblewrap")
    assert source["spec_sha256"] == spec_hash(load_target("tiny-qwen3-cpu"))  # stable across loads
    changed = spec.model_copy(update={"noise_threshold": spec.noise_threshold * 2})
    assert spec_hash(changed) != source["spec_sha256"]
    assert source["versions"]["torch"].startswith("2.") and source["sandbox"] == "bubblewrap"
    assert len(source["commit"].removesuffix("+dirty")) == 40 or source["commit"].startswith("unknown")


def test_report_out_a_directory_or_a_missing_folder_and_bench_outputs_checked_first(tmp_path):
    """``report --out DIR`` and ``--out missing/x.html`` ended in tracebacks; ``bench --json dir/x.json``
    with a missing folder failed only after every run, and ``--json DIR`` with a traceback; an output no
    file or folder can be made at (``/proc/...``) did too, after the work (``workload profile``, ``check``)."""
    run = make_review_run(tmp_path)
    (tmp_path / "reports").mkdir()
    _ok("report", str(run), "--out", str(tmp_path / "reports"))
    assert (tmp_path / "reports" / "run-report.html").stat().st_size > 10_000
    _ok("report", str(run), "--out", str(tmp_path / "new" / "folder" / "r.html"))
    assert (tmp_path / "new" / "folder" / "r.html").exists()
    _ok("report", str(run), "--out", f"{tmp_path / 'fresh'}/")  # a folder yet to make: the docstring's example
    assert (tmp_path / "fresh" / "run-report.html").is_file()
    for option in ("--json", "--timeline"):
        result = runner.invoke(app, ["bench", "tiny-qwen3-cpu", option, str(tmp_path / "reports")], env=NARROW)
        assert result.exit_code == 2 and "a directory is there; give a file path" in result.output, result.output
    # a plot's name matplotlib cannot write failed after the whole bench, with a traceback
    for option in ("--timeline", "--phases"):
        result = runner.invoke(app, ["bench", "tiny-qwen3-cpu", option, str(tmp_path / "t.txt")], env=NARROW)
        assert result.exit_code == 2 and "no image format matplotlib writes" in result.output, result.output
    # report --out replaced a shell script with the report
    (tmp_path / "env.sh").write_text("export X=1\n")
    script = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "env.sh")], env=NARROW)
    assert script.exit_code == 2 and "is there and is no report" in script.output, script.output
    assert (tmp_path / "env.sh").read_text() == "export X=1\n"
    nothing = runner.invoke(app, ["bench", "tiny-qwen3-cpu", "--baselines", " , "], env=NARROW)
    assert nothing.exit_code == 2 and "names no baseline" in nothing.output, nothing.output  # not "every one"
    check = runner.invoke(app, ["check", "tiny-qwen3-cpu", "--json", str(tmp_path / "reports")], env=NARROW)
    assert check.exit_code == 2 and "a directory is there" in check.output, check.output
    (tmp_path / "a-file").write_text("")  # a folder that is a file: a FileExistsError traceback before
    under_file = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "a-file" / "r.html")], env=NARROW)
    assert under_file.exit_code == 2 and "a-file is a file, not a folder" in under_file.output, under_file.output
    # a folder that refuses files: ``workload profile --out /proc/x`` ran its whole real run, then a traceback
    profile = runner.invoke(app, ["workload", "profile", "tiny-qwen3-cpu", "--out", "/proc/x.yaml"], env=NARROW)
    assert profile.exit_code == 2 and "/proc/x.yaml: cannot be written" in profile.output, profile.output
    for args in (  # folders to make where none can be: tracebacks (check's after its whole run)
        ["check", "tiny-qwen3-cpu", "--out", "/proc/check-out"],
        ["starter", "tiny-qwen3-cpu", "--out", "/proc/starter-out"],
        ["generate", "tiny-qwen3-cpu", "--rounds", "0", "--out", "/proc/run"],
        ["check", "tiny-qwen3-cpu", "--out", str(tmp_path / "a-file" / "out")],
        ["generate", "tiny-qwen3-cpu", "--rounds", "0", "--out", str(tmp_path / "new-run"), "--workspaces", "/proc/w"],
    ):
        result = runner.invoke(app, args, env=NARROW)
        assert result.exit_code == 2 and "error: --" in result.output, (args, result.output)
        assert "nothing can be made" in result.output or "is a file" in result.output, (args, result.output)
    assert not (tmp_path / "new-run").exists()  # a run refused at its options leaves no half-made repository
    # printing a run's configuration writes nothing: it works where nothing could be
    printed = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--out", "/proc/run", "--print-config"], env=NARROW)
    assert printed.exit_code == 0 and yaml.safe_load(printed.output)["out"] == "/proc/run", printed.output
    link = tmp_path / "link.json"  # a link to a file not there yet: the probe leaves the link and makes nothing
    link.symlink_to(tmp_path / "later.json")
    refused = runner.invoke(app, ["bench", "tiny-qwen3-cpu", "--json", str(link), "--baselines", "x"])
    assert refused.exit_code == 2 and link.is_symlink() and not (tmp_path / "later.json").exists(), refused.output
    (tmp_path / "kept.json").write_text("{}")  # a file that is there already keeps its bytes until the end
    refused = runner.invoke(app, ["bench", "tiny-qwen3-cpu", "--json", str(tmp_path / "kept.json"), "--baselines", "x"])
    assert refused.exit_code == 2 and (tmp_path / "kept.json").read_text() == "{}", refused.output
    stack = tmp_path / "candidate"
    _ok("starter", "tiny-qwen3-cpu", "--out", str(stack))
    for args, said in (  # calibrate checks its paths before the run, not after it
        (["--out", str(tmp_path / "a-file" / "twin.yaml")], "a-file is a file, not a folder"),
        (["--trace", str(tmp_path / "missing.jsonl")], "--trace"),
        (["--out", "/proc/vibetrain-twin.yaml"], "cannot be written"),  # a folder no file can be made in
    ):
        result = runner.invoke(app, ["calibrate", "tiny-qwen3-cpu", "--stack", str(stack), *args], env=NARROW)
        assert result.exit_code == 2 and said in result.output, result.output
    twice = runner.invoke(
        app, ["bench", "tiny-qwen3-cpu", "--baselines", "colocate", "--stack", str(stack), "--stack", str(stack)]
    )
    assert twice.exit_code == 2 and "two runs share a name" in twice.output, twice.output  # said before any run
    for target, baselines, said in (  # a traceback (the starter's folder written twice); a list without the labels
        ("tiny-qwen3-cpu", "colocate,colocate", "--baselines names colocate more than once"),
        ("qwen3-8b-h20x8-h800x8", "h800only", "h800only: no such baseline (known here: colocate, static_split"),
    ):
        result = runner.invoke(app, ["bench", target, "--baselines", baselines], env=NARROW)
        assert result.exit_code == 2 and said in result.output, result.output
    assert "h800-only" in result.output  # the target's labelled baselines are names too


def test_a_check_that_ran_nothing_points_at_no_log_folder(tmp_path, tiny_spec):
    """A candidate the integrity scan refuses never runs: check printed (and kept) an empty log folder."""
    from skills.starter import write_starter

    stack = write_starter(tmp_path / "s", tiny_spec, "colocate")
    (stack / "stack" / "broken.py").write_text("def f(:\n")
    args = ["check", "tiny-qwen3-cpu", "--stack", str(stack), "--simulate", "--sandbox", "subprocess"]
    result = runner.invoke(app, args, env=NARROW)
    assert result.exit_code == 1 and "syntax error" in result.output, result.output
    assert "logs and trace" not in result.output


def test_a_corrupt_run_state_is_named_with_advice_that_works(tmp_path):
    """The advice was 'vibetrain log reads them', which failed with the same error."""
    import subprocess

    from orchestrator.run_dir import RunDir

    run = make_review_run(tmp_path)
    RunDir(run).state_file.write_text('{"rounds": [')
    result = runner.invoke(app, ["log", str(run)], env=NARROW)
    assert result.exit_code == 2 and "is corrupt (" in result.output, result.output
    advice = f"git -C {run} log --all"
    assert advice in " ".join(result.output.split())
    listed = subprocess.run(advice.split(), capture_output=True, text=True, check=True).stdout
    assert "skip training of" in listed  # the rejected round's candidate is there too


def test_a_damaged_state_names_its_field_and_a_commit_git_lacks_is_named(tmp_path):
    """The corrupt state's message kept pydantic's header alone ('1 validation error for RunState'): the
    field and its value were lost. A state that is a folder, and a round whose commit the repository
    lacks, were tracebacks."""
    import shutil

    from orchestrator.run_dir import RunDir

    run = make_review_run(tmp_path)
    state = RunDir(run).state_file
    kept = json.loads(state.read_text())
    for damage, said in (
        ({"best_round": "zero"}, "best_round: Input should be a valid integer, unable to parse string as an integer"),
        ({"from_a_later_version": 1}, "from_a_later_version: Extra inputs are not permitted; a newer vibetrain"),
    ):
        state.write_text(json.dumps({**kept, **damage}))
        result = runner.invoke(app, ["log", str(run)], env=NARROW)
        assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output
    unknown = [{**kept["rounds"][0], "verdict": "maybe"}, *kept["rounds"][1:]]  # report raised on it; log showed it
    state.write_text(json.dumps({**kept, "rounds": unknown}))
    result = runner.invoke(app, ["log", str(run)], env=NARROW)
    said = "rounds.0.verdict: Input should be 'accepted', 'rejected', 'prescreened' or 'error'"
    assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output
    for commit in ("deadbeef" * 5, "0" * 40):  # gitpython takes the all-zero id and fails later, unnamed
        rounds = [{**kept["rounds"][0], "commit": commit}, *kept["rounds"][1:]]
        state.write_text(json.dumps({**kept, "rounds": rounds}))
        for command in (["show", str(run), str(rounds[0]["round"])], ["report", str(run)]):
            result = runner.invoke(app, command, env=NARROW)
            assert result.exit_code == 2 and f"commit {commit[:10]} is not in" in result.output, result.output
            assert "Traceback" not in result.output
    state.unlink()
    state.mkdir()
    result = runner.invoke(app, ["log", str(run)], env=NARROW)
    assert result.exit_code == 2 and "run_state.json cannot be read (Is a directory)" in result.output
    shutil.rmtree(state)


def test_a_run_named_as_a_candidate_says_how_the_review_commands_name_it(tmp_path):
    """check, bench and export take RUN@best; log, show and report said 'no run state (RUN@best/.git/...)'."""
    run = make_review_run(tmp_path)
    for command, said in (
        (["log", f"{run}@best"], f"log takes the run's folder, not a candidate: vibetrain log {run}"),
        (["show", f"{run}@round-1"], f"show names the round after the run's folder: vibetrain show {run} round-1"),
        (["report", f"{run}@latest"], f"report takes the run's folder, not a candidate: vibetrain report {run}"),
    ):
        result = runner.invoke(app, command, env={"COLUMNS": "300"})
        assert result.exit_code == 2 and said in result.output, result.output


def test_the_version_of_a_checkout_git_will_not_read_is_said_not_raised(tmp_path, monkeypatch):
    import subprocess

    from orchestrator import provenance

    real = subprocess.run

    def refusing(command, **kwargs):
        if "rev-parse" in command:
            return subprocess.CompletedProcess(command, 128, "", "fatal: detected dubious ownership in repository\n")
        return real(command, **kwargs)

    monkeypatch.setattr(provenance.subprocess, "run", refusing)
    assert provenance.source_commit().startswith("unknown: git rev-parse failed in ")
    assert "dubious ownership" in provenance.source_commit()

    def status_fails(command, **kwargs):  # an index git cannot read: whether edits are there is unknown
        if "status" in command:
            return subprocess.CompletedProcess(command, 128, "", "fatal: index file corrupt\n")
        return real(command, **kwargs)

    monkeypatch.setattr(provenance.subprocess, "run", status_fails)
    said = provenance.source_commit()
    assert said.endswith("+unknown (git status failed: fatal: index file corrupt)") and "dirty" not in said, said


def test_the_check_table_prints_a_candidate_s_error_text_as_written():
    """A reason is a candidate's exception text: '[/bold]' in it crashed the table (rich markup)."""
    from rich.console import Console

    from orchestrator.tables import checks_table
    from targets.harness.judge.check_result import CheckResult

    console = Console(record=True, width=120)
    console.print(checks_table([CheckResult("system_run", False, ["RuntimeError: bad [/bold] thing [red]x"], {})]))
    assert "RuntimeError: bad [/bold] thing [red]x" in console.export_text()


def test_a_finished_run_resumed_as_it_was_says_how_to_go_on(tmp_path):
    """It printed an empty table and its best: nothing said that its rounds were all done, or how to
    run more."""
    run = make_review_run(tmp_path)
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--out", str(run), "--resume"], env=NARROW)
    assert result.exit_code == 0, result.output
    assert "its 2 round(s) were done: --resume --rounds 3 goes on" in result.output
    assert "round\ttask" not in result.output  # no table of the rounds this invocation ran: it ran none
    # resumed with fewer rounds than it had done: the count is what was done, not what was asked
    result = runner.invoke(
        app, ["generate", "tiny-qwen3-cpu", "--out", str(run), "--resume", "--rounds", "1"], env=NARROW
    )
    assert "its 2 round(s) were done: --resume --rounds 3 goes on" in result.output, result.output


def test_log_shows_no_figures_measured_on_an_earlier_best(tmp_path):
    """generate and report show generalization figures only if they were measured on the current best;
    log showed whatever the state held, so a run that found a new best (and stopped before measuring
    it) read 'best (round 1)' under a best of round 0."""
    from orchestrator.state import Generalization, GeneralizationRejected, Promotion

    run = make_review_run(tmp_path)
    state = RunState.load(run)
    figure = Promotion(ratio=1.4, low=1.2, high=1.6, pairs=3)
    earlier = state.record(1)  # validated, not the best
    state.generalization = Generalization(
        best_round=1, best_commit=earlier.commit, in_search=figure, held_out=figure, held_out_seeds=[7, 8, 9]
    )
    state.save(run)
    state.generalization_rejected = GeneralizationRejected(
        best_round=1,
        best_commit=earlier.commit,
        held_out_seeds=[7],
        figure="held-out",
        run="the best",
        seed=7,
        reasons=["planted"],
    )
    state.save(run)
    assert "held-out seeds" not in _ok("log", str(run), env={"COLUMNS": "200"})
    logged = json.loads(_ok("log", str(run), "--json"))
    assert logged["generalization"] is None and logged["generalization_rejected"] is None
    state.generalization = state.generalization.model_copy(update={"best_round": 0, "best_commit": state.best.commit})
    state.save(run)
    assert "held-out seeds" in _ok("log", str(run), env={"COLUMNS": "200"})


def test_a_resume_on_a_target_spec_edited_since_the_start_is_refused_naming_what_changed(tmp_path):
    """The state kept only the spec's path: a resume read whatever the file held then, and paired its
    new rounds (another workload, another noise threshold) with records measured under the old one,
    unsaid. The spec the run started on is kept; a value that changed refuses the resume, named."""
    from orchestrator.runs import RunSetupError, resume_run
    from targets.spec import load_target

    run = make_review_run(tmp_path)
    state = RunState.load(run)
    started = load_target("tiny-qwen3-cpu").model_dump(mode="json")
    started["noise_threshold"] = 0.5
    started["workload"]["batch_size"] = 999
    started["a_field_of_another_version"] = 1  # schema drift across vibetrain versions is no change of the user's
    started["baselines"][0]["a_field_of_another_version"] = 1  # in a list's item too
    state.spec_at_start = started
    state.save(run)
    with pytest.raises(RunSetupError) as refused:
        resume_run(run, {}, lambda *a, **k: None, workspaces=tmp_path / "ws")
    said = str(refused.value)
    assert "its target spec (tiny-qwen3-cpu) changed since the run started: noise_threshold: 0.5 -> " in said
    assert "workload.batch_size: 999 -> " in said and "a_field_of_another_version" not in said
    assert "baselines" not in said


def test_a_resume_takes_a_file_of_defaults_and_refuses_to_change_how_the_run_runs(tmp_path):
    """A plain --print-config file (its unset options None, prescreen true) refused a resume with
    '--repeat None (this run's: 3)', and on a simulated run 'prescreen cannot be turned back on'; a
    --simulate given to the resume of a real run was dropped without a word and the run went on real."""
    from orchestrator.config import ConfigError

    run = make_review_run(tmp_path)
    config = RunState.load(run).config
    defaults = yaml.safe_load(_ok("generate", "tiny-qwen3-cpu", "--print-config"))
    unset = {k: v for k, v in defaults.items() if v is None and k in RunConfig.model_fields}
    assert "repeat" in unset and config.resumed(unset).repeat == 3  # left unset: the run's own stands
    limited = config.model_copy(update={"max_minutes": 30.0, "held_out": 2})
    assert (limited.resumed(unset).max_minutes, limited.resumed(unset).held_out) == (30.0, 2)  # not cleared
    simulated = config.model_copy(update={"simulated": True, "prescreen": False})
    assert simulated.resumed({"prescreen": True}).prescreen is False
    with pytest.raises(ConfigError, match="--repeat 5 \\(this run's: 3\\)"):
        config.resumed({"repeat": 5})  # a value given is still held to the run's
    result = runner.invoke(app, ["generate", "tiny-qwen3-cpu", "--out", str(run), "--resume", "--simulate"], env=NARROW)
    assert result.exit_code == 2 and "was started for real, and a resumed run goes on as it started" in result.output


def test_a_commands_scratch_folders_go_at_exit_unless_it_kept_one_to_show(tmp_path):
    """bench, check and RUN@ references left their folders in /tmp, unnamed (a paper-scale bench some
    100 MB a schedule): they go when the process exits; a run's logs a command points to stay."""
    import subprocess
    import sys

    script = (
        "from orchestrator.scratch import keep, scratch_folder\n"
        "used = scratch_folder('vibetrain-test-')\n"
        "(used / 'trace.jsonl').write_text('{}')\n"
        "print(used, keep(scratch_folder('vibetrain-test-')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    used, kept = (Path(p) for p in done.stdout.split())
    assert not used.exists() and kept.is_dir()
    kept.rmdir()


def test_scratch_folders_go_where_vibetrain_scratch_says_and_a_wrong_value_is_named(tmp_path, monkeypatch):
    """The folders a command keeps for a person (a failed check's logs, a calibration's spec) went to the
    system's temporary directory only: each suite run left four in /tmp, and a paper-scale bench's traces
    (some 100 MB a schedule) could not be sent elsewhere without moving every temporary file (the
    harness's sockets too). ``$VIBETRAIN_SCRATCH`` names their place; a value that is no folder is said."""
    from orchestrator.scratch import scratch_folder
    from skills.starter import write_starter
    from targets.spec import load_target

    monkeypatch.setenv("VIBETRAIN_SCRATCH", str(tmp_path))
    assert scratch_folder("vibetrain-test-").parent == tmp_path
    missing = tmp_path / "no-such-folder"
    stack = write_starter(tmp_path / "stack", load_target("tiny-qwen3-cpu"), "colocate")
    trace = tmp_path / "trace.jsonl"
    trace.write_text("{}\n")
    argv = ["calibrate", "tiny-qwen3-cpu", "--stack", str(stack), "--trace", str(trace)]
    result = runner.invoke(app, argv, env={**NARROW, "VIBETRAIN_SCRATCH": str(missing)})
    assert result.exit_code == 2, result.output
    assert f"$VIBETRAIN_SCRATCH is '{missing}', no folder: make the folder" in " ".join(result.output.split())
    assert not missing.exists() and "Traceback" not in result.output
    monkeypatch.chdir(tmp_path)  # a relative value: the folder's path is whole, whatever the directory at exit
    monkeypatch.setenv("VIBETRAIN_SCRATCH", "relative")
    (tmp_path / "relative").mkdir()
    assert scratch_folder("vibetrain-test-").parent == tmp_path / "relative"
    monkeypatch.setenv("VIBETRAIN_SCRATCH", str(trace))
    result = runner.invoke(app, argv, env=NARROW)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and f"$VIBETRAIN_SCRATCH is '{trace}', a file: make the folder" in said, said


def test_report_of_the_run_it_stands_in_is_written_beside_the_run_never_inside(tmp_path, monkeypatch):
    """``vibetrain report .`` from inside a run wrote into the run's worktree, an untracked file that
    then made ``--resume`` refuse the run."""
    run = make_review_run(tmp_path)
    monkeypatch.chdir(run)
    _ok("report", ".")
    assert (tmp_path / f"{run.name}-report.html").is_file()
    inside = runner.invoke(app, ["report", ".", "--out", "r.html"], env=NARROW)
    assert inside.exit_code == 2 and "--out r.html: inside the run" in inside.output, inside.output
    assert not (run / "r.html").exists() and not (run / f"{run.name}-report.html").exists()
    # every command's output, not report's alone: check --json over a candidate's file in the run's worktree
    before = (run / "DESIGN.md").read_bytes()
    check = runner.invoke(app, ["check", "tiny-qwen3-cpu", "--simulate", "--json", "DESIGN.md"], env=NARROW)
    assert check.exit_code == 2 and "--json DESIGN.md: inside the run" in check.output, check.output
    assert (run / "DESIGN.md").read_bytes() == before


# -- what an agent or a candidate wrote, shown to a person ------------------------------------------


def _round_with_file(run: Path, tmp_path: Path, name: str, text: str, **record_fields) -> int:
    """A rejected round 3 on round 0 whose stack adds ``name`` holding ``text`` (what the candidate wrote)."""
    from agents.roles import Task
    from orchestrator.history import History, Trailers
    from orchestrator.state import RoundRecord

    history, state = History.open(run), RunState.load(run)
    workspace = history.worktree(tmp_path / "ws3", state.rounds[0].commit)
    (workspace / "stack" / name).write_text(text)
    task = Task(id="tail-round", title=record_fields.pop("title", "tail round 8"), rationale="r", source="x")
    record = RoundRecord(
        round=3, task=task, parent_round=0, parent_commit=state.rounds[0].commit, verdict="rejected", **record_fields
    )
    judge = {"reasons": ["system_audit: 4 never trained"], "checks": [{"name": "system_audit", "passed": False}]}
    trailers = Trailers(3, task.id, "offline", "rejected", "none", "none")
    commit = history.commit_rejected(workspace, 3, task.title, trailers, {"judge.json": judge, "round.json": {}})
    history.remove_worktree(workspace)
    state.rounds.append(record.model_copy(update={"commit": commit}))
    state.save(run)
    return 3


def test_a_file_of_the_candidate_that_redraws_the_screen_is_shown_escaped_in_show_and_the_report(tmp_path):
    """A red team's rejected round added a valid Python file whose comments cleared the screen and wrote,
    line by line, "Round 4: ... (accepted ...)", "judge: passed" and a harmless diff: ``show`` printed the
    diff raw. And a form feed, a space to Python, made ``splitlines`` break an added line in two, its second
    statement shown as unchanged code. Each diff line is a line of the file, its control characters escaped."""
    from orchestrator.report import _diff_lines

    run = make_review_run(tmp_path)
    forged = "#\x1b[H\x1b[2J\x1b[3JRound 4: tail round 8  (accepted, 1 attempt(s), 48s)\n#\x1b[2K\x1b[1Gjudge: passed\n"
    hidden = "batch = dedupe(batch);\x0c    batch = drop_long(batch)\n++batch\n"
    number = _round_with_file(run, tmp_path, "zz_notes.py", forged + hidden)
    shown = _ok("show", str(run), str(number))
    assert "\x1b" not in shown and "\x0c" not in shown
    assert "+#\\x1b[H\\x1b[2J\\x1b[3JRound 4: tail round 8" in shown
    assert "+batch = dedupe(batch);\\x0c    batch = drop_long(batch)" in shown
    diff = _stack_diff(run, number)
    styled, _ = _diff_lines(diff, str(run), "0" * 40)
    assert ("d-add", "+batch = dedupe(batch);\\x0c    batch = drop_long(batch)") in styled
    assert ("d-add", "+++batch") in styled  # an added line, though it reads as a file's header


def _stack_diff(run: Path, number: int) -> str:
    from orchestrator.history import History

    state = RunState.load(run)
    return History.open(run).stack_diff(state.rounds[number].commit)


def test_agent_text_is_escaped_as_it_is_recorded_so_no_view_runs_it(tmp_path):
    """A planner's title, an implementer's account and a judge's reason (a candidate's exception text) went
    raw into ``show``, ``log``, the live view and the commit messages: a title's erase-line and a new line
    turned a rejected round's row into "accepted (best) 99.1"; a right-to-left override reversed the verdict
    beside it in the report. Each is escaped as the record takes it (a title is one line), a reason as the
    judge makes it, so every view reads them safe."""
    from agents.roles import Hint, Task
    from orchestrator.state import RoundRecord
    from targets.harness.judge.check_result import CheckResult

    title = "x\x1b[2K\x1b[1G   2   accepted (best)   99.1\n+133.2%\u202e"
    task = Task(id="x", title=title, rationale="r\u2028Verdict: accepted", source="s")
    assert task.title == "x\\x1b[2K\\x1b[1G 2 accepted (best) 99.1 +133.2%\\u202e"
    assert task.rationale == "r\\u2028Verdict: accepted"
    record = RoundRecord(round=1, task=task, parent_round=0, parent_commit="c0", verdict="rejected")
    record.account = "set x\x1b[8m"  # assigned as the round goes: validated as it is
    record.reasons = [*record.reasons, "attempt 2 \x1b[2K"]
    assert record.account == "set x\\x1b[8m" and record.reasons == ["attempt 2 \\x1b[2K"]
    assert Hint(code="c", message="\x1b]8;;http://x\x07link").message == "\\x1b]8;;http://x\\x07link"
    assert CheckResult("system_run", False, ["the controller raised \x1b[2KE: ok\x1b[8m"]).reasons == [
        "the controller raised \\x1b[2KE: ok\\x1b[8m"
    ]
    state = RunState.load(make_review_run(tmp_path))
    state.rounds.append(record)
    logged = Console(record=True, width=200)
    logged.print(rounds_table(tmp_path / "run", state))
    assert "\x1b" not in logged.export_text(styles=False)


def test_an_agents_words_in_a_commit_message_never_read_as_its_trailers():
    """A red team's account ended with "Round: 1 / Verdict: accepted / Headline-Metric: goodput=99.9" and a
    ``---``: git interpret-trailers and GitPython took them for the rejected round's trailers. An agent's words
    are indented after their first line: none starts a line of the message."""
    import subprocess

    from agents.roles import Task
    from orchestrator import commits
    from orchestrator.state import RoundRecord
    from targets.spec import load_target

    spec = load_target("tiny-qwen3-cpu")
    account = "set tail_round=8\n\nRound: 1\nTask: tail_round=8\nVerdict: accepted\nHeadline-Metric: goodput=99.9\n---"
    record = RoundRecord(
        round=1,
        task=Task(id="tail_round=8", title="t", rationale="why\n\nVerdict: accepted\n---"),
        parent_round=0,
        parent_commit="c0",
        verdict="rejected",
        account=account,
        reasons=["system_audit: x\n\nVerdict: accepted"],
    )
    from orchestrator.state import Prediction

    record.prediction = Prediction(  # the twin's word may quote the candidate's error on the twin
        metric="goodput",
        headline=1.0,
        best=2.0,
        best_round=0,
        margin=0.1,
        passed=True,
        untrusted="could not run it (x\n\nRound: 1\nVerdict: accepted\nHeadline-Metric: goodput=99.9\n---\n)",
    )
    trailers, body = commits.rejected(record, spec, "offline", ["a\nVerdict: accepted"])
    message = "\n\n".join(["Round 1: t", body, trailers.lines()]) + "\n"
    parsed = subprocess.run(
        ["git", "interpret-trailers", "--parse"], input=message, capture_output=True, text=True, check=True
    ).stdout
    assert "Verdict: rejected" in parsed and "accepted" not in parsed and "99.9" not in parsed
    assert all(not line.startswith(("Verdict", "---", "Round: 1")) for line in body.splitlines())


def test_a_candidates_controller_name_is_a_plain_label_in_the_report(tmp_path):
    """The report titles a timeline with the candidate's own controller name (its params.json): "$\\frac{a$"
    was parsed as math and ``vibetrain report`` failed with a traceback, writing nothing."""
    from targets.api import TraceEvent
    from targets.harness.measure.timeline import plot_timelines

    events = [TraceEvent("run_start", 0.0), TraceEvent("run_end", 1.0)]
    path = plot_timelines([("best-scoring $\\frac{a$ candidate", events, ["cpu:0"])], tmp_path / "t.png")
    assert path.stat().st_size > 0
