"""The shape of dflash/'s import graph: no cycle, and no chain of imports deeper than MAX_DEPTH.

An edge is every import of a dflash module that runs: at a module's top, or inside a function (a
lazy import is a dependency all the same, only later); and since importing dflash.a.b from outside
dflash/a runs dflash/a/__init__.py first, an edge to that package too. Imports under
`if TYPE_CHECKING:` never run and are not edges. The four command aliases (dflash/launch.py,
warm.py, fingerprint.py, responses.py) import nothing: they run the module they name as the
program (runpy), and no module imports them. A module's depth is 0 when it imports no dflash
module, else one more than the deepest module it imports; the graph's depth is its deepest
module's.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_DEPTH = 6


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of the tree except those under an `if TYPE_CHECKING:` body."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.append(child.test)
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _resolve(name: str, modules: set[str]) -> str | None:
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def import_graph(root: Path = REPO, package: str = "dflash") -> dict[str, set[str]]:
    files = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                # `from dflash.a import b` imports the module dflash.a.b where there is one.
                targets.update(f"{module}.{a.name}" for a in node.names)
                targets.add(module)
        edges = {m for t in targets if (m := _resolve(t, modules))}
        # the packages the imported modules sit in, except the importer's own (already running)
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1 + is_package)}
        edges |= {".".join(m.split(".")[:i]) for m in edges for i in range(1, m.count(".") + 1)}
        graph[name] = edges - own - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def deepest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports, from the importing module down to a module that imports none
    (an edge back into the chain being followed, a cycle, is not followed)."""
    chain: dict[str, list[str]] = {}
    open_: set[str] = set()

    def longest(v: str) -> list[str]:
        if v not in chain:
            open_.add(v)
            below = max((longest(w) for w in sorted(graph[v]) if w not in open_), key=len, default=[])
            open_.discard(v)
            chain[v] = [v, *below]
        return chain[v]

    return max((longest(v) for v in sorted(graph)), key=len)


def test_the_graph_sees_the_imports_that_run(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "leaf.py": "import os\n",
        "typed.py": "",
        "top.py": (
            "from typing import TYPE_CHECKING\nfrom pkg import leaf\n"
            "if TYPE_CHECKING:\n    from pkg.typed import T\n"
            "def f():\n    from pkg.sub.inner import g\n"
        ),
        "sub/__init__.py": "",
        "sub/inner.py": "from ..leaf import x\nfrom . import sibling\n",
        "sub/sibling.py": "import pkg.leaf\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path, "pkg")
    # lazy yes, TYPE_CHECKING no, and pkg.sub's __init__ runs first
    assert graph["pkg.top"] == {"pkg.leaf", "pkg.sub", "pkg.sub.inner"}
    assert graph["pkg.sub.inner"] == {"pkg.leaf", "pkg.sub.sibling"}
    assert graph["pkg.sub.sibling"] == {"pkg.leaf"}
    assert graph["pkg.leaf"] == graph["pkg"] == graph["pkg.sub"] == set()
    assert deepest_chain(graph) == ["pkg.top", "pkg.sub.inner", "pkg.sub.sibling", "pkg.leaf"]
    assert len(import_graph()) > 30  # and dflash/ itself is read


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, f"import cycles in dflash/: {found}; move what both sides need to a module below both"


def test_import_depth() -> None:
    chain = deepest_chain(import_graph())
    depth = len(chain) - 1
    assert depth <= MAX_DEPTH, (
        f"dflash/'s imports are {depth} levels deep (at most {MAX_DEPTH}): " + " -> ".join(chain)
    )


def test_the_checks_catch_a_cycle_and_measure_a_chain() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"d": {"e"}, "e": set(), "f": {"d", "e"}}) == []
    assert deepest_chain({"d": {"e"}, "e": set(), "f": {"d", "e"}}) == ["f", "d", "e"]
