"""The structure guard of issue 22 (docs/architecture.md): layer contracts, no import cycles,
no private names across modules, no module over 400 non-blank lines.

The layer and offline/serving contracts live in ``.importlinter`` and are checked with
import-linter (PyPI ``import-linter``); the rest is read off the same import graph (grimp,
import-linter's graph library; imports inside functions count, as in
``../shared/tools/structure.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bot", "adapters", "inference", "safety")
#: Non-blank lines a module may have (issue 22: "no module a newcomer has to scroll through").
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def test_import_contracts_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(ROOT / ".importlinter"), no_cache=True) == 0


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycles() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _strongly_connected(edges) == []


def test_no_private_names_across_modules() -> None:
    modules = _modules()
    crossings = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in PACKAGES):
                crossings += [f"{name} imports {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert crossings == []


def test_no_module_over_the_line_budget() -> None:
    long = {name: n for name, path in _modules().items()
            if (n := sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())) > MAX_LINES}
    assert long == {}
