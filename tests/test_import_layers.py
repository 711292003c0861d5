"""The package's import graph, read from the source with ``ast``: no import cycle among expq's modules (imports
inside functions count; imports under ``if TYPE_CHECKING:`` do not, as they never run), and the bytes floor
``expq/io`` imports nothing from expq but ``expq.errors``.

An edge ``a -> b`` is an import statement in module ``a`` that names module ``b``: ``from .x import y`` names
``expq.x.y`` when that is a module, else ``expq.x``. The parent packages Python imports along the way are not edges
(every module would otherwise reach ``expq/__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path


import expq

PACKAGE = Path(expq.__file__).parent


def _modules() -> dict[str, Path]:
    """Module name -> file, for every .py file under expq/."""
    mods = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = ["expq", *p.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST):
    """Every Import / ImportFrom under ``node``, at any depth, except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield from _import_nodes(ast.Module(body=[sub], type_ignores=[]))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child)


def _imported(module: str, path: Path) -> set[str]:
    """The expq modules ``module`` imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                where = ".".join(base + ([node.module] if node.module else []))
            else:
                where = node.module or ""
            names = [f"{where}.{a.name}" if f"{where}.{a.name}" in MODULES else where for a in node.names]
        out.update(n for n in names if n in MODULES and n != module)
    return out


GRAPH = {m: _imported(m, p) for m, p in MODULES.items()}


def _cycles() -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_graph_sees_deferred_and_relative_imports():
    """A negative control for the parser: imports it must see, written in the ways the package writes them."""
    assert "expq.errors" in GRAPH["expq.source"]  # module level, relative
    assert "expq.decoders" in GRAPH["expq.source"]  # inside a function (open_source)
    assert "expq.formats.base" in GRAPH["expq.formats"]  # a package __init__, relative to itself
    assert "expq.engines.clients" not in GRAPH["expq.formats.base"]  # under if TYPE_CHECKING only


def test_no_import_cycle():
    cycles = _cycles()
    assert not cycles, "import cycles among expq modules: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_cluster_does_not_import_api():
    """The --ray driver lives in cluster.py; the entry point (api) calls it, never the other way."""
    assert "expq.api" not in GRAPH["expq.cluster"]


def test_io_floor_imports_only_errors():
    floor = {m: deps for m, deps in GRAPH.items() if m == "expq.io" or m.startswith("expq.io.")}
    assert floor, "expq/io is missing"
    outside = {m: sorted(d for d in deps if not (d == "expq.errors" or d.startswith("expq.io")))
               for m, deps in floor.items()}
    assert not any(outside.values()), f"expq/io imports above its floor: {outside}"
