"""The change an LLM reviewer reads: the candidate's diff against its parent, on one page of bounded size.

Whole when it fits. Else file by file in git's order, each whole while the page has room; a file too large
for the room left is shown **folded** (its added or removed lines that are blank, comment-only Python lines,
or repeats of a line the file's diff already showed, counted on a marker line instead of shown), since a
candidate that padded the file holding its hack past the page hid that file whole from a reviewer without
file access; a file still too large is named with its size and counted as **unseen**.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

from agents import workspace_git
from agents.offline.judge import first_of

DIFF_LIMIT = 40_000  # characters of diff on the page; past it, files are folded or left out
RECORDS = workspace_git.RECORD_DIR  # the run's bookkeeping in each commit (judge report, round record): not the change
HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,\d+)? @@")


@dataclass(frozen=True)
class Change:
    """The page: ``diff`` as shown, ``note`` saying what was folded or left out ("" when whole), and
    ``unseen``, the files whose diff is not on it at all."""

    diff: str
    note: str = ""
    unseen: list[str] = field(default_factory=list)


def change_of(workspace: Path, limit: int = DIFF_LIMIT) -> Change:
    """The candidate's diff against its parent commit (the run's bookkeeping aside), fitted to ``limit``."""
    workspace_git.run(workspace, "add", "-A")  # new files too (what the commit will hold); ignored ones apart
    base = ["diff", "--no-ext-diff", "--no-textconv", "--cached", "--no-renames", "HEAD"]
    full = workspace_git.output(workspace, *base, "--", ".", f":(exclude){RECORDS}")
    if len(full) <= limit:
        return Change(full or "(no change)")
    shown, folded_files, unseen, used = [], [], [], 0
    for row in workspace_git.output(workspace, *base, "--numstat", "-z", "--", ".", f":(exclude){RECORDS}").split("\0"):
        if not row:
            continue
        added, deleted, path = row.split("\t", 2)
        text = workspace_git.output(workspace, *base, "--", f":(literal){path}")
        if used + len(text) > limit:
            python = path.endswith(".py") and added not in ("0", "-")  # "-": git's count for a binary file
            source = workspace_git.output(workspace, "show", f":0:{path}") if python else ""
            text, folded_count = folded(text, comment_lines(source))
            if folded_count and used + len(text) <= limit:
                folded_files.append(f"{path} ({folded_count} of its +{added} -{deleted} lines folded)")
            else:
                unseen.append(f"{path} (+{added} -{deleted} lines, {len(text)} characters of diff even folded)")
                continue
        shown.append(text)
        used += len(text)
    note = f"The diff is {len(full)} characters, more than the {limit} this page holds. "
    if folded_files:
        note += (
            f"{len(folded_files)} file(s) are shown folded (a line marked '~' stands for that many added or removed "
            "lines, each blank, comment-only, or a repeat of a line shown above in the same file): "
            + "; ".join(first_of(folded_files))
            + ". "
        )
    if unseen:
        note += f"The diffs of {len(unseen)} file(s) are left out below: " + "; ".join(first_of(unseen)) + ". "
    return Change("\n".join(shown) or "(every file's diff was left out: see the note)", note, unseen)


def folded(text: str, comments: set[int]) -> tuple[str, int]:
    """One file's diff with its added or removed lines that are blank, comment-only (``comments``: the new
    file's line numbers of comment-only lines) or repeats of one shown before counted on a ``~`` line: the
    text, and how many lines were folded. Context lines, headers and every other line stay."""
    out: list[str] = []
    seen: set[str] = set()
    blank = repeated = total = 0
    new_line = 0

    def flush() -> None:
        nonlocal blank, repeated
        kinds = []
        if blank:
            kinds.append(f"{blank} blank or comment-only")
        if repeated:
            kinds.append(f"{repeated} repeating a line above")
        if kinds:
            out.append(f"~ {blank + repeated} line(s) folded: {', '.join(kinds)}")
        blank = repeated = 0

    for line in text.splitlines():
        hunk = HUNK.match(line)
        if hunk:
            flush()
            new_line = int(hunk.group(1))
            out.append(line)
            continue
        change = line[:1] in ("+", "-") and not line.startswith(("+++ ", "--- "))
        empty = change and (not line[1:].strip() or (line[0] == "+" and new_line in comments))
        again = change and not empty and line in seen
        if line[:1] in ("+", " "):
            new_line += 1
        if empty or again:
            blank, repeated, total = blank + empty, repeated + again, total + 1
            continue
        flush()
        if change:
            seen.add(line)
        out.append(line)
    flush()
    return "\n".join(out) + "\n", total


def comment_lines(source: str) -> set[int]:
    """The line numbers of a Python source's comment-only lines, by its own tokenizer (a ``#`` inside a
    string is no comment); none for one Python cannot tokenize. The source is the file as the diff has it
    (git's index, which the diff's new side numbers), not the working tree's."""
    found: set[int] = set()
    code: set[int] = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                found.add(token.start[0])
            elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                code.update(range(token.start[0], token.end[0] + 1))  # a string's every line is code
    except (tokenize.TokenError, SyntaxError):  # not Python as written: nothing folded as a comment
        return set()
    return found - code
