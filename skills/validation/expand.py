"""Expand validation annotations into real checks.

A line ``# VAL: <PATTERN> (<arg>=<python expr>, ...)`` names a check; ``expand_source`` replaces
it with the pattern's one standard expansion (a jinja2 template below), indented like the
annotation and marked ``# VAL expanded: ...`` so a reader sees where it came from. Without a
``value=`` argument the check applies to the variable assigned on the next line, right after it.
An expansion longer than ten lines becomes a module-level ``_validate_*`` function and a call.
The judge fails a candidate with any annotation left unexpanded (``unexpanded``).
"""

from __future__ import annotations

import ast
import builtins
import functools
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import jinja2

ANNOTATION = re.compile(r"^(?P<indent>[ \t]*)#\s*VAL:\s*(?P<pattern>[A-Z_]+)\s*\((?P<args>.*)\)\s*$")
LOOSE_ANNOTATION = re.compile(r"#\s*VAL:")
MAX_INLINE_LINES = 10


class AnnotationError(ValueError):
    """An annotation that cannot be expanded; the message names the file, line and reason."""


@dataclass(frozen=True)
class Pattern:
    name: str
    required: tuple[str, ...]
    doc: str
    template: str


_ENV = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False, autoescape=False)

PATTERNS: dict[str, Pattern] = {
    p.name: p
    for p in [
        Pattern(
            "VAL_INT_RANGE",
            ("value", "min", "max"),
            "an int within [min, max] (a bool is no int here: True is no count)",
            """\
if isinstance({{ value }}, bool) or not isinstance({{ value }}, int) or not ({{ min }} <= {{ value }} <= {{ max }}):
    raise ValueError("{{ value_text }} must be an int in [{{ min_text }}, {{ max_text }}] = [%r, %r], got %r" % ({{ min }}, {{ max }}, {{ value }}))""",
        ),
        Pattern(
            "VAL_NON_EMPTY",
            ("value",),
            "a non-empty collection or string",
            """\
if not {{ value }}:
    raise ValueError("{{ value_text }} must not be empty, got %r" % ({{ value }},))""",
        ),
        Pattern(
            "VAL_SUBSET",
            ("value", "of"),
            "every element of value is in `of`",
            """\
_missing = [_x for _x in {{ value }} if _x not in {{ of }}]
if _missing:
    raise ValueError("{{ value_text }} must be a subset of {{ of_text }} = %r; not in it: %r" % (sorted({{ of }}, key=repr), _missing))""",
        ),
        Pattern(
            "VAL_NO_DUPLICATES",
            ("value",),
            "no element twice (the error lists each duplicate, its count and first positions)",
            """\
_seen: dict = {}
for _position, _x in enumerate({{ value }}):
    _seen.setdefault(_x, []).append(_position)
_duplicates = {_x: _positions for _x, _positions in _seen.items() if len(_positions) > 1}
if _duplicates:
    _report = "; ".join(
        "%r x%d at %r" % (_x, len(_positions), _positions[:3])
        for _x, _positions in sorted(_duplicates.items(), key=lambda item: item[1][0])
    )
    raise ValueError(
        "{{ value_text }} must not repeat elements: %s" % _report
    )""",
        ),
        Pattern(
            "AST_PRECONDITION",
            ("cond",),
            "a condition that must hold before the code below",
            """\
if not ({{ cond }}):
    raise AssertionError("precondition failed: {{ cond_text }}")""",
        ),
        Pattern(
            "AST_POSTCONDITION",
            ("cond",),
            "a condition that must hold after the code above",
            """\
if not ({{ cond }}):
    raise AssertionError("postcondition failed: {{ cond_text }}")""",
        ),
    ]
}


def _arguments(text: str, where: str) -> dict[str, str]:
    try:
        call = ast.parse(f"f({text})", mode="eval").body
    except SyntaxError as error:
        raise AnnotationError(f"{where}: arguments are not valid Python ({error.msg}): ({text})") from None
    if call.args:
        raise AnnotationError(f"{where}: arguments must be named (arg=expression), got ({text})")
    source = f"f({text})"
    return {k.arg: ast.get_source_segment(source, k.value) for k in call.keywords}


def _free_names(expressions) -> list[str]:
    """Names the expressions read from their scope: what a ``_validate_*`` function takes."""
    loaded, bound = set(), set()
    for expression in expressions:
        for node in ast.walk(ast.parse(expression, mode="eval")):
            if isinstance(node, ast.Name):
                (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
    return sorted(loaded - bound - set(dir(builtins)))


def _assigned_name(line: str, where: str) -> str:
    try:
        node = ast.parse(line.strip()).body[0]
    except (SyntaxError, IndexError):
        node = None
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if len(targets) == 1 and isinstance(targets[0], ast.Name):
            return targets[0].id
    raise AnnotationError(f"{where}: no value= given and the next line is not a simple assignment: {line.strip()!r}")


def _quoted(text: str) -> str:
    """An expression's text inside a double-quoted %-formatted string literal."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")


@functools.lru_cache(maxsize=256)
def expand_source(source: str, filename: str = "<source>") -> tuple[str, int]:
    """Returns the expanded source and how many annotations were expanded. A function of its arguments
    alone, kept for the process: every starter written expands the same recipes (~0.2 s a stack)."""
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    functions: list[str] = []
    count = 0
    i = 0
    while i < len(lines):
        match = ANNOTATION.match(lines[i].rstrip("\n"))
        if not match:
            if LOOSE_ANNOTATION.search(lines[i]) and lines[i].lstrip().startswith("#"):
                raise AnnotationError(
                    f"{filename}:{i + 1}: malformed annotation (expected '# VAL: PATTERN (arg=expr, ...)'): {lines[i].strip()}"
                )
            out.append(lines[i])
            i += 1
            continue
        where = f"{filename}:{i + 1}"
        indent, name = match["indent"], match["pattern"]
        if name not in PATTERNS:
            raise AnnotationError(f"{where}: unknown pattern {name}; known: {', '.join(PATTERNS)}")
        pattern = PATTERNS[name]
        args = _arguments(match["args"], where)
        carried: list[str] = []
        if "value" in pattern.required and "value" not in args:
            if i + 1 >= len(lines):
                raise AnnotationError(f"{where}: no value= given and nothing follows the annotation")
            args["value"] = _assigned_name(lines[i + 1], where)
            carried = [lines[i + 1]]  # the assignment stays first; the check follows it
        missing = [a for a in pattern.required if a not in args]
        unknown = [a for a in args if a not in pattern.required]
        if missing or unknown:
            raise AnnotationError(
                f"{where}: {name} takes {list(pattern.required)}; missing {missing}, unknown {unknown}"
            )
        context = {**args, **{f"{k}_text": _quoted(v) for k, v in args.items()}}
        body = _ENV.from_string(pattern.template).render(context)
        count += 1
        marker = f"{indent}# VAL expanded: {name} ({match['args']})\n"
        if len(body.splitlines()) > MAX_INLINE_LINES:
            function = f"_validate_{name.lower()}_{count}"
            names = _free_names(args.values())
            functions.append(
                f'\n\ndef {function}({", ".join(names)}) -> None:\n    """{pattern.doc} ({name}, from {where})."""\n'
                + textwrap.indent(body, "    ")
                + "\n"
            )
            out += carried + [marker, f"{indent}{function}({', '.join(names)})\n"]
        else:
            out += carried + [marker] + [indent + line + "\n" for line in body.splitlines()]
        i += 1 + len(carried)
    expanded = "".join(out)
    if functions:
        expanded = expanded.rstrip("\n") + "\n" + "".join(functions)
    try:
        ast.parse(expanded, filename=filename)
    except SyntaxError as error:
        raise AnnotationError(
            f"{filename}: the expanded code does not parse ({error.msg} at line {error.lineno})"
        ) from None
    return expanded, count


def expand_file(path: Path, root: Path) -> int:
    """Expands ``path`` in place; its functions name it relative to ``root`` (the workspace), so a
    round's diff does not change where an unchanged check came from."""
    expanded, count = expand_source(path.read_text(), str(path.relative_to(root)))
    if count:
        path.write_text(expanded)
    return count


def unexpanded(root: Path) -> list[str]:
    """``file:line: text`` for every annotation left in the Python files under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if LOOSE_ANNOTATION.search(line) and line.lstrip().startswith("#"):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found
