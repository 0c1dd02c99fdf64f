"""The per-target contract: specs, the public API for candidates, and the harness that judges them."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
"""The folder holding this very ``targets`` package: where the harness's own processes import it from,
whatever folder the user runs vibetrain in (one with a ``targets`` folder of its own, say)."""
