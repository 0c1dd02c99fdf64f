"""The Docker sandbox's containers, removed with whatever started them.

A container is no child of the ``docker run`` that started it: killing that client at a time limit
(the reaper's SIGKILL, the launcher's) leaves the container running, writing into the workspace it
mounts while the judge measures the next candidate. So every container the sandbox starts carries an
owner's label (``wrap(owner=...)``, or the ``OWNER_ENV`` a harness child inherits), and the owner
removes every container of its label when it is done, however its processes ended.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
from collections.abc import Iterator

LABEL = "vibetrain.owner"
OWNER_ENV = "VIBETRAIN_CONTAINER_OWNER"  # the owner a harness child labels its candidates' containers with
DOCKER_TIMEOUT_S = 60.0


@contextlib.contextmanager
def owned_containers(backend: str) -> Iterator[str | None]:
    """An owner label for the containers started within (None unless the sandbox is Docker); each of
    them is removed on the way out."""
    if backend != "docker":
        yield None
        return
    owner = secrets.token_hex(8)
    try:
        yield owner
    finally:
        remove_containers(owner)


def remove_containers(owner: str) -> list[str]:
    """Every container labelled ``owner``, running or not, removed; their ids."""
    listed = _docker("ps", "--all", "--quiet", "--filter", f"label={LABEL}={owner}")
    ids = listed.split()
    if ids:
        _docker("rm", "--force", *ids)
    return ids


def _docker(*args: str) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=DOCKER_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:2])} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout
