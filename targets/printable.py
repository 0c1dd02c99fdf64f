"""Text a candidate or an agent wrote, made safe to show a person: its control characters shown as escapes
(a terminal runs them: a red team's log line moved the cursor up and erased the line above, where the
judge's verdict stood), and so are Unicode's invisible format characters and line separators (a
right-to-left override reversed the verdict beside a title; a form feed or U+2028 made ``splitlines``
break a diff's added line in two, its second half shown as unchanged code). Newlines and tabs are kept."""

from __future__ import annotations

import re
import unicodedata

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_HIDDEN = ("Cc", "Cf", "Zl", "Zp")  # control, format (bidi overrides, zero widths), line and paragraph separators


def _escaped(character: str) -> str:
    code = ord(character)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(text: str) -> str:
    if text.isascii():
        return _CONTROL.sub(lambda found: _escaped(found.group()), text)
    return "".join(_escaped(c) if c not in "\n\t" and unicodedata.category(c) in _HIDDEN else c for c in text)


def one_line(text: str) -> str:
    """``printable``, its runs of whitespace (newlines and tabs too) one space: a title, a commit's subject."""
    return " ".join(printable(text).split())
