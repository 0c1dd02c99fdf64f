"""Integrity (docs/judge.md, before anything runs). From the candidate's source, every file of it (its root is on
``sys.path``, so code beside ``stack/`` is the stack's too): it imports only ``targets.api`` from the contract, by
no route (not ``from targets import harness``, not an attribute of the package); it does not name the harness's
metrics (metrics come from the harness trace; a stack that computes them is reporting its own); it does not patch
clocks (``time``, ``asyncio``, ``datetime``) or reach past the harness's proxies it is handed into their channel
(``cluster._calls``, ``getattr`` by a constant name included, on any object); it uses no
introspection escape hatches (``gc``, ``inspect``, ``ctypes``, ``sys.modules``, ``__dict__``/``__globals__``,
``vars()``, frames) and runs no code it cannot read (``exec``/``eval``/``compile``, a module loaded from a file,
code in bytes: ``pickle``, ``marshal``); it holds no compiled module without its source (a ``.pyc`` or extension
module Python would import but this scan cannot read) and no archive Python imports from, and it does not change
``sys.path``. A function the scan reads by its calls, or a module it follows by its imports, is not handed on as a
value, and a name spelled in constant pieces (``"__sub" + "classes__"``) is read whole. A module is followed through
the names an import binds it to (``import time as t``), and ``__import__`` or ``importlib.import_module`` is an
import like any other (of a computed name: refused). Around a run: the harness's own files, its bytecode caches
included, hash the same before and after (``harness_digest``), none added or removed."""

from __future__ import annotations

import ast
import compileall
import hashlib
import io
import threading
import tokenize
from dataclasses import dataclass
from pathlib import Path

from targets.harness.judge.builtin_names import builtin_references
from targets.harness.judge.check_result import CheckResult
from targets.spec.target import HEADLINE_METRICS

CLOCK_MODULES = {"time", "asyncio", "datetime"}
# the private state of the harness's objects in a candidate's process (candidate_process.py's proxies): the
# channel behind them, the prompts they have sent, the call that sends any method; every other name is the
# candidate's own to use
HARNESS_ATTRIBUTES = {"_calls", "_memory", "_call"}
ESCAPE_MODULES = {
    *("gc", "inspect", "ctypes", "_ctypes", "builtins", "runpy", "site", "code", "codeop", "_imp", "zipimport"),
    # code in bytes: an unpickled object is any call, an unmarshalled code object any code
    *("marshal", "pickle", "_pickle", "cloudpickle", "dill", "shelve", "copyreg", "joblib"),
    # a module by a string (pydoc.locate), and patching by a string (unittest.mock.patch("time.monotonic"))
    *("pydoc", "unittest"),
}
ESCAPE_ATTRIBUTES = {
    *("__dict__", "__globals__", "__code__", "__closure__", "__builtins__", "__subclasses__", "__getattribute__"),
    *("modules", "_getframe", "_current_frames", "f_globals", "f_locals", "f_back", "f_builtins"),
    *("walk_stack", "walk_tb", "tb_frame", "gi_frame", "cr_frame", "ag_frame", "settrace", "setprofile"),
    *("FunctionType", "CodeType", "meta_path", "path_hooks", "path_importer_cache", "sys", "__path__"),
    *("_bootstrap", "_bootstrap_external", "ForkingPickler", "read_pickle"),
    *("__getstate__", "__reduce__", "__reduce_ex__"),  # an object's state as a mapping, its slots included
    # a module by a string (pkgutil), an attribute path in a string (string.Formatter's get_field), a task's frames
    *("resolve_name", "Formatter", "get_stack"),
}
# an escape's name as a string, for a getattr or a subscript of globals() (``"__sub" + "classes__"`` too)
ESCAPE_STRINGS = {a for a in ESCAPE_ATTRIBUTES if a.startswith(("__", "f_"))} | {"__import__"}
UNREADABLE_CODE = {"exec", "eval", "compile"}  # code in a string: what it imports or patches is not source here
# functions whose every call the scan reads: handed on as a value, where they are called is not in sight
CALLED_ONLY = {*UNREADABLE_CODE, "vars", "__import__", "getattr", "setattr", "delattr", "import_module"}
PATH_MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__", "__iadd__"}
IMPORT_MACHINERY = {"_bootstrap", "_bootstrap_external"}  # importlib's loaders, by module
UNPICKLING_SWITCHES = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD"}
FILE_LOADERS = {
    *("exec_module", "load_module", "spec_from_file_location", "SourceFileLoader", "SourcelessFileLoader"),
    *("ExtensionFileLoader", "PathFinder", "FileFinder", "find_spec_from_path"),
}
HARNESS_ROOT = Path(__file__).resolve().parents[2]  # the targets package
METRIC_NAMES = {*HEADLINE_METRICS, "timeout_ratio", "device_utilization", "mean_device_busy"}
CONTRACT_MODULE = "targets.api"  # the one module of the ``targets`` package a stack may import
COMPILED_SUFFIXES = {".pyc", ".pyo", ".pyd", ".so"}  # importable, but not source this scan can read
ARCHIVE_SUFFIXES = {".zip", ".egg", ".whl", ".pyz", ".pth"}  # modules (or paths) Python imports from, unread here
# CPython 3.11 keeps ast.parse's recursion depth in module-wide state: two threads parsing at once (a
# simulated bench scans its stacks in parallel) can raise "SystemError: AST constructor recursion depth
# mismatch" when a garbage collection runs Python finalizers mid-parse (CPython gh-106905).
AST_PARSE_LOCK = threading.Lock()


def candidate_files(stack_dir: Path) -> list[Path]:
    """Every file of the candidate, not only ``stack/``: a measured run runs ``stack/`` alone (``staging.py``),
    but a benchmark's ``run_harness`` puts the root on ``sys.path``, where a module beside ``stack/`` would run
    as the stack's own code. Git's link or folder and bytecode caches (removed before every run) aside."""
    return sorted(
        path
        for path in stack_dir.rglob("*")
        if path.is_file() and not {".git", "__pycache__"} & set(path.relative_to(stack_dir).parts)
    )


def parse_source(source: str | bytes, filename: str) -> ast.Module:
    """``ast.parse``, one thread at a time (see ``AST_PARSE_LOCK``). Bytes are decoded as Python decodes a
    file it imports: by the encoding the file declares (PEP 263), else UTF-8."""
    with AST_PARSE_LOCK:
        return ast.parse(source, filename=filename)


def scan_stack(stack_dir: Path) -> CheckResult:
    files = candidate_files(stack_dir)
    reasons = [
        f"{path.relative_to(stack_dir)}: compiled code with no source: Python would import it, but the "
        "integrity scan reads source only"
        for path in files
        if path.suffix in COMPILED_SUFFIXES
    ] + [
        f"{path.relative_to(stack_dir)}: an archive Python can import modules from, which the integrity scan "
        "does not read"
        for path in files
        if path.suffix in ARCHIVE_SUFFIXES
    ]
    for path in (p for p in files if p.suffix == ".py"):
        if (size := path.stat().st_size) > MAX_SOURCE_BYTES:  # parsed, it would take ~600 times that in memory
            reasons.append(
                f"{path.relative_to(stack_dir)}: {size} bytes of source, over the {MAX_SOURCE_BYTES} the scan reads"
            )
            continue
        reasons += source_reasons(path.read_bytes(), str(path.relative_to(stack_dir)))
    return CheckResult("integrity", not reasons, reasons, {})


MAX_SOURCE_BYTES = 1 << 20  # a Python file of a stack, at most: written by hand or agent, never generated data


SCANNED_FILES = 4096  # files whose findings are kept (by digest) before the record starts again
_scanned: dict[tuple[bytes, str], tuple[str, ...]] = {}  # (sha256 of a file's bytes, its path) -> its findings


def source_reasons(source: bytes, where: str) -> tuple[str, ...]:
    """What one file does that a stack must not, each said with its line, read from its bytes as Python
    would import them (a file declaring ``utf_7`` hides a line from a UTF-8 reading). Kept for the process
    by the bytes' digest: a run's rounds and a bench's stacks share most of their files, and a stack's
    files are scanned again before each of its runs (a scan of the starter: ~1 s)."""
    key = (hashlib.sha256(source).digest(), where)
    if key not in _scanned:
        if len(_scanned) >= SCANNED_FILES:
            _scanned.clear()
        _scanned[key] = _file_reasons(source, where)
    return _scanned[key]


UTF8_ENCODINGS = ("utf-8", "utf-8-sig", "ascii")  # what a reader (the review page, read_file) decodes alike


def _file_reasons(source: bytes, where: str) -> tuple[str, ...]:
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
        if encoding not in UTF8_ENCODINGS:  # utf_7 hid a line of code from a UTF-8 reading of the review page
            return (
                f"{where}: declares the encoding {encoding}: a stack's source is UTF-8, as its reviewers read it "
                "(a line Python decodes as code may read as a comment in another)",
            )
        return _tree_reasons(parse_source(source, where), where)
    except SyntaxError as error:  # undecodable bytes and null bytes too: Python would not import it either
        line = f":{error.lineno}" if error.lineno else ""
        return (f"{where}{line}: syntax error: {error.msg}",)
    except RecursionError:  # a sum of a thousand strings compiles, and the scan's walk recurses into it
        return (f"{where}: nested too deep for the scan to read",)


def _tree_reasons(tree: ast.Module, where: str) -> tuple[str, ...]:
    bound = _module_names(tree)  # ``import time as t``: t is the time module wherever it is used
    file = FileNames(
        bound,
        builtin_references(tree),  # ``from torch import compile``, ``def f(compile=True)``: not the builtin there
        _imported_names(tree),
        {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)},
        {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)},
    )
    return tuple(f"{where}:{node.lineno}: {r}" for node in ast.walk(tree) for r in _node_reasons(node, file))


@dataclass(frozen=True)
class FileNames:
    """What the checks of one node need to know of its file: ``bound``, each name an import binds a
    module to; ``builtins``, the Name nodes that are Python's builtin of their name where they run
    (``builtin_names.py``); ``imported``, the names an ``import`` statement binds; ``called`` and ``bases``, the
    nodes called and the nodes an attribute is read off (by ``id``)."""

    bound: dict[str, str]
    builtins: set[int]
    imported: set[str]
    called: set[int]
    bases: set[int]


def _node_reasons(node: ast.AST, file: FileNames) -> list[str]:
    """What one node of the candidate's source does that a stack must not, each said."""
    bound = file.bound
    reasons: list[str] = []
    modules: list[str] = []
    if isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        # ``from targets import harness`` imports targets.harness: each name is a module there
        modules = [f"targets.{a.name}" for a in node.names] if node.module == "targets" else [node.module]
        if node.module == "sys" and any(alias.name == "modules" for alias in node.names):
            reasons.append("imports sys.modules, an introspection escape hatch")
        modules += [f"{node.module}.sys" for a in node.names if a.name == "sys" and node.module != "sys"]  # os's
        reasons += [  # an escape by its name as imported (``from string import Formatter``), not as an attribute
            f"imports {node.module}.{a.name}, an introspection escape hatch"
            for a in node.names
            if a.name in ESCAPE_ATTRIBUTES - {"sys", "modules"}
        ]
    elif isinstance(node, ast.Call) and _imports_by_call(node, bound):
        name = _folded(node.args[0]) if node.args else None
        if _relative(node):
            reasons.append("imports a module relative to a package: the scan cannot read which")
        elif name is not None:
            modules = [name]  # an import all the same: the same rules
        else:
            reasons.append("imports a module by a computed name: the scan cannot read which")
    for module in modules:
        if module.split(".")[0] == "targets" and module != CONTRACT_MODULE:
            reasons.append(f"imports harness internals ({module}); only targets.api is public")
        parts = set(module.split("."))
        if module.split(".")[0] in ESCAPE_MODULES or module.endswith(".sys") or parts & IMPORT_MACHINERY:
            reasons.append(f"imports {module}, an introspection escape hatch")
    reached = _package_attribute(node, bound)
    if reached is not None:  # the package's attributes are every submodule loaded in the process
        reasons.append(
            f"imports harness internals (targets.{reached}, an attribute of the package); only targets.api is public"
        )
    builtin = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and id(node.func) in file.builtins
    if builtin and node.func.id in UNREADABLE_CODE:
        reasons.append(f"runs code by {node.func.id}(), which the scan cannot read")
    if builtin and node.func.id == "vars":
        reasons.append("uses vars(), an introspection escape hatch (an object's __dict__)")
    reasons += _handed_on(node, file)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "setattr", "delattr")
        and (any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords))
    ):
        reasons.append(f"calls {node.func.id} with unpacked arguments: the scan cannot read on what")
    whole = isinstance(node, (ast.Constant, ast.BinOp)) or isinstance(node, ast.JoinedStr) and len(node.values) > 1
    text = _folded(node) if whole else None
    if text in ESCAPE_STRINGS:
        reasons.append(f"names {text!r}, an introspection escape hatch")
    if text in METRIC_NAMES and not isinstance(node, ast.Constant):
        reasons.append(f"names the harness metric {text!r}: a stack must not report its own metrics")
    if isinstance(node, ast.keyword) and node.arg in METRIC_NAMES:
        reasons.append(f"names the harness metric {node.arg!r}: a stack must not report its own metrics")
    if isinstance(node, ast.keyword) and node.arg == "weights_only" and not _constant(node.value, True):
        reasons.append("unpickles by torch.load(weights_only=...): an unpickled object is code the scan cannot read")
    if isinstance(node, ast.keyword) and node.arg == "allow_pickle" and not _constant(node.value, False):
        reasons.append("unpickles by allow_pickle: an unpickled object is code the scan cannot read")
    if isinstance(node, ast.Call) and _called_name(node) == "load" and any(k.arg is None for k in node.keywords):
        reasons.append("calls load with unpacked keywords: the scan cannot read whether it unpickles")
    if text in UNPICKLING_SWITCHES:
        reasons.append(f"names {text}: an unpickled object is code the scan cannot read")
    reasons += _import_path_changes(node, bound)
    if isinstance(node, ast.Attribute) and node.attr in FILE_LOADERS:
        reasons.append(f"loads a module from a file (.{node.attr}): the scan cannot follow which")
    if isinstance(node, ast.Name) and node.id == "__builtins__":
        reasons.append("uses __builtins__, an introspection escape hatch")
    if isinstance(node, ast.Name) and node.id == "__path__":  # a package's own import path
        reasons.append("uses __path__: the modules it then imports are not those the scan read")
    if isinstance(node, ast.ImportFrom) and any(a.name in FILE_LOADERS for a in node.names):
        reasons.append("imports a module loader: the scan cannot follow which module it loads")
    for named, owner, call in _attributes_read(node):  # getattr(cluster, "_calls") is ._calls
        if named in HARNESS_ATTRIBUTES:  # on any object: ``self`` is whatever a function is handed (a proxy, too)
            shown = f".{named}" if call is None else f"{call} of {named!r}"
            reasons.append(
                f"reaches into a harness object ({shown}): the proxy and environments are opaque "
                "(an attribute of the stack's own by that name: rename it)"
            )
        # .modules only on the sys module (by any name): other objects have attributes of that name
        if named in ESCAPE_ATTRIBUTES and (named != "modules" or _on_sys(owner, bound)):
            reasons.append(f"uses .{named}, an introspection escape hatch" + ("" if call is None else f" (by {call})"))
    reasons += _patching(node, bound)
    if isinstance(node, ast.Constant) and node.value in METRIC_NAMES:
        reasons.append(f"names the harness metric {node.value!r}: a stack must not report its own metrics")
    if isinstance(node, ast.Name) and node.id in METRIC_NAMES:
        reasons.append(f"defines or uses {node.id!r}, a harness metric name: a stack must not report its own metrics")
    return reasons


def _imported_names(tree: ast.Module) -> set[str]:
    """The names ``import`` statements bind (``import time``: time; ``import a.b``: a)."""
    return {
        alias.asname or alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }


def _folded(node: ast.AST) -> str | None:
    """A string the source spells out, whole or in constant pieces (``"__sub" + "classes__"``, an f-string
    of constants); None when any piece is computed."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _folded(node.left), _folded(node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.JoinedStr):
        parts = [_folded(v) for v in node.values]
        return None if None in parts else "".join(parts)
    return None


def _called_name(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _constant(node: ast.AST, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _relative(node: ast.Call) -> bool:
    """An import by call relative to a package: ``import_module(".x", "targets")``, ``__import__(n, g, l,
    f, 1)``: the module is not the name the call spells."""
    name = _folded(node.args[0]) if node.args else None
    level = node.args[4] if len(node.args) > 4 else next((k.value for k in node.keywords if k.arg == "level"), None)
    package = (
        len(node.args) > 1 and _called_name(node) != "__import__" or any(k.arg == "package" for k in node.keywords)
    )
    level_set = level is not None and not (
        isinstance(level, ast.Constant) and type(level.value) is int and not level.value
    )
    return bool(name and name.startswith(".")) or package or level_set


def _handed_on(node: ast.AST, file: FileNames) -> list[str]:
    """A function whose calls the scan reads, or a module it follows by name, handed on as a value
    (``load = importlib.import_module``, ``run = eval``, ``clock = time``): where it is then used is not
    in sight."""
    if id(node) in file.called:
        return []
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
        if file.bound.get(node.id) == "importlib.import_module" or (
            node.id in CALLED_ONLY and id(node) in file.builtins
        ):
            return [f"hands {node.id} on as a value: the scan reads only its calls"]
        module = file.bound.get(node.id, "").split(".")[0]
        if node.id in file.imported and module in (*CLOCK_MODULES, "sys", "importlib") and id(node) not in file.bases:
            return [f"hands the {module} module on as a value: the scan follows a module only through its imports"]
    if isinstance(node, ast.Attribute) and node.attr in ("import_module", "__import__"):
        return [f"hands .{node.attr} on as a value: the scan reads only its calls"]
    return []


def _import_path_changes(node: ast.AST, bound: dict[str, str]) -> list[str]:
    """Changes to ``sys.path`` (by any name: ``from sys import path``): a folder put there imports its
    modules under names the scan does not know (the harness's own, as top-level modules); and the list
    handed on (``p = sys.path``, ``list.insert(sys.path, ...)``), changed where the scan cannot see."""

    def sys_path(target: ast.AST) -> bool:
        if isinstance(target, ast.Subscript):
            target = target.value
        if isinstance(target, ast.Name):
            return bound.get(target.id) == "sys.path"
        return isinstance(target, ast.Attribute) and target.attr == "path" and _on_sys(target.value, bound)

    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
        if sys_path(node.value) and not isinstance(node.value, ast.Subscript):
            return ["hands sys.path on as a value: the scan cannot see it changed"]
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute) and node.func.attr in PATH_MUTATORS:
            targets = [node.func.value]
        if any(
            sys_path(a) and not isinstance(a, ast.Subscript) for a in [*node.args, *(k.value for k in node.keywords)]
        ):
            return ["hands sys.path on as a value: the scan cannot see it changed"]
    return (
        ["changes sys.path: the modules it then imports are not those the scan read"]
        if any(sys_path(t) for t in targets)
        else []
    )


def _module_names(tree: ast.Module) -> dict[str, str]:
    """Each name a module is bound to by an import (``import time as t``: t -> time; ``from os import
    sys``: sys), and the modules' own names: what the checks below look through."""
    names = {module: module for module in (*CLOCK_MODULES, "sys", "importlib")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                names[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if node.module == "importlib" and alias.name in ("import_module", "__import__"):
                    names[alias.asname or alias.name] = "importlib.import_module"
                elif alias.name in ("sys", *CLOCK_MODULES):  # a module another module holds
                    names[alias.asname or alias.name] = alias.name
                elif node.module == "sys" and alias.name == "path":
                    names[alias.asname or alias.name] = "sys.path"
        elif (  # t = __import__("time"), t = importlib.import_module("time"): t is the module
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
            and _called_name(node.value) in ("__import__", "import_module")
            and node.value.args
            and (module := _folded(node.value.args[0])) is not None
        ):
            names[node.targets[0].id] = module
    return names


def _package_attribute(node: ast.AST, bound: dict[str, str]) -> str | None:
    """The attribute read off the ``targets`` package, other than ``api``: by a name an import bound to
    it (``import targets.api`` binds ``targets``), or off the package ``__import__`` returns for any of
    its modules (``__import__("targets.api").harness``), or by a constant name (``getattr(targets, "harness")``)."""
    if isinstance(node, ast.Call) and _called_name(node) == "getattr" and len(node.args) > 1:
        named = _folded(node.args[1])
        owner = node.args[0]
        if named not in (None, "api") and isinstance(owner, ast.Name) and bound.get(owner.id) == "targets":
            return named
        return None
    if not isinstance(node, ast.Attribute) or node.attr == "api":
        return None
    value = node.value
    if isinstance(value, ast.Name) and bound.get(value.id) == "targets":
        return node.attr
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "__import__"
        and value.args
        and isinstance(value.args[0], ast.Constant)
        and str(value.args[0].value).split(".")[0] == "targets"
    ):
        return node.attr
    return None


def _attributes_read(node: ast.AST) -> list[tuple[str, ast.AST | None, str | None]]:
    """The attributes a node reads, each as (name, the object it is read off where known, the call that
    names it): ``x._calls``; by a constant string, ``getattr(x, "_calls")`` (and ``setattr``/``delattr``/
    ``hasattr``), ``operator.attrgetter("a.b")`` (each part), ``methodcaller``'s method. A computed name is
    not followed (the engine's ``getattr(torch, dtype)``): isolation holds there."""
    if isinstance(node, ast.Attribute):
        return [(node.attr, node.value, None)]
    if not isinstance(node, ast.Call):
        return []
    func, name = node.func, _called_name(node)
    owner = None
    if name in ("getattr", "setattr", "delattr", "hasattr") and isinstance(func, ast.Name):
        named, owner = node.args[1:2], (node.args[0] if node.args else None)  # (object, name, ...)
    elif name == "attrgetter":
        named = node.args
    elif name == "methodcaller":
        named = node.args[:1]
    else:
        return []
    return [(part, owner, name) for arg in named if (folded := _folded(arg)) is not None for part in folded.split(".")]


def _module_named(value: ast.AST | None, bound: dict[str, str]) -> str:
    """The module ``value`` is, where the source says: a name bound to one, or an import call's result
    (``__import__("sys")``, ``importlib.import_module("time")``); "" otherwise."""
    if isinstance(value, ast.Name):
        return bound.get(value.id, "")
    if isinstance(value, ast.Call) and _imports_by_call(value, bound) and value.args:
        return _folded(value.args[0]) or ""
    return ""


def _on_sys(value: ast.AST | None, bound: dict[str, str]) -> bool:
    return _module_named(value, bound) == "sys"


def _imports_by_call(node: ast.Call, bound: dict[str, str]) -> bool:
    """``__import__(...)``, ``importlib.import_module(...)`` (through any name they are bound to)."""
    func = node.func
    if isinstance(func, ast.Name):
        return func.id == "__import__" or bound.get(func.id) == "importlib.import_module"
    return (
        isinstance(func, ast.Attribute)
        and func.attr in ("import_module", "__import__")
        and isinstance(func.value, ast.Name)
        and bound.get(func.value.id) == "importlib"
    )


def _patching(node: ast.AST, bound: dict[str, str]) -> list[str]:
    """Assignments to (or setattr/delattr on) a clock module's attributes, by whatever name it is bound to."""

    def clock_attribute(target: ast.AST) -> bool:
        return isinstance(target, ast.Attribute) and _module_named(target.value, bound).split(".")[0] in CLOCK_MODULES

    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    found = [f"patches the clock ({ast.unparse(t)})" for t in targets if clock_attribute(t)]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("setattr", "delattr")
        and node.args
        and _module_named(node.args[0], bound).split(".")[0] in CLOCK_MODULES
    ):
        found.append(f"patches the clock ({node.func.id} on {ast.unparse(node.args[0])})")
    return found


def compile_harness() -> None:
    """The harness package's bytecode cache, written before a run (nothing to do once it is), so that
    an honest run writes none of it and a bytecode file that changed during the run is a plant: a
    forged ``.pyc`` whose header matches its source's is imported in place of the source. Where the
    package cannot be written (installed read-only), neither can a candidate write there."""
    compileall.compile_dir(HARNESS_ROOT, quiet=2)


def harness_digest() -> dict[str, str]:
    """sha256 of every file of the harness package, by relative path: its sources and catalog, and what
    Python would import instead of a source (an extension module beside it, its bytecode cache)."""
    digests = {}
    for path in sorted(HARNESS_ROOT.rglob("*")):
        if path.is_file():
            digests[str(path.relative_to(HARNESS_ROOT))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def harness_changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What a run did to the harness's files: each changed, added or removed, by relative path."""
    changed = [f"{name} changed" for name in sorted(before.keys() & after.keys()) if before[name] != after[name]]
    added = [f"{name} added" for name in sorted(after.keys() - before.keys())]
    return changed + added + [f"{name} removed" for name in sorted(before.keys() - after.keys())]
