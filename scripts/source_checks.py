"""The source checks scripts/test.sh runs after lint-imports: dead code (:mod:`deadcode`) and measured figures
in docstrings (:mod:`docstring_figures`). Prints every finding; exit status 1 if there is any."""

from __future__ import annotations

import sys

import deadcode
import docstring_figures

CHECKS = [
    ("dead-code scan", deadcode.unused, "unused names: delete them, or whitelist them in "
     "scripts/deadcode_whitelist.py saying what uses them"),
    ("docstring figures", docstring_figures.figures, "measured figures in docstrings: move them to the package "
     "README's performance section (with the command that measures them) and say what the code does"),
]


def main() -> int:
    """Run every check; 1 if any found something."""
    failed = False
    for name, check, advice in CHECKS:
        found = check()
        for line in found:
            print(line)
        print(f"{name}: {len(found)} {advice}" if found else f"{name}: ok", file=sys.stderr if found else sys.stdout)
        failed |= bool(found)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
