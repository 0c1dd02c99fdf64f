"""Which names in a candidate's source are Python's builtins where they run, for the integrity scan:
``compile(...)`` is the builtin that runs code from a string, unless the name is bound where it is used
(``def build(model, compile=True)``, ``from torch import compile``).

Python's own scoping, read from the source: a name bound anywhere in a function (a parameter, an
assignment, an import, a ``def``, even in a branch that never runs: using it then raises, never reaches
the builtin) is that function's, and its nested functions' unless they bind it again; a class body's
bindings hold in the class body only, not in its methods; a comprehension's targets in the
comprehension. At module level only a statement that always runs binds a name for the scan (``if
False: def exec(...)`` leaves ``exec`` the builtin; so does a ``def`` after a ``raise`` in a ``try``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def builtin_references(tree: ast.Module) -> set[int]:
    """The ``id`` of each Name node read where no scope binds its name: where it runs, the builtin."""
    found: set[int] = set()
    module = frozenset(_bound_by(tree.body, always=True))

    def visit(node: ast.AST, scopes: tuple[tuple[frozenset[str], bool], ...]) -> None:
        if isinstance(node, FUNCTIONS):
            for outer in _evaluated_outside(node):  # decorators, defaults, annotations: the enclosing scope's
                visit(outer, scopes)
            inner = (*((names, False) for names, is_class in scopes if not is_class), (_function_locals(node), False))
            for statement in node.body if isinstance(node.body, list) else [node.body]:
                visit(statement, inner)
            return
        if isinstance(node, ast.ClassDef):
            for outer in [*node.decorator_list, *node.bases, *node.keywords]:
                visit(outer, scopes)
            own = (frozenset(_bound_by(node.body, always=False)), True)
            for statement in node.body:
                visit(statement, (*scopes, own))
            return
        if isinstance(node, COMPREHENSIONS):
            targets = frozenset(n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name))
            for child in ast.iter_child_nodes(node):
                visit(child, (*scopes, (targets, False)))
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id not in module and not any(node.id in names for names, _ in scopes):
                found.add(id(node))
        for child in ast.iter_child_nodes(node):
            visit(child, scopes)

    for statement in tree.body:
        visit(statement, ())
    return found


def _evaluated_outside(function: ast.AST) -> list[ast.AST]:
    arguments = function.args
    outside: list[ast.AST] = [*arguments.defaults, *(d for d in arguments.kw_defaults if d is not None)]
    if not isinstance(function, ast.Lambda):
        outside += [*function.decorator_list, *([function.returns] if function.returns else [])]
        every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
        outside += [a.annotation for a in every if a is not None and a.annotation is not None]
    return outside


def _function_locals(function: ast.AST) -> frozenset[str]:
    """A function's own names: its parameters and every name its body binds anywhere (``global`` ones
    aside), not looking into the functions and classes it defines (their names it binds)."""
    arguments = function.args
    every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
    names = {a.arg for a in every if a is not None}
    body = function.body if isinstance(function.body, list) else [function.body]
    names |= _bound_by(body, always=False)
    declared_global = {n for s in _own_nodes(body) if isinstance(s, ast.Global) for n in s.names}
    return frozenset(names - declared_global)


def _bound_by(statements: list[ast.stmt], always: bool) -> set[str]:
    """Names the statements bind in their own scope; ``always``: only by statements that always run (those
    directly in the list, not in an ``if``, ``try``, loop or ``with``)."""
    nodes = statements if always else list(_own_nodes(statements))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) or (
            isinstance(node, (ast.For, ast.AsyncFor)) and not always  # a loop over nothing binds nothing
        ):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            names |= {
                n.id
                for item in node.items
                if item.optional_vars
                for n in ast.walk(item.optional_vars)
                if isinstance(n, ast.Name)
            }
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.Nonlocal):
            names |= set(node.names)
    return names


def _own_nodes(statements: Iterable[ast.AST]) -> Iterable[ast.AST]:
    """Every node of the statements in their own scope: not inside the functions, classes and
    comprehensions they define (a definition itself is yielded: it binds its name here)."""
    pending = list(statements)
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, (*FUNCTIONS, ast.ClassDef, *COMPREHENSIONS)):
            continue
        pending.extend(ast.iter_child_nodes(node))
