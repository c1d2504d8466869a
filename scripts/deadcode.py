"""Dead-code scan of every package's sources (vulture), run by scripts/source_checks.py.

Reports functions, classes, methods, attributes and variables under ``packages/*/src`` that nothing uses. Uses
are looked for in the sources, the tests (``packages/*/tests``, ``tests/``), ``bench/`` and
``scripts/deadcode_whitelist.py``; names that only configuration reaches are added from the configs themselves:
every Hydra ``_target_`` in a YAML file under ``packages/*/src`` and every entry point object in a package's
``pyproject.toml``, and every hook specification's name (``@hookspec``). Hook implementations (also any
``on_*``, ``smalti_*``, ``pytest_*``), pydantic
validators, pytest fixtures and module ``__getattr__``/``__dir__`` (PEP 562) count as used.

:func:`unused` gives one line per finding (``path:line: unused function 'name' (60% confidence)``): delete it,
or, if something outside Python's view uses it (a protocol, a string), add it to the whitelist with the
reason.
"""

from __future__ import annotations

import ast
import re
import tempfile
import tomllib
from pathlib import Path

from vulture import Vulture

ROOT = Path(__file__).resolve().parent.parent
SCANNED = "packages/*/src"
USES = ["packages/*/tests", "tests", "bench", "scripts/deadcode_whitelist.py"]
IGNORE_NAMES = ["on_*", "smalti_*", "pytest_*", "__getattr__", "__dir__"]
IGNORE_DECORATORS = [
    "@pytest.fixture",
    "@*.hookimpl",
    "@hookimpl",
    "@field_validator",
    "@model_validator",
    "@*.setter",
]
MIN_CONFIDENCE = 60
_TARGET = re.compile(r"""^\s*_target_:\s*["']?([\w.]+)["']?\s*$""", re.MULTILINE)


def hook_names(root: Path = ROOT) -> set[str]:
    """The names of every hook specification (a function decorated ``@hookspec``) under ``packages/*/src``:
    pluggy calls their implementations by these names."""
    names: set[str] = set()
    for path in root.glob(f"{SCANNED}/**/*.py"):
        source = path.read_text()
        if "hookspec" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and any("hookspec" in ast.unparse(d) for d in node.decorator_list):
                names.add(node.name)
    return names


def configured_names(root: Path = ROOT) -> set[str]:
    """The names only configuration and plugin machinery reach: every hook specification's, and the last part
    of every Hydra ``_target_`` in the packages' YAML and of every entry point object."""
    names = hook_names(root)
    for config in root.glob(f"{SCANNED}/**/*.yaml"):
        names |= {target.rsplit(".", 1)[-1] for target in _TARGET.findall(config.read_text())}
    for pyproject in root.glob("packages/*/pyproject.toml"):
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        groups = [project.get("scripts", {}), *project.get("entry-points", {}).values()]
        names |= {value.split(":")[1].split(".")[0] for group in groups for value in group.values() if ":" in value}
    return names


def unused(root: Path = ROOT, extra_paths: list[Path] | None = None) -> list[str]:
    """The report lines of the dead code under ``packages/*/src`` (``extra_paths``: more files to scan)."""
    scanned = sorted(root.glob(SCANNED)) + list(extra_paths or [])
    uses = [path for pattern in USES for path in sorted(root.glob(pattern))]
    with tempfile.TemporaryDirectory() as tmp:
        from_configs = Path(tmp) / "configured_names.py"
        from_configs.write_text("".join(f"{name}\n" for name in sorted(configured_names(root))))
        vulture = Vulture(ignore_names=IGNORE_NAMES, ignore_decorators=IGNORE_DECORATORS)
        vulture.scavenge([str(p) for p in [*scanned, *uses, from_configs]])
        items = vulture.get_unused_code(min_confidence=MIN_CONFIDENCE)
    reported = [Path(p).resolve() for p in scanned]
    lines = []
    for item in items:
        path = Path(item.filename).resolve()
        if any(path == top or top in path.parents for top in reported):
            lines.append(f"{path.relative_to(root)}:{item.first_lineno}: {item.message} ({item.confidence}% confidence)")
    return lines

