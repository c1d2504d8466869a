"""Each package declares what its code imports, and imports what it declares.

A small AST check of our own (no tool to install; it maps ``smalti.<pkg>`` imports, one PEP 420 namespace
split over several distributions, to ``smalti-<pkg>``): every third-party module imported under ``packages/<pkg>/src`` (outside ``try: ... except
ImportError``, the optional integrations) must belong to a distribution
listed in that package's ``[project] dependencies`` or one of its non-test, non-bench extras, and every such declared
distribution must be imported somewhere in ``src`` (or be listed in ``USED_WITHOUT_IMPORT`` with the reason).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[1] / "packages"

#: Declared distributions that code does not import by name, with why they are declared.
USED_WITHOUT_IMPORT: dict[tuple[str, str], str] = {
    ("smalti-core", "hydra-submitit-launcher"): "a Hydra launcher plugin, found by Hydra under hydra_plugins",
    ("smalti-testing", "pytest-timeout"): "a pytest plugin the fixtures' time limits rely on",
    ("smalti-testing", "pytest-xdist"): "a pytest plugin: scripts/test.sh runs the suites on two workers",
    ("smalti-llm", "transformers"): "extra hf: what users load the exported Hugging Face folders with",
    ("smalti-core", "tensorboard"): "extra tensorboard: torch.utils.tensorboard's SummaryWriter imports it",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0])


def _declared(pyproject: Path) -> dict[str, str]:
    """Declared distribution -> where (``dependencies`` or ``extra <name>``); test extras left out."""
    project = tomllib.loads(pyproject.read_text())["project"]
    out = {_requirement_name(r): "dependencies" for r in project.get("dependencies", [])}
    for extra, reqs in project.get("optional-dependencies", {}).items():
        if extra in ("test", "dev", "docs", "bench"):  # bench: what bench/ scripts run, not src
            continue
        for r in reqs:
            out.setdefault(_requirement_name(r), f"extra {extra}")
    return out


@functools.cache
def _imports(src: Path, *, optional_too: bool = False) -> dict[str, set[str]]:
    """Top-level import name (``smalti.<pkg>`` kept whole) -> the files that import it (parsed once per tree)."""
    found: dict[str, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) and _catches_import_error(t)
                    for stmt in t.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in optional and not optional_too:  # try: import x / except ImportError: an optional integration
                continue
            if (optional_too and isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                    and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
                names = [node.args[0].value]  # importlib.import_module("boto3"): a lazy, optional import
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                key = ".".join(parts[:2]) if parts[0] in ("smalti", "hydra_plugins") and len(parts) > 1 else parts[0]
                found.setdefault(key, set()).add(str(path.relative_to(src)))
    return found


def _catches_import_error(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError"}
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(k, ast.Name) and k.id in names for k in kinds):
            return True
    return False


@functools.cache
def _module_distributions() -> dict[str, list[str]]:
    """Top-level module -> installed distributions; read once (it scans every installed distribution's files)."""
    return md.packages_distributions()


def _distributions(module: str, own: str) -> set[str]:
    if module.startswith("smalti."):
        return {_norm("smalti-" + module.split(".")[1])}
    if module.startswith("hydra_plugins."):
        name = module.split(".")[1]
        return {own} if name == own.replace("-", "_") else {_norm(name.replace("_", "-"))}
    return {_norm(d) for d in _module_distributions().get(module, [])}


def _package_dirs() -> list[Path]:
    return sorted(p for p in PACKAGES.iterdir() if (p / "pyproject.toml").is_file() and (p / "src").is_dir())


@pytest.mark.parametrize("package", _package_dirs(), ids=lambda p: p.name)
def test_imports_are_declared_and_declared_dependencies_are_used(package):
    own = _norm(tomllib.loads((package / "pyproject.toml").read_text())["project"]["name"])
    declared = _declared(package / "pyproject.toml")
    imports = _imports(package / "src")
    used = {d for module in _imports(package / "src", optional_too=True) for d in _distributions(module, own)}
    undeclared = []
    for module, files in sorted(imports.items()):
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top == "__future__":
            continue
        dists = _distributions(module, own)
        if own in dists or dists & declared.keys():
            continue
        undeclared.append(f"{module} (from {', '.join(sorted(dists)) or 'no installed distribution'}; "
                          f"imported in {', '.join(sorted(files)[:3])})")
    unused = [f"{dist} ({where})" for dist, where in sorted(declared.items())
              if dist not in used and (own, dist) not in USED_WITHOUT_IMPORT
              and not any(_norm(m) == dist for m in _imports(package / "src", optional_too=True))]
    assert not undeclared, f"{package.name}/pyproject.toml does not declare: " + "; ".join(undeclared)
    assert not unused, f"{package.name}/pyproject.toml declares but src never imports: " + "; ".join(unused)
