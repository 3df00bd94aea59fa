"""The graph of a package's imports of its own modules, read from the source with ``ast``, and its cycles.

Every ``import`` and ``from ... import`` of a module of the package counts, wherever it stands (module
level or inside a function), relative or absolute; those under ``if TYPE_CHECKING:`` do not (they never
run). ``from .x import y`` is an edge to the submodule ``x.y`` when there is one, else to ``x``; an
edge to a package is an edge to its ``__init__``, named like the package. Importing a submodule also
runs its parents' ``__init__`` files, but those edges are left out: they would put every package
``__init__`` that imports its own submodules on a cycle.

Run as ``python tools/import_graph.py [PACKAGE_DIR]`` (default: ``moe_fp8`` of this repository) to
print every internal import and every cycle; the exit status is 1 when there is a cycle.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["Import", "cycles", "format_cycle", "imports", "modules"]


@dataclass(frozen=True)
class Import:
    """One import of ``target`` by ``source`` (dotted module names) at ``path:line``."""

    source: str
    target: str
    path: Path
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}    ({self.path}:{self.line}: {self.text})"


def modules(package_dir: Path) -> dict[str, Path]:
    """Dotted name of every module under ``package_dir`` (a package ``__init__.py`` by its package's name)."""
    package_dir = Path(package_dir)
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(nodes: Iterable[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every ``Import`` / ``ImportFrom`` in or below ``nodes``, skipping the bodies of ``if TYPE_CHECKING:``."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse)
        else:
            yield from _import_nodes(ast.iter_child_nodes(node))


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The modules ``node`` imports, by dotted name (``from`` imports: the submodule when there is one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


def imports(package_dir: Path) -> list[Import]:
    """Every import of a module of the package by a module of the package, in file and line order
    (paths relative to the package's parent folder)."""
    package_dir = Path(package_dir)
    known = modules(package_dir)
    found = []
    for module, path in known.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source, str(path))
        for node in sorted(_import_nodes([tree]), key=lambda n: (n.lineno, n.col_offset)):
            text = " ".join(line.strip() for line in lines[node.lineno - 1 : node.end_lineno])
            for target in dict.fromkeys(_targets(node, module, path.name == "__init__.py", known)):
                if target in known:
                    found.append(Import(module, target, path.relative_to(package_dir.parent), node.lineno, text))
    return found


def _components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of the graph ``edges`` (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, result = {}, {}, set(), [], []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
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
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    result.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return result


def cycles(found: list[Import]) -> list[list[Import]]:
    """The import cycles: for each strongly connected component of more than one module, or module that
    imports itself, the imports between its members."""
    edges: dict[str, set[str]] = {}
    for imp in found:
        edges.setdefault(imp.source, set()).add(imp.target)
        edges.setdefault(imp.target, set())
    result = []
    for component in _components(edges):
        members = set(component)
        inside = [imp for imp in found if imp.source in members and imp.target in members]
        if len(component) > 1 or inside:
            result.append(inside)
    return result


def format_cycle(cycle: list[Import]) -> str:
    """The modules of ``cycle`` and, one per line, the imports that join them."""
    members = sorted({imp.source for imp in cycle})
    return "cycle among " + ", ".join(members) + ":\n" + "\n".join(f"  {imp}" for imp in cycle)


def main(argv: list[str]) -> int:
    package_dir = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "moe_fp8"
    found = imports(package_dir)
    for imp in found:
        print(imp)
    found_cycles = cycles(found)
    print(f"\n{len(found)} internal imports, {len(found_cycles)} cycle(s)")
    for cycle in found_cycles:
        print(format_cycle(cycle))
    return 1 if found_cycles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
