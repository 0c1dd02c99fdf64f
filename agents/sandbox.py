"""Where candidate code runs: a separate process tree with time, memory and process limits (the
harness's watchdog), the workspace and the run's output directory writable, everything else
read-only, no network, and an environment with no secrets in it.

Backends, best first: ``bubblewrap`` (a mount, PID and network namespace; the default on Linux
where installed), ``docker`` (when a daemon answers and an image is configured), ``subprocess``
(no isolation beyond the limits; chosen only when nothing better exists, and it says so, once,
loudly).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("vibetrain.sandbox")

SAFE_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "VIBETRAIN_CACHE",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAY_USAGE_STATS_ENABLED", "CUDA_VISIBLE_DEVICES", "VIRTUAL_ENV")
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)
BACKENDS = ("bubblewrap", "docker", "subprocess")
_announced: set[str] = set()


def scrubbed_environment(env: dict[str, str]) -> dict[str, str]:
    """Only what a candidate needs; never anything that looks like a secret."""
    kept = {k: v for k, v in env.items() if k in SAFE_ENV and not SECRET.search(k)}
    kept.setdefault("VIBETRAIN_CACHE", str(Path(os.environ.get("VIBETRAIN_CACHE", Path.home() / ".cache" / "vibetrain"))))
    return kept


def _bubblewrap_works() -> bool:
    if shutil.which("bwrap") is None:
        return False
    probe = subprocess.run(["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-all", "true"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def _docker_image() -> str | None:
    image = os.environ.get("VIBETRAIN_DOCKER_IMAGE")
    if not image:
        return None
    import docker  # the official SDK; only asked when an image is configured

    try:
        docker.from_env().ping()
    except docker.errors.DockerException as error:
        log.warning("VIBETRAIN_DOCKER_IMAGE is set but no Docker daemon answers (%s)", error)
        return None
    return image


def _python_paths() -> list[Path]:
    """What the child's Python needs to see: its installation (a virtualenv, say) and every import path
    (the repository itself, for an editable install)."""
    paths = [Path(sys.prefix), Path(sys.exec_prefix), Path(sys.executable).parent]
    project = Path(__file__).resolve().parents[1]  # where vibetrain itself is (an editable install's finder points here)
    return paths + [project] + [Path(entry) for entry in sys.path if entry]


def _under_tmp(paths, writable: list[Path]) -> list[Path]:
    """The existing paths under /tmp (outermost only, writable ones excluded): the sandbox mounts a
    private /tmp, so these must be bound back in, read-only."""
    found: list[Path] = []
    for path in paths:
        path = Path(path)
        if not path.exists():
            continue
        path = path.resolve()
        if path.parts[:2] != ("/", "tmp") or path == Path("/tmp") or any(path == w or w in path.parents for w in writable):
            continue
        found.append(path)
    outermost = sorted(set(found), key=lambda p: len(p.parts))
    return [p for i, p in enumerate(outermost) if not any(q in p.parents for q in outermost[:i])]


@dataclass
class Sandbox:
    backend: str
    docker_image: str | None = None

    @classmethod
    def detect(cls, preferred: str = "auto") -> "Sandbox":
        if preferred not in ("auto", *BACKENDS):
            raise ValueError(f"unknown sandbox {preferred!r}; choose auto or one of {BACKENDS}")
        if preferred in ("auto", "bubblewrap") and _bubblewrap_works():
            return cls("bubblewrap")
        if preferred == "bubblewrap":
            raise RuntimeError("--sandbox bubblewrap: bwrap is not installed or cannot create namespaces here")
        if preferred in ("auto", "docker") and (image := _docker_image()):
            return cls("docker", image)
        if preferred == "docker":
            raise RuntimeError("--sandbox docker: set VIBETRAIN_DOCKER_IMAGE to a local image and start a Docker daemon")
        if "subprocess" not in _announced:
            _announced.add("subprocess")
            log.warning("SANDBOX: neither bubblewrap nor Docker is available; candidate code runs as a plain subprocess "
                        "with time/memory/process limits and a scrubbed environment, but NO filesystem or network isolation")
        return cls("subprocess")

    def launcher(self, command: list[str], env: dict, stack_dir: Path, out: Path) -> tuple[list[str], dict]:
        """Wrap a candidate's command (the harness's ``Launcher``)."""
        clean = scrubbed_environment(env)
        if self.backend == "subprocess":
            return command, clean
        writable = [Path(stack_dir).resolve(), Path(out).resolve()]
        if self.backend == "bubblewrap":
            wrapped = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                       "--dir", "/tmp/home", "--unshare-all", "--die-with-parent", "--chdir", str(writable[0]), "--clearenv"]
            cache = Path(clean["VIBETRAIN_CACHE"]).resolve()
            cache.mkdir(parents=True, exist_ok=True)
            for path in _under_tmp([cache, *_python_paths(), *(a for a in command if a.startswith("/"))], writable):
                wrapped += ["--ro-bind", str(path), str(path)]  # the private /tmp would hide them
            for path in writable:
                wrapped += ["--bind", str(path), str(path)]
            for key, value in {**clean, "HOME": "/tmp/home", "RAY_AUTH_MODE": "disabled", "TMPDIR": "/tmp"}.items():
                wrapped += ["--setenv", key, value]
            return wrapped + command, {}
        wrapped = ["docker", "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp",
                   "-v", "/:/:ro", "-w", str(writable[0])]
        for path in writable:
            wrapped += ["-v", f"{path}:{path}:rw"]
        for key, value in {**clean, "HOME": "/tmp", "RAY_AUTH_MODE": "disabled"}.items():
            wrapped += ["-e", f"{key}={value}"]
        return wrapped + [self.docker_image] + command, {"PATH": os.environ.get("PATH", "")}
