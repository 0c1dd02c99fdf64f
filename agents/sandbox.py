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
            wrapped += ["--ro-bind", str(cache), str(cache)]  # the model cache may live under /tmp
            for arg in command[1:]:  # files the command names (a target spec under /tmp, say), read-only
                if arg.startswith("/") and Path(arg).exists() and Path(arg).resolve() not in writable:
                    wrapped += ["--ro-bind", arg, arg]
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
