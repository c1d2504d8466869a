"""Checks that keep a package's source tidy, shared by every package's tests.

:func:`private_imports` finds the places a package reaches into a dependency's private modules or names
outside its ``_compat`` module (where such names belong, resolved once at import time); :func:`import_circles`
finds the import circles of a module graph (smalti-llm's test and the root's import-linter contract).
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

#: The dependencies whose private names must go through a package's ``_compat`` module.
GUARDED = ("torch", "pluggy", "omegaconf", "hydra")


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] in GUARDED and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attribute accesses on a name, else ``None``."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(names)])


def private_imports(src: Path, allowed: Iterable[str] = ("_compat.py",)) -> list[str]:
    """``"file:line: name"`` for each private name of torch/pluggy/OmegaConf/Hydra that a module under ``src``
    imports or reads, outside files named in ``allowed`` (paths relative to ``src``, or bare file names)."""
    allowed = set(allowed)
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel in allowed or path.name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
                dotted = _dotted(node)
                names = [dotted] if dotted else []
            found += [f"{rel}:{node.lineno}: {name}" for name in names if _private(name)]
    return sorted(set(found))


def import_circles(edges: Mapping[str, Collection[str]]) -> list[list[str]]:
    """The circles of a module graph (``module -> the modules it imports``, every module a key): its strongly
    connected components of more than one module, each sorted (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                if len(component) > 1:
                    found.append(sorted(component))
    return found
