"""What a candidate's code is, as one number: the digest a run's trace records of the stack it ran, and the
check that the stack is unchanged by its own run (``session.py``)."""

from __future__ import annotations

import hashlib
from pathlib import Path

TRASH = "__pycache__.removing."
"""A bytecode cache being removed (``session.remove_bytecode_caches`` renames one so before deleting it)."""


def _is_cache(name: str) -> bool:
    """A bytecode cache, or one being removed; ``__pycache__x`` is a package like any other."""
    return name == "__pycache__" or name.startswith(TRASH)


def directory_digest(directory: Path) -> str:
    """sha256 over every file's path and bytes under ``directory`` (caches and ``.vibetrain`` records excluded)."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).rglob("*")):
        relative = path.relative_to(directory)
        cache = any(_is_cache(part) for part in relative.parts)  # see session.remove_bytecode_caches
        if path.is_file() and not cache and ".vibetrain" not in path.name:
            digest.update(str(relative).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
