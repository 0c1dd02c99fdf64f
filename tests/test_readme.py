"""The README's two commands are what a newcomer pastes; CI must run the test command as written."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CI = ROOT / ".ci" / "run"


def _readme_commands_module():
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_runs_the_readmes_test_command_and_no_other_pytest():
    commands = _readme_commands_module().readme_commands()
    printed = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "readme_commands.py"), "test"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert printed == commands["test"]
    assert commands["test"].startswith('pip install "torch==2.13.0" -e ".[dev]"')
    script = CI.read_text()
    assert 'test_command="$(python3 .ci/readme_commands.py test)"' in script
    assert 'bash -c "set -e; $test_command"' in script
    code = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    runs = re.compile(r"(^\s*|[;&|(]\s*|-m\s+)(pytest|ruff)\b")  # pytest or ruff in a command's place
    assert not [line for line in code if runs.search(line)], ".ci/run runs pytest or ruff besides the README's command"


def test_the_main_command_runs_generate_on_the_default_target():
    main = _readme_commands_module().readme_commands()["main"]
    assert main.startswith('pip install "torch==2.13.0" -e .')
    assert "vibetrain generate tiny-qwen3-cpu" in main


@pytest.mark.parametrize(
    "block, error",
    [
        ("no block here\n", "no ```bash block"),
        ("```bash\npip install x && pytest   # one\n```\n", "exactly 2 commands"),
        ("```bash\npip install x   # main\npip install y && pytest   # tests\n```\n", "vibetrain generate"),
        ("```bash\nvibetrain generate t   # main\npytest && ruff check .   # tests\n```\n", "end by running `pytest`"),
    ],
)
def test_a_readme_without_the_two_commands_is_an_error_naming_what_is_wrong(tmp_path, block, error):
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\n" + block)
    with pytest.raises(ValueError, match=re.escape(error)):
        _readme_commands_module().readme_commands(readme)


def test_the_results_file_is_what_its_entries_build_and_a_broken_entry_is_named(tmp_path, monkeypatch):
    """benchmarks/RESULTS.md is built from benchmarks/results/*.yaml: an entry edited without rebuilding it
    shows here; an entry that is not YAML (a command with ': ' left unquoted) is named (the script prints it)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import results

    assert results.render() == results.RESULTS.read_text(), "run: python benchmarks/results.py"
    (tmp_path / "bad.yaml").write_text("title: t\nsection: cpu\ncommand: vibetrain bench --params a: b\n")
    monkeypatch.setattr(results, "ENTRIES", tmp_path)
    with pytest.raises(ValueError, match=r"bad\.yaml: not valid YAML"):
        results.render()
    good = "title: t\nsection: cpu\ncommand: c\nmachine: m\ndate: 2026-12-02\ntable: '| a |'\n"
    for entry, named in (  # a typo dropped the figures; an unquoted all-digit commit printed as another number
        ("commit: abc1234\ntabel: '| x |'\n", "tabel: Extra inputs are not permitted"),
        ("commit: 0123456\n", "commit: Input should be a valid string (got 42798)"),
        ("commit: abc1234\nsection: gpus\n", "section: Input should be 'judge', 'cpu'"),
    ):
        (tmp_path / "bad.yaml").write_text(
            good.replace("section: cpu\n", "") + entry if "section" in entry else good + entry
        )
        with pytest.raises(ValueError, match=re.escape(named)):
            results.render()
