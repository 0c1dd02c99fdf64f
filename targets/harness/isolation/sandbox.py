"""Where candidate code runs: a process that sees only what the run needs.

The harness wraps every candidate process (and the LLM agents' shell commands) in a sandbox: the
system's programs and libraries, the Python installation, the project checkout and the model cache
read-only; the directories named ``readable`` read-only and ``writable`` writable; a private /tmp
and home; no network; an environment with nothing secret in it; on GPU targets the NVIDIA device
nodes and nothing else of /dev. Nothing of the host's home directories or the harness's own
outputs is visible unless named.

Backends, best first: ``bubblewrap`` (mount, PID, IPC, user and network namespaces), ``docker``
(when a daemon answers and ``VIBETRAIN_DOCKER_IMAGE`` names an image), ``subprocess`` (no isolation
beyond the harness's limits). ``auto`` refuses to fall back to ``subprocess``: that must be asked
for by name, and it says so loudly.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from targets import PROJECT_ROOT
from targets.cache import cache_home
from targets.errors import UserError
from targets.harness.isolation.containers import OWNER_ENV, label_of

log = logging.getLogger("vibetrain.sandbox")

SAFE_ENV = (
    "PATH",
    "LANG",
    "LC_ALL",
    "TZ",
    "PYTHONPATH",
    "PYTHONUNBUFFERED",
    "PYTHONHASHSEED",
    "VIBETRAIN_CACHE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "RAY_USAGE_STATS_ENABLED",
    "CUDA_VISIBLE_DEVICES",
    "VIRTUAL_ENV",
)
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)
BACKENDS = ("bubblewrap", "docker", "subprocess")
DOCKER_PIDS = 4096  # a container's processes and threads: its processes are the daemon's, no watchdog sees them
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/sys")
ETC_FILES = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "passwd",
    "group",
    "nsswitch.conf",
    "hosts",
    "host.conf",
    "gai.conf",
    "protocols",
    "services",
    "ssl",
    "ca-certificates",
    "alternatives",
    "mime.types",
)
_announced: set[str] = set()


class SandboxUnavailable(UserError, RuntimeError):
    """The sandbox asked for cannot run here (the message says what to install or pass)."""


def scrubbed_environment(env: dict[str, str]) -> dict[str, str]:
    """Only what a candidate needs; never anything that looks like a secret."""
    kept = {k: v for k, v in env.items() if k in SAFE_ENV and not SECRET.search(k)}
    # absolute (the candidate runs in another folder): the env's own, else this process's
    kept["VIBETRAIN_CACHE"] = str(cache_home(kept if kept.get("VIBETRAIN_CACHE") else os.environ))
    return kept


def ray_cluster_environment(env: dict[str, str]) -> dict[str, str]:
    """A Ray cluster already running that the candidate's actors join (``RAY_ADDRESS``), for a sandbox
    that shares the network; the cluster must run without token authentication (no secret passes)."""
    address = env.get("RAY_ADDRESS")
    return {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"} if address else {}


# what a bwrap must do here to sandbox candidates (after its own path): namespaces, and --size (bubblewrap
# 0.5: the candidates' tmpfs are sized by ``wrap``; an older bwrap refuses it)
BWRAP_PROBE = (
    *("--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"),
    *("--size", "1048576", "--tmpfs", "/tmp", "--unshare-all", "true"),
)


def _bubblewrap_works() -> bool:
    if shutil.which("bwrap") is None:
        return False
    probe = subprocess.run(
        ["bwrap", *BWRAP_PROBE],
        capture_output=True,
        timeout=30,
    )
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


# What a sandboxed process imports from the project checkout: the contract and the harness's candidate side
# (``targets``). The checkout's other files (the orchestrator, agents, tests, a user's notes or keys kept
# beside the code) are not mounted: a red team's sandboxed command printed a key from a .env in its root.
CHECKOUT_VISIBLE = ("targets",)


def python_paths() -> list[Path]:
    """What a child's Python needs to see: its installation (a virtualenv, say, inside the checkout or
    not), every import path, and of the project checkout ``CHECKOUT_VISIBLE`` alone (an editable
    install's import finder points there without putting it on sys.path; where it is on sys.path, only
    those folders are mounted). Not the working directory Python puts first on sys.path: started from a
    home directory, it showed the candidate the user's files; a candidate imports nothing from there."""
    here, root = Path.cwd().resolve(), PROJECT_ROOT.resolve()
    paths = [
        Path(sys.prefix),
        Path(sys.exec_prefix),
        Path(sys.base_prefix),
        Path(sys.executable).resolve().parent,
        *(root / name for name in CHECKOUT_VISIBLE),
        *(Path(entry) for entry in sys.path if entry and Path(entry).resolve() != here),
    ]
    return [path for path in paths if path.resolve() != root]


# The checkout's folders a candidate must not see, hidden under an empty tmpfs where a folder holding the
# checkout is mounted (``checkout_masks``): other rounds' worktrees, the runs' repositories, its own git.
HIDDEN_IN_CHECKOUT = ("workspaces", "generated", ".git")
# Files in the checkout's root a candidate must not read: secrets kept beside the code (an API key's .env),
# covered by /dev/null where a folder holding the checkout is mounted (a red team's command printed one)
SECRET_FILES = (".env", ".env.*", ".envrc", ".netrc", "*.pem", "*.key")


def secret_files(root: Path) -> list[Path]:
    """The files in ``root`` (not below it) named like secrets (``SECRET_FILES``)."""
    found = {path for pattern in SECRET_FILES for path in root.glob(pattern)}
    return sorted(path for path in found if path.is_file() and not path.is_symlink())


def checkout_masks(
    readonly: Sequence[Path], readable: Sequence[Path], writable: Sequence[Path]
) -> tuple[list[Path], list[Path], list[Path]]:
    """Where the checkout is among the ``readonly`` mounts: its folders to hide under an empty tmpfs
    (``HIDDEN_IN_CHECKOUT``), what the candidate is given inside them (its own stack in a round's worktree,
    the sockets in the run's repository: ``outermost`` had folded them into the checkout's mount) to mount
    again over that tmpfs, and its secret files to cover with /dev/null. Every backend mounts these."""
    root = PROJECT_ROOT.resolve()
    if not any(p == root or p in root.parents for p in readonly):
        return [], [], []
    hidden = [root / name for name in HIDDEN_IN_CHECKOUT if (root / name).is_dir()]
    given = [
        q
        for q in outermost(readable)
        if any(h in q.parents for h in hidden) and not any(q == w or w in q.parents for w in writable)
    ]
    return hidden, given, secret_files(root)


def outermost(paths: Sequence[Path]) -> list[Path]:
    """The existing paths, resolved, with any path inside another one left out. /tmp and its
    ancestors never qualify (the sandbox's /tmp is its own; a cwd of /tmp on sys.path is no reason
    to show the host's)."""
    private = Path("/tmp")
    found = sorted(
        {Path(p).resolve() for p in paths if Path(p).exists()} - {private, *private.parents}, key=lambda p: len(p.parts)
    )
    kept: list[Path] = []
    for path in found:
        if not any(path == k or k in path.parents for k in kept):
            kept.append(path)
    return kept


PROC_KERNEL = ("sys", "sysrq-trigger", "irq", "bus")  # /proc's kernel settings


def proc_guards() -> list[str]:
    """``--ro-bind`` over /proc's kernel settings: bwrap covers them itself only where it may write them, and
    /proc/sys is mode 0555, so a sandbox run as root, its capabilities dropped, kept its files (0644, root's)
    writable: a red team set a sysctl from inside, and ``kernel.core_pattern``'s pipe runs as root outside
    every namespace."""
    present = [f"/proc/{name}" for name in PROC_KERNEL if os.path.exists(f"/proc/{name}")]
    return [arg for path in present for arg in ("--ro-bind", path, path)]


def sized_tmpfs(path: str, memory_bytes: int | None) -> list[str]:
    """bwrap's ``--tmpfs`` at ``path``, sized at ``memory_bytes`` where given: what a tmpfs holds is memory no
    process's resident set counts (by default each may take half the host's)."""
    return (["--size", str(memory_bytes)] if memory_bytes is not None else []) + ["--tmpfs", path]


def gpu_device_nodes() -> list[str]:
    return sorted(glob.glob("/dev/nvidia*"))


@dataclass(frozen=True)
class Sandbox:
    backend: str
    docker_image: str | None = None

    @classmethod
    def detect(cls, preferred: str = "auto") -> Sandbox:
        """``auto``: bubblewrap, else Docker, else refuse. ``subprocess`` must be named to be used."""
        if preferred not in ("auto", *BACKENDS):
            raise SandboxUnavailable(f"unknown sandbox {preferred!r}; choose auto or one of {', '.join(BACKENDS)}")
        if preferred in ("auto", "bubblewrap") and _bubblewrap_works():
            return cls("bubblewrap")
        if preferred == "bubblewrap":
            raise SandboxUnavailable(
                "--sandbox bubblewrap: bwrap is not installed, cannot create namespaces here, or is older than 0.5 "
                "(no --size)"
            )
        if preferred in ("auto", "docker") and (image := _docker_image()):
            return cls("docker", image)
        if preferred == "docker":
            raise SandboxUnavailable(
                "--sandbox docker: set VIBETRAIN_DOCKER_IMAGE to a local image and start a Docker daemon"
            )
        if preferred == "auto":
            raise SandboxUnavailable(
                "neither bubblewrap nor Docker can run here, so candidate code would run unisolated: install "
                "bubblewrap (apt-get install bubblewrap), or pass --sandbox subprocess to accept no isolation"
            )
        if "subprocess" not in _announced:
            _announced.add("subprocess")
            log.warning(
                "SANDBOX: --sandbox subprocess: candidate code runs as a plain subprocess with time/memory/process "
                "limits and a scrubbed environment, but NO filesystem or network isolation"
            )
        return cls("subprocess")

    @property
    def name(self) -> str:
        """How the harness child is told which sandbox to use (``--sandbox NAME``)."""
        return f"docker:{self.docker_image}" if self.backend == "docker" else self.backend

    @classmethod
    def named(cls, name: str) -> Sandbox:
        if name.startswith("docker:"):
            return cls("docker", name.split(":", 1)[1])
        if name not in BACKENDS:
            raise SandboxUnavailable(f"unknown sandbox {name!r}")
        return cls(name)

    def wrap_environment(
        self,
        command: list[str],
        *,
        readable: Sequence[Path],
        writable: Sequence[Path],
        hidden: Sequence[Path],
        network: bool,
        memory_bytes: int | None,
    ) -> list[str]:
        """The command that runs a user's environment (``environments/host.py``) under bubblewrap: the user's
        code, trusted, but reading text a candidate produced. It sees the machine as the user does, read-only;
        it writes to a private /tmp and to ``writable`` (the folders its spec names); ``readable`` folders under
        /tmp (its code's) are bound read-only; it sees no other process (the harness's memory is out of its
        reach), no ``hidden`` folder (the run's), no /run (the machine's service sockets: Docker's, D-Bus's) and,
        unless its spec says ``network``, no network (a red team's reached abstract sockets and localhost)."""
        if self.backend != "bubblewrap":
            raise ValueError(f"a user's environment is sandboxed by bubblewrap only, not by {self.backend}")
        wrapped = ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", *([] if network else ["--unshare-net"])]
        wrapped += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--ro-bind", "/", "/"]
        wrapped += ["--dev", "/dev", "--proc", "/proc", *proc_guards()]
        for tmpfs in ("/dev/shm", "/tmp", "/run"):
            wrapped += sized_tmpfs(tmpfs, memory_bytes)
        resolver = Path("/etc/resolv.conf").resolve()
        if network and resolver.is_relative_to("/run") and resolver.exists():  # systemd-resolved's, under /run
            wrapped += ["--ro-bind", str(resolver.parent), str(resolver.parent)]
        resolved = [Path(p).resolve() for p in readable]
        for path in outermost([p for p in resolved if p.is_relative_to("/tmp")]):
            wrapped += ["--ro-bind", str(path), str(path)]
        for path in outermost([Path(p).resolve() for p in writable]):
            wrapped += ["--bind", str(path), str(path)]
        for path in outermost([Path(p).resolve() for p in hidden if Path(p).exists()]):
            wrapped += ["--tmpfs", str(path)]  # last: over whatever was bound around or inside it
        return wrapped + ["--remount-ro", "/dev"] + command

    def wrap(
        self,
        command: list[str],
        env: dict,
        *,
        readable: Sequence[Path] = (),
        writable: Sequence[Path] = (),
        cwd: Path | None = None,
        gpus: bool = False,
        owner: str | None = None,
        memory_bytes: int | None = None,
        file_bytes: int | None = None,
    ) -> tuple[list[str], dict]:
        """The command and environment that run ``command`` inside this sandbox. ``owner``: whoever
        removes a Docker container when done with it (``containers.py``), beside the launcher a harness
        child inherits; one of the two is needed. ``memory_bytes``, ``file_bytes``: a container's own
        limits (its memory, the size of a file it writes), which a limit set on the docker client, a
        process outside it, does not reach; elsewhere the caller's rlimits, inherited, hold them. In
        bubblewrap ``memory_bytes`` also sizes its /tmp and /dev/shm: what a tmpfs holds is memory no
        process's resident set counts (by default each may take half the host's)."""
        clean = scrubbed_environment(env)
        if self.backend == "subprocess":
            return command, clean | ray_cluster_environment(env)
        if env.get("RAY_ADDRESS") and f"ray-{self.backend}" not in _announced:
            _announced.add(f"ray-{self.backend}")
            log.warning(
                "RAY_ADDRESS is set, but the %s sandbox has no network: candidates start a Ray cluster of their own",
                self.backend,
            )
        # the built models only: the cache holds more (a CLI agent's copy of its login, for the length of a call)
        models = Path(clean["VIBETRAIN_CACHE"]).resolve() / "models"
        models.mkdir(parents=True, exist_ok=True)
        links = [str(p) for p in writable if Path(p).is_symlink()]
        if links:  # resolved, it would mount wherever the link points writable: whoever made it chose that
            raise ValueError(f"a writable path of the sandbox is a symbolic link: {', '.join(links)}")
        writable = outermost(writable)
        # the program itself where it is named by path; never a path among its arguments: an agent's command
        # is one, and a link it planted named as such a path would mount what it points to (the host's files)
        program = [command[0]] if command[0].startswith("/") else []
        readonly = [
            p
            for p in outermost([models, *python_paths(), *readable, *program])
            if not any(p == w or w in p.parents for w in writable)
        ]
        cwd = Path(cwd or (writable[0] if writable else "/tmp"))
        variables = {**clean, "HOME": "/tmp/home", "TMPDIR": "/tmp", "RAY_AUTH_MODE": "disabled"}
        if self.backend == "bubblewrap":
            wrapped = [
                "bwrap",
                "--unshare-all",
                "--cap-drop",  # run as root, it kept every capability: a remount made its read-only binds writable
                "ALL",
                "--die-with-parent",
                "--new-session",
                "--clearenv",
                "--dev",
                "/dev",
                "--proc",
                "/proc",
                *proc_guards(),
            ]
            for tmpfs in ("/tmp", "/dev/shm"):
                wrapped += sized_tmpfs(tmpfs, memory_bytes)
            wrapped += ["--dir", "/tmp/home"]
            for path in SYSTEM_PATHS:
                if os.path.exists(path):
                    wrapped += ["--ro-bind", path, path]
            for name in ETC_FILES:
                if os.path.exists(f"/etc/{name}"):
                    wrapped += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
            if gpus:
                for node in gpu_device_nodes():
                    wrapped += ["--dev-bind", node, node]
            hidden, given, secrets = checkout_masks(readonly, readable, writable)
            mounts = sorted(  # the outer first: what is bound inside a hidden folder comes after its tmpfs
                [(p, "--ro-bind") for p in [*readonly, *given]]
                + [(p, "--bind") for p in writable]
                + [(h, "--tmpfs") for h in hidden],
                key=lambda m: len(m[0].parts),
            )
            for path, how in mounts:
                wrapped += [how, str(path)] if how == "--tmpfs" else [how, str(path), str(path)]
            for secret in secrets:  # after the checkout's bind, over it
                wrapped += ["--ro-bind", "/dev/null", str(secret)]
            wrapped += ["--remount-ro", "/"]  # everything not bound writable is read-only (the root's own tmpfs too)
            wrapped += ["--remount-ro", "/dev"]  # its own tmpfs, of no size limit: writes go to /dev/shm or /tmp
            for key, value in variables.items():
                wrapped += ["--setenv", key, value]
            # bwrap's own environment: its init (pid 1 in the sandbox) keeps it, readable at /proc/1/environ, so
            # it gets the PATH that finds bwrap and nothing else (an empty one would be read as "inherit")
            return wrapped + ["--chdir", str(cwd)] + command, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        wrapped = ["docker", "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp", "-w", str(cwd)]
        wrapped += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--pids-limit", str(DOCKER_PIDS)]
        owners = list(dict.fromkeys(o for o in (owner, os.environ.get(OWNER_ENV)) if o))
        if not owners:
            raise RuntimeError(
                "a Docker container needs an owner to remove it: pass wrap(owner=...) from "
                f"containers.owned_containers, or run under a launcher that sets {OWNER_ENV}"
            )
        for each in owners:
            wrapped += ["--label", label_of(each)]
        if gpus:
            wrapped += ["--gpus", "all"]
        if memory_bytes is not None:
            wrapped += ["--memory", str(memory_bytes)]
        if file_bytes is not None:
            wrapped += ["--ulimit", f"fsize={file_bytes}:{file_bytes}"]
        for path in SYSTEM_PATHS:
            if os.path.exists(path):
                wrapped += ["-v", f"{path}:{path}:ro"]
        for path in readonly:
            wrapped += ["-v", f"{path}:{path}:ro"]
        for path in writable:
            wrapped += ["-v", f"{path}:{path}:rw"]
        hidden, given, secrets = checkout_masks(readonly, readable, writable)  # the daemon mounts the outer first
        for path in hidden:
            wrapped += ["--tmpfs", str(path)]
        for path in given:
            wrapped += ["-v", f"{path}:{path}:ro"]
        for secret in secrets:
            wrapped += ["-v", f"/dev/null:{secret}:ro"]
        for key, value in variables.items():
            wrapped += ["-e", f"{key}={value}"]
        return wrapped + [self.docker_image] + command, {"PATH": os.environ.get("PATH", "")}
