"""Where vibetrain keeps what it builds and what must outlive a call (models, CLI homes): the folder
``VIBETRAIN_CACHE`` names, else ``~/.cache/vibetrain``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from targets.errors import UserError

CACHE_ENV = "VIBETRAIN_CACHE"


class CacheError(UserError, OSError):
    """``$VIBETRAIN_CACHE`` names no folder vibetrain can build its models in."""


def cache_home(environ: Mapping[str, str] = os.environ) -> Path:
    """The cache folder ``environ`` names, absolute: a relative ``$VIBETRAIN_CACHE`` is taken from the working
    folder here, once (a sandboxed candidate or a CLI agent's check, run in another folder, is handed this
    path); an empty one is unset."""
    given = environ.get(CACHE_ENV) or None
    return Path(os.path.abspath(given)) if given else Path.home() / ".cache" / "vibetrain"


def cache_error(path: Path, error: OSError) -> CacheError:
    """What to say when ``path`` in the cache cannot be made or written."""
    given = os.environ.get(CACHE_ENV)
    named = f" (${CACHE_ENV} is {given!r})" if given else ""
    return CacheError(
        f"cannot write the model cache at {path}{named}: {error.strerror or error}; set ${CACHE_ENV} to a "
        "writable folder"
    )
