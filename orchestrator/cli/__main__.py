"""``python -m orchestrator.cli``: the ``vibetrain`` command."""

from orchestrator.cli import app

app()
