"""Text a candidate wrote, made safe to show a person: its control characters shown as escapes (a terminal
runs them: a red team's log line moved the cursor up and erased the line above, where the judge's verdict
stood), newlines and tabs kept."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    return _CONTROL.sub(lambda found: f"\\x{ord(found.group()):02x}", text)
