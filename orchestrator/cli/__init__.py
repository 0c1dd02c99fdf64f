"""The ``vibetrain`` command line (``app``): the application and its one error path in ``app.py``;
the commands that act on targets and the harness in ``harness_commands.py``; ``generate`` in
``generate.py``; the commands that review a run in ``run_commands.py``. TARGET is a catalog id or a
path to a YAML spec everywhere."""

from orchestrator.cli import generate, harness_commands, run_commands  # noqa: F401 - each registers its commands
from orchestrator.cli.app import app

__all__ = ["app"]
