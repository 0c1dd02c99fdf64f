"""Folders a command makes for its own work (a starter it checks, the runs a bench measures, a
candidate read out of a run's history), removed when the process exits: a paper-scale bench writes
some 100 MB of trace a schedule, and a folder nobody was told of is one nobody removes. A command
that has something to show in one (the logs of a run that failed) keeps it and says where."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

from targets.errors import UserError

SCRATCH_ENV = "VIBETRAIN_SCRATCH"  # where the folders go; the system's temporary directory if unset

_TO_REMOVE: set[Path] = set()


class ScratchError(UserError, OSError):
    """``$VIBETRAIN_SCRATCH`` names no folder a command can write in."""


def scratch_folder(prefix: str) -> Path:
    """A new folder under ``$VIBETRAIN_SCRATCH`` (else the system's temporary directory), removed at exit
    unless ``keep`` is called."""
    given = os.environ.get(SCRATCH_ENV) or None
    base = None if given is None else os.path.abspath(given)  # printed, and removed from any working directory
    if base is not None and not Path(base).is_dir():
        what = "a file" if Path(base).exists() else "no folder"
        raise ScratchError(
            f"${SCRATCH_ENV} is {given!r}, {what}: make the folder, or unset it to use {tempfile.gettempdir()}"
        )
    try:
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    except OSError as error:  # not writable, a read-only or full file system
        where = base or tempfile.gettempdir()
        raise ScratchError(
            f"cannot make a scratch folder in {where} ({error.strerror or error}): set ${SCRATCH_ENV} to a "
            "writable folder"
        ) from error
    _TO_REMOVE.add(path)
    return path


def keep(path: Path) -> Path:
    """``path`` outlives the process (the caller prints it)."""
    _TO_REMOVE.discard(path)
    return path


@atexit.register
def _remove_scratch() -> None:
    for path in sorted(_TO_REMOVE):
        try:
            shutil.rmtree(path)
        except FileNotFoundError:  # a command removed it already
            pass
        except OSError as error:
            print(f"vibetrain: the scratch folder {path} was not removed: {error}", file=sys.stderr)
    _TO_REMOVE.clear()
