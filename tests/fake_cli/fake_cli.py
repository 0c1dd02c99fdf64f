"""A stand-in for the `claude` and `codex` CLIs in tests: it records what it received (argv, stdin,
environment, working directory) as one JSON line in a record file, acts out a scenario, and prints a
recorded output stream of this folder. Tests install it on PATH with ``install`` (a wrapper script per
CLI name with the scenario baked in: the CLI's environment is allowlisted, so a test cannot steer it
through variables).

Scenarios: ``success`` (implement: edit stack/params.json; review: accept), ``reject`` (review: reject),
``max_turns`` (claude stops at its turn limit), ``too_long`` (claude's review: the prompt is past its
window), ``failed`` (codex's turn fails, exit 1),
``bad_annotation`` (implement: leave an annotation that cannot be expanded), ``hang`` (start a sleeping
grandchild, record the token on its command line, sleep; on SIGTERM leave ``<record>.terminated``),
``daemon`` (start a grandchild that leaves the process group with setsid and keeps stdout open, record
its token, then succeed at once), ``refresh_login`` and ``other_login`` (codex: succeed, after
rewriting the login in its CODEX_HOME with a new token of the same account, or with another account).
The record lists the files of CODEX_HOME when it is set. A token, not a pid, names the grandchild: it
is found in /proc by its command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).parent


def install(bin_dir: Path, name: str, scenario: str, record: Path) -> Path:
    """A `name` executable in ``bin_dir`` that runs this fake with ``scenario``, recording to ``record``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / name
    script.write_text(
        f"#!{sys.executable}\nimport sys\nsys.dont_write_bytecode = True  # no __pycache__ in the source tree\n"
        f"sys.path.insert(0, {str(HERE)!r})\nfrom fake_cli import main\n"
        f"main({name!r}, {scenario!r}, {str(record)!r})\n"
    )
    script.chmod(0o755)
    return bin_dir


def _review_mode(name: str, argv: list[str]) -> bool:
    """The read-only call of the LLM review (as agents/cli_agent.py starts it)."""
    if name == "codex":
        return "read-only" in argv
    allowed = argv[argv.index("--allowedTools") + 1] if "--allowedTools" in argv else ""
    return "Edit" not in allowed


def _edit_params() -> None:
    params = Path("stack/params.json")
    data = json.loads(params.read_text())
    data.update(controller="static_split", rollout_devices=1, train_devices=1)
    params.write_text(json.dumps(data, indent=2))


def main(name: str, scenario: str, record: str) -> None:
    argv = sys.argv[1:]
    entry = {"name": name, "argv": argv, "stdin": sys.stdin.read(), "env": dict(os.environ), "cwd": os.getcwd()}
    entry.update(pid=os.getpid(), proc_self=int(os.readlink("/proc/self")))  # differ in a PID namespace
    home = os.environ.get("CODEX_HOME")
    if home:
        entry["codex_home"] = {p.name: p.read_text() for p in sorted(Path(home).iterdir())}
        if scenario in ("refresh_login", "other_login"):
            login = json.loads((Path(home) / "auth.json").read_text())
            login["tokens"]["refresh_token"] = "rotated"
            if scenario == "other_login":
                login["tokens"]["account_id"] = "someone-else"
            (Path(home) / "auth.json").write_text(json.dumps(login))
            scenario = "success"
    review = _review_mode(name, argv)
    if scenario == "hang":  # first: a SIGTERM that comes early still finds the handler
        signal.signal(signal.SIGTERM, lambda *_: (Path(record).with_suffix(".terminated").touch(), sys.exit(0)))
    if scenario in ("hang", "daemon"):
        token = f"fake-cli-grandchild-{uuid.uuid4().hex}"
        sleeper = [sys.executable, "-c", "import time; time.sleep(300)", token]
        subprocess.Popen(sleeper, start_new_session=scenario == "daemon")  # the daemon inherits stdout
        entry["grandchild"] = token
    with open(record, "a") as f:
        f.write(json.dumps(entry) + "\n")
    if scenario == "hang":
        time.sleep(300)
        return
    if review and scenario == "max_turns":
        print((HERE / "claude_max_turns.json").read_text(), end="")
        return
    if review and scenario == "too_long":  # what claude prints for a prompt past the model's window
        result = {"type": "result", "subtype": "success", "is_error": True, "result": "Prompt is too long"}
        print(json.dumps({**result, "num_turns": 1, "total_cost_usd": 0, "usage": {"input_tokens": 0}}))
        return
    if review:
        stream = "claude_review_reject.json" if scenario == "reject" else "claude_review_accept.json"
        if name == "codex":
            verdict = json.loads(json.loads((HERE / stream).read_text())["result"])
            events = [
                {"type": "thread.started", "thread_id": "review"},
                {"type": "turn.started"},
                {
                    "type": "item.completed",
                    "item": {"id": "item_0", "type": "agent_message", "text": json.dumps(verdict)},
                },
                {
                    "type": "turn.completed",
                    "usage": {"input_tokens": 900, "cached_input_tokens": 0, "output_tokens": 40},
                },
            ]
            print("\n".join(json.dumps(e) for e in events))
        else:
            print((HERE / stream).read_text(), end="")
        return
    if scenario in ("success", "bad_annotation"):
        _edit_params()
    if scenario == "bad_annotation":
        with open("stack/colocate.py", "a") as f:
            f.write("\n# VAL: VAL_INT_RANGE (min=0)\nbroken = 3\n")
    streams = {
        ("claude", "success"): "claude_success.json",
        ("claude", "bad_annotation"): "claude_success.json",
        ("claude", "daemon"): "claude_success.json",
        ("claude", "max_turns"): "claude_max_turns.json",
        ("codex", "success"): "codex_success.jsonl",
        ("codex", "bad_annotation"): "codex_success.jsonl",
        ("codex", "failed"): "codex_failed.jsonl",
    }
    print((HERE / streams[name, scenario]).read_text(), end="")
    if (name, scenario) == ("codex", "failed"):
        sys.exit(1)
