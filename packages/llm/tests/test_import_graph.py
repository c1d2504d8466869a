"""smalti-llm's modules import each other without circles (counting imports inside functions too), so that each
module (a Hugging Face family, the importer, the exporter, a tokenizer) can be read and loaded on its own."""

from __future__ import annotations

import ast
from pathlib import Path

import smalti.llm
from smalti.testing.house import import_circles

ROOT = Path(smalti.llm.__file__).parent


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = ("smalti", "llm", *path.relative_to(ROOT).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            edges[name] |= {t for t in targets if t in modules and t != name}
    return edges


def test_no_module_of_smalti_llm_imports_itself_through_others():
    edges = _graph()
    assert "smalti.llm.hf.importer" in edges and "smalti.llm.tokenizer" in edges
    assert import_circles(edges) == []


def test_the_cycle_finder_finds_a_circle():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
