"""Where the ranks of a process group meet: a TCP key-value store held by the process that forms the group.

Picking a free port, closing it and handing it to rank 0 to bind races every other process on the
machine for it: Ray opens connections all the while, each from an ephemeral port, and a trainer rank
once failed with EADDRINUSE that way. This store binds port 0, so the kernel picks the port and holds
it in one step, and every rank connects as a client. One store serves all of a cluster's groups (the
trainer's, the weight broadcast's), each under its own prefix; it must outlive them (NCCL forms its
communicators on the first collective, through the store).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

TIMEOUT = timedelta(minutes=30)  # how long a rank waits for the others (as init_process_group's own default)


class Rendezvous:
    """The store, on an address ("host:port") to hand to the ranks; it lives as long as this object."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._store = dist.TCPStore(host, 0, None, True, wait_for_workers=False)
        self.address = f"{host}:{self._store.port}"


def connect(address: str, group: str) -> dist.Store:
    """A client of the store at ``address``, its keys under ``group``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a rendezvous address is host:port, got {address!r}")
    return dist.PrefixStore(f"{group}/", dist.TCPStore(host, int(port), None, False, timeout=TIMEOUT))
