"""The Docker sandbox's containers, removed with whatever started them.

A container is no child of the ``docker run`` that started it: killing that client at a time limit
(the reaper's SIGKILL, the launcher's) leaves the container running, writing into the workspace it
mounts while the judge measures the next candidate. So every container the sandbox starts carries a
label for each of its owners (``wrap(owner=...)``: the candidate processes of one phase, one command
tool call; and the ``OWNER_ENV`` a harness child inherits: its launcher), and each owner removes every
container of its label when it is done, however its processes ended: the first one out removes it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import subprocess
from collections.abc import Iterator

LABEL = "vibetrain.owner"  # a container carries ``vibetrain.owner.<owner>`` for each of its owners
OWNER_ENV = "VIBETRAIN_CONTAINER_OWNER"  # the owner a harness child labels its candidates' containers with
DOCKER_TIMEOUT_S = 60.0
log = logging.getLogger(__name__)


class ContainerCleanupError(RuntimeError):
    """Docker would not list or remove an owner's containers: they may still be running."""


def label_of(owner: str) -> str:
    return f"{LABEL}.{owner}"


def new_owner(backend: str) -> str | None:
    """A fresh owner for the containers a sandbox of ``backend`` starts (None unless it is Docker)."""
    return secrets.token_hex(8) if backend == "docker" else None


@contextlib.contextmanager
def owned_containers(backend: str) -> Iterator[str | None]:
    """An owner for the containers started within (None unless the sandbox is Docker); each of them is
    removed on the way out."""
    owner = new_owner(backend)
    if owner is None:
        yield None
        return
    try:
        yield owner
    except BaseException as error:
        remove_containers(owner, raising=error)
        raise
    remove_containers(owner)


def remove_containers(owner: str, raising: BaseException | None = None) -> list[str]:
    """Every container labelled with ``owner``, running or not, removed; their ids. One that went by
    itself meanwhile (``--rm``), or that its other owner is removing, is no failure: only a container
    still listed after a failed ``rm`` is. A failure is raised, or, with ``raising`` (the exception on
    its way out), logged beside it: never raised over it."""
    try:
        ids = _listed(owner)
        if ids:
            try:
                _docker("rm", "--force", *ids)
            except ContainerCleanupError:
                if _listed(owner):
                    raise
    except ContainerCleanupError as cleanup:
        if raising is None:
            raise
        log.error("%s; and the containers of owner %s may still run: %s", raising, owner, cleanup)
        return []
    return ids


def _listed(owner: str) -> list[str]:
    return _docker("ps", "--all", "--quiet", "--filter", f"label={label_of(owner)}").split()


def _docker(*args: str) -> str:
    try:
        done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=DOCKER_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ContainerCleanupError(f"docker {' '.join(args[:2])} did not run: {error}") from error
    if done.returncode != 0:
        raise ContainerCleanupError(
            f"docker {' '.join(args[:2])} failed ({done.returncode}): {done.stderr.strip()[-500:]}"
        )
    return done.stdout
