"""Finds docstrings under ``packages/*/src`` that quote a measured figure (run by scripts/source_checks.py).

A figure measured on one machine (``2.8 GB/s``, ``14x faster``, ``0.54 of a raw write``, ``0.25 us per
sample``) goes stale as code and machines change, and a docstring should say what the code does. Figures belong
in the package README's performance section, beside the command that measures them; the docstring may say
"see the README". Looked at: module, class and function docstrings and ``#:`` attribute comments (Sphinx's
attribute docstrings). Sizes (``16 MiB``), settings (``120 s``) and ratios of a formula (``3x forward``) are not
figures and pass.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_NUMBER = r"\d[\d,]*(?:\.\d+)?(?:\s?(?:-|to)\s?\d[\d,]*(?:\.\d+)?)?"
FIGURE = re.compile(
    rf"""(?x)
    ~?{_NUMBER}\s?(?:[KMGT]i?B|[KMGT]b|bytes|tokens|samples|rows|steps|it|batches|files|ops)\s?/\s?s\b  # throughput
    | {_NUMBER}\s?(?:x|times)\s(?:faster|slower|quicker)\b                                          # speed-ups
    | \b0\.\d+\sof\s(?:a|the)\sraw\b                                                                # bench ratios
    | {_NUMBER}\s?(?:µs|us|ns)\b                                                                    # latencies
    """
)


def docstrings(source: str) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of each module, class and function docstring and each ``#:`` comment of ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text and node.body:
                yield node.body[0].lineno, text
    for number, line in enumerate(source.splitlines(), 1):
        if line.lstrip().startswith("#:"):
            yield number, line


def figures(root: Path = ROOT) -> list[str]:
    """One ``path:line: figure`` line for each measured figure in a docstring under ``packages/*/src``."""
    found = []
    for path in sorted(root.glob("packages/*/src/**/*.py")):
        for line, text in docstrings(path.read_text()):
            for match in FIGURE.finditer(text):
                found.append(f"{path.relative_to(root)}:{line}: {match.group(0)!r}")
    return found

