"""The ``vibetrain`` application: the Typer apps, where output goes, and the one place an error
becomes an exit code.

Every command is registered with ``command``: a ``UserError`` raised anywhere below it (a bad spec,
a sandbox that cannot run, a run that cannot resume, a bad option here) is printed as one line,
``error: <message>``, and the command exits with the error's code; nothing a user can fix ends in a
traceback. The input helpers below raise ``UsageError`` for what the command line itself got wrong.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from orchestrator.run_dir import RunDir
from orchestrator.tables import plain
from targets.errors import UserError
from targets.printable import printable

HELP = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    context_settings=HELP,
    help="Generate and benchmark time-multiplexed RL stacks.\n\n"
    "Start with: vibetrain generate tiny-qwen3-cpu --rounds 2, then vibetrain log RUN and vibetrain show RUN best.",
)
target_app = typer.Typer(
    no_args_is_help=True,
    context_settings=HELP,
    help="Inspect and validate target specs.\n\nExample: vibetrain target show tiny-qwen3-cpu > my-target.yaml",
)
app.add_typer(target_app, name="target")
workload_app = typer.Typer(
    no_args_is_help=True,
    context_settings=HELP,
    help="Measure a target's workload.\n\n"
    "Example: vibetrain workload profile tiny-qwen3-cpu-arithmetic --out arithmetic.profile.yaml",
)
app.add_typer(workload_app, name="workload")

# no emoji codes: a user's value (a run named run:fire:, an agent cli:gemini) is printed as it is
console = Console(emoji=False)
console.soft_wrap = not console.is_terminal  # in a pipe or a file, whole lines: grep sees a path unbroken
errors = Console(stderr=True, soft_wrap=True, emoji=False)  # an error names paths and values: never broken mid-word


def shown(value: object) -> str:
    """A user's value (a path, a name) in console markup, printed as it is: a folder named ``run[red]x`` or
    ``r[/b]`` is no markup (the second raised a MarkupError after the command's work was done)."""
    return escape(str(value))


def argument(path: object) -> str:
    """A path in a command the user copies, quoted for the shell where it must be (a space, a quote)."""
    return escape(shlex.quote(str(path)))


TARGET_ARGUMENT = typer.Argument(
    ..., metavar="TARGET", help="a catalog id (vibetrain targets lists them) or a target spec's YAML file"
)
RUN_ARGUMENT = typer.Argument(..., metavar="RUN", help="a run's folder (generate's --out; default generated/<target>)")
JSON_OPTION = typer.Option(False, "--json", help="print JSON instead of a table (for scripts)")
SANDBOX_OPTION = typer.Option("auto", help="auto | bubblewrap | docker | subprocess")
TIME_LIMIT_OPTION = typer.Option(
    None, min=1, help="seconds each child run may take (default: the target's limits.time_s)"
)


class UsageError(UserError):
    """What the command line itself got wrong (an option's value, a path that is not what it must be)."""


# Folders ``out_file`` made for this command's outputs: removed again, if still empty, when
# the command fails (a mistyped target left ``--json``'s new folders behind).
_FOLDERS_MADE: list[Path] = []


def command(typer_app: typer.Typer, name: str) -> Callable:
    """Registers ``function`` as command ``name``, its user errors turned into their exit codes here."""

    def register(function: Callable) -> Callable:
        @functools.wraps(function)
        def run(*args, **kwargs):
            _FOLDERS_MADE.clear()
            try:
                return function(*args, **kwargs)
            except UserError as error:
                _remove_empty_folders_made()
                # a message may quote a user's environment or a candidate: no markup, no terminal sequence
                errors.print(f"[red]error:[/red] {escape(printable(str(error)))}", highlight=False)
                raise typer.Exit(error.exit_code) from None
            except BaseException as error:  # re-raised as it is: only the folders it made for nothing go
                if not (isinstance(error, typer.Exit) and error.exit_code == 0):
                    _remove_empty_folders_made()
                raise

        # the command list shows the docstring's first paragraph as one line (its source lines break mid-sentence)
        summary = " ".join(re.split(r"\n\s*\n", function.__doc__ or "")[0].split())
        return typer_app.command(name, short_help=summary or None)(run)

    return register


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from orchestrator.provenance import source_commit

        sys.stdout.write(f"vibetrain {version('vibetrain')} ({source_commit()})\n")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version and source commit, then exit"
    ),
) -> None:
    """SIGTERM (a timeout, a scheduler) unwinds like Ctrl-C, so the harness takes its candidate processes down."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


# -- output ------------------------------------------------------------------------------------------


def print_table(table: Table) -> None:
    """A table on a terminal; tab-separated rows in a pipe or a file (whole rows for grep and cut)."""
    if console.is_terminal:
        console.print(table)
    else:
        sys.stdout.write(plain(table))


def print_report(table: Table) -> None:
    """A measured report (bench, calibrate) with its title and caption; in a pipe or a file at its whole
    width, where 80 columns cut its figures to ellipses ('1.33x [0.45, 3.…')."""
    if console.is_terminal:
        console.print(table)
    else:
        whole = Measurement.get(console, console.options.update_width(10_000), table).maximum
        Console(width=max(console.width, whole), highlight=False, emoji=False).print(table)  # print stops at 80


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=1, default=str) + "\n")


# -- input -------------------------------------------------------------------------------------------


def refuse_inside_a_run(path: Path, option: str) -> None:
    """An output inside a run's worktree (not its git folder, where a run keeps its own records) is refused:
    an untracked file or folder there makes the run's ``--resume`` refuse it (a report written from inside
    the run, a run made in another's ``stack/``, a check's JSON over a candidate's file)."""
    resolved = path.resolve()
    run = next((folder for folder in resolved.parents if RunDir(folder).state_file.is_file()), None)
    if run is not None and not (resolved == run / ".git" or run / ".git" in resolved.parents):
        raise UsageError(f"{option} {path}: inside the run {run}, whose worktree holds only its commits")


def out_dir(path: Path, option: str = "--out") -> Path:
    """A directory this command may create or fill, checked before any work: a file there, or a folder
    nothing can be made in, is refused by name, and one inside a run (``refuse_inside_a_run``). The check
    leaves nothing behind (``--resume`` reads whether a run's directory exists)."""
    refuse_inside_a_run(path, option)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path}: a file is there; give a directory path")
    there = path
    while not there.exists():
        there = there.parent
    if not there.is_dir():
        raise UsageError(f"{option} {path}: {there} is a file, not a folder")
    try:
        Path(tempfile.mkdtemp(prefix=".vibetrain-probe-", dir=there)).rmdir()
    except OSError as error:
        raise UsageError(f"{option} {path}: nothing can be made in {there} ({error.strerror})") from None
    return path


def out_file(path: Path | None, option: str, image: bool = False) -> Path | None:
    """A file this command will write when it is done: checked (its folder made, the file opened for
    writing and left as it was) before any work, so a typo never costs a finished benchmark. ``image``:
    a plot, whose format is its name's ending (one matplotlib cannot write failed after the benchmark)."""
    if path is None:
        return None
    refuse_inside_a_run(path, option)
    if path.is_dir():
        raise UsageError(f"{option} {path}: a directory is there; give a file path")
    if image:
        from matplotlib.figure import Figure

        formats = Figure().canvas.get_supported_filetypes()
        if path.suffix.lstrip(".").lower() not in formats:
            raise UsageError(
                f"{option} {path}: the name says no image format matplotlib writes; end it in .png, .svg or .pdf "
                f"(or {', '.join(sorted(set(formats) - {'png', 'svg', 'pdf'}))})"
            )
    in_the_way = next((p for p in [path.parent, *path.parent.parents] if p.exists() and not p.is_dir()), None)
    if in_the_way is not None:  # mkdir says only "File exists"
        raise UsageError(f"{option} {path}: {in_the_way} is a file, not a folder")
    missing = [folder for folder in [path.parent, *path.parent.parents] if not folder.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{option} {path}: cannot create its folder ({error.strerror})") from None
    _FOLDERS_MADE.extend(missing)
    try:
        _open_for_writing(path)
    except OSError as error:
        raise UsageError(f"{option} {path}: cannot be written ({error.strerror})") from None
    return path


def folder_ready(path: Path) -> Path:
    """``path`` (an ``out_file``) about to be written, its folder made again: a command beside this one that
    failed may have removed it as its own (two benchmarks writing into one new folder, one mistyped)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _remove_empty_folders_made() -> None:
    # deepest first, so that a folder holding only folders made here goes too
    for folder in sorted(set(_FOLDERS_MADE), key=lambda f: len(f.parts), reverse=True):
        try:
            folder.rmdir()
        except OSError:  # not empty (something else wrote there meanwhile), or gone: left as it is
            pass
    _FOLDERS_MADE.clear()


def _open_for_writing(path: Path) -> None:
    """Opens ``path`` for writing and leaves it as it was: a file made here is removed, an existing one is
    opened for appending nothing (its bytes stay until the command writes). A link is probed at its target;
    a pipe without a reader is refused, never waited on."""
    target = path.resolve() if path.is_symlink() else path
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
    else:
        target.unlink()


def candidate_dir(path: Path, option: str = "--stack") -> Path:
    """A candidate directory (it holds the ``stack`` package), checked before any work starts; or
    ``RUN@best``, ``RUN@latest``, ``RUN@round-N``, ``RUN@<commit>``: that candidate of a generate run, exported to a
    temporary directory (what every command that takes a stack takes)."""
    if "@" in str(path) and not path.exists():
        from orchestrator.runs import export_candidate

        path = export_candidate(str(path))
    if not (path / "stack" / "__init__.py").is_file():
        what = "does not exist" if not path.exists() else "holds no stack/__init__.py: it is not a candidate directory"
        raise UsageError(f"{option} {path} {what}")
    return path


def open_tracker(track: str | None, track_dir: Path | None, default_dir: Callable[[], Path]):
    """``--track``'s writer and its directory, opened before any run (a missing package is said in
    seconds, not after the work; the writer writes nothing until the first scalar); (None, None)
    without ``--track``."""
    from targets.harness.measure.tracking import tracker_kind

    if track is None:
        if track_dir is not None:
            raise UsageError("--track-dir needs --track tensorboard|jsonl")
        return None, None
    writer = tracker_kind(track)  # before default_dir(), which may make a folder
    track_dir = out_dir(track_dir or default_dir(), "--track-dir")
    return writer(track_dir), track_dir


def session(target: str, sandbox: str, time_limit: float | None, simulate: bool = False):
    """The harness session for a command (``Session.open``): the target resolved once, and a user's environment
    made and closed once, so one that cannot be made is named as the user's before a run blames a candidate."""
    from targets.harness.environments.hosted import check_environment
    from targets.harness.measure.session import Session
    from targets.harness.target import Target

    resolved = Target.load(target, simulate=simulate)
    check_environment(resolved.spec.workload.environment)
    return Session.open(resolved, sandbox, time_limit)
