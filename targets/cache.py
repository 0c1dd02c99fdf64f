"""Where vibetrain keeps what it builds and what must outlive a call (models, CLI homes): the folder
``VIBETRAIN_CACHE`` names, else ``~/.cache/vibetrain``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    return Path(os.environ.get("VIBETRAIN_CACHE", Path.home() / ".cache" / "vibetrain"))
