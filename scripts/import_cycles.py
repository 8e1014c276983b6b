#!/usr/bin/env python3
"""Count import cycles among kvlm's modules, from the source's real imports.

Every `import` and `from ... import` statement counts, wherever it stands: at module level, inside
functions (lazy imports hide a loop at run time, they do not remove it) and under `TYPE_CHECKING`.
`from kvlm.pkg import name` is an edge to the submodule `kvlm.pkg.name` when that file exists, and to
the package `kvlm.pkg` (its `__init__`) otherwise. Importing `kvlm.a.b` does not add an edge to
`kvlm.a`: a package's `__init__` running first is Python's order, not a dependency of the importer.

A cycle is a strongly connected component of more than one module (or a module importing itself).
The script prints each one with the edges inside it and exits 1 if there is any, so CI can run it:

    python scripts/import_cycles.py [--root kvlm]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve_relative(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the kvlm modules it imports (edges inside kvlm only)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    pkg = root.name
    graph: dict[str, set[str]] = {m: set() for m in files}

    def known(name: str) -> str | None:
        # the longest existing module that `name` names (a.b.c.func -> a.b.c)
        while name:
            if name in files:
                return name
            name = name.rpartition(".")[0]
        return None

    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = resolve_relative(mod, is_pkg, node.level, node.module)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in files else base)
            for t in targets:
                if t == pkg or t.startswith(pkg + "."):
                    dep = known(t)
                    if dep is not None and dep != mod:
                        graph[mod].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "kvlm"))
    args = ap.parse_args()
    graph = import_graph(Path(args.root))
    found = cycles(graph)
    n_edges = sum(len(v) for v in graph.values())
    print(f"{len(graph)} modules, {n_edges} import edges, {len(found)} import cycles")
    for comp in found:
        members = set(comp)
        print("cycle: " + ", ".join(comp))
        for m in comp:
            for d in sorted(graph[m] & members):
                print(f"    {m} -> {d}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
