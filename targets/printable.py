"""Text a candidate or an agent wrote, made safe to show a person: its control characters shown as escapes
(a terminal runs them: a red team's log line moved the cursor up and erased the line above, where the
judge's verdict stood), and so are Unicode's invisible format characters and line separators (a
right-to-left override reversed the verdict beside a title; a form feed or U+2028 made ``splitlines``
break a diff's added line in two, its second half shown as unchanged code). Newlines and tabs are kept."""

from __future__ import annotations

import functools
import re
import unicodedata

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]|[^\x00-\x7f]")  # ASCII's controls, and what may be hidden
# control, format (bidi overrides, zero widths), line and paragraph separators, and lone surrogates (JSON can
# carry one: the run state could not be written with it)
_HIDDEN = ("Cc", "Cf", "Zl", "Zp", "Cs")


@functools.lru_cache(maxsize=4096)
def _shown(character: str) -> str:
    if character not in "\n\t" and unicodedata.category(character) in _HIDDEN:
        code = ord(character)
        return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
    return character


def printable(text: str) -> str:
    return _CONTROL.sub(lambda found: _shown(found.group()), text)


def indented(text: str, by: str = "    ") -> str:
    """``text`` with every line after its first indented ``by``: words an agent wrote, quoted under a label
    the harness wrote, none starting a line of their own (a commit's trailers, a line of ``show``)."""
    return text.replace("\n", "\n" + by)


def one_line(text: str) -> str:
    """``printable``, its runs of whitespace (newlines and tabs too) one space: a title, a commit's subject."""
    return " ".join(printable(text).split())
