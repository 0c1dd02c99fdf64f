"""The house rules a newcomer relies on: imports run one way (no module imports one that imports it
back, function-local imports included), no source file grows past 600 lines, the README stays a guide
whose every path exists, and the code cites its own docs, never a document outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestrator", "agents", "skills", "targets")
LAYERS = {"targets": 0, "skills": 1, "agents": 2, "orchestrator": 3}  # a package imports only lower layers


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Every project module each module imports when it runs (a ``TYPE_CHECKING`` block never runs)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for statement in block.body
            for node in ast.walk(statement)
        }
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets |= {t for a in node.names if (t := resolve(a.name))}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = name.split(".")
                    package = package[: len(package) - node.level + (1 if path.name == "__init__.py" else 0)]
                    base = ".".join([*package, *([node.module] if node.module else [])])
                targets |= {t for a in node.names if (t := resolve(f"{base}.{a.name}") or resolve(base))}
        graph[name] = targets - {name}
    return graph


def test_no_module_imports_one_that_imports_it_back():
    graph = _imports(_modules())
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_imports_run_down_the_layers():
    graph = _imports(_modules())
    upward = [
        f"{m} imports {t}"
        for m, targets in graph.items()
        for t in targets
        if LAYERS[t.split(".")[0]] > LAYERS[m.split(".")[0]]
    ]
    assert not upward, upward


def test_no_source_file_over_600_lines():
    long = [
        f"{path.relative_to(ROOT)}: {n}"
        for package in (*PACKAGES, "benchmarks")
        for path in (ROOT / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 600
    ]
    assert not long, long


def test_the_readme_is_a_guide_whose_paths_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    named = set(re.findall(r"`((?:docs|benchmarks|orchestrator|agents|skills|targets|tests|\.ci)/[\w./-]*)`", readme))
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert named and not missing, missing
    for doc in re.findall(r"`(docs/[\w-]+\.md)`", readme):
        for cited in re.findall(
            r"`((?:orchestrator|agents|skills|targets|tests|benchmarks)/[\w/.]+\.(?:py|md))`", (ROOT / doc).read_text()
        ):
            assert (ROOT / cited).exists(), f"{doc} names {cited}, which does not exist"


def test_code_cites_the_repositorys_docs_never_an_outside_document():
    outside = re.compile(r"design (§|check \d)|DESIGN §|shared/DESIGN|\.\./shared")
    cited = [
        f"{path.relative_to(ROOT)}:{i}"
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        for i, line in enumerate(path.read_text().splitlines(), start=1)
        if outside.search(line)
    ]
    assert not cited, cited
