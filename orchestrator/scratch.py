"""Folders a command makes for its own work (a starter it checks, the runs a bench measures, a
candidate read out of a run's history), removed when the process exits: a paper-scale bench writes
some 100 MB of trace a schedule, and a folder nobody was told of is one nobody removes. A command
that has something to show in one (the logs of a run that failed) keeps it and says where."""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

_TO_REMOVE: set[Path] = set()


def scratch_folder(prefix: str) -> Path:
    """A new folder under the system's temporary directory, removed at exit unless ``keep`` is called."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
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
