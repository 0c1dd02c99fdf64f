"""The one error of the wire: a peer sent something that is not a well-formed frame of the protocol,
or hung up. Every module of the wire raises it; nothing a candidate sends is trusted."""

from __future__ import annotations


class ProtocolError(RuntimeError):
    """A peer sent something that is not a well-formed frame of the protocol (or hung up)."""
