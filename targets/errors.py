"""The one kind of error a person fixes from its message alone: a bad spec, a sandbox that cannot
run here, a run that cannot resume. Every module raises its own subclass; the command line prints
the message and exits with ``exit_code`` (2 by default: the command was asked wrongly; 1: the work
itself could not go on), never with a traceback."""

from __future__ import annotations


class UserError(Exception):
    exit_code = 2
