"""Lists smalti's packages in dependency order, or one package's sibling closure, for the setup and test scripts.

    python scripts/packages.py all            -> every package directory with a pyproject.toml, dependencies first
    python scripts/packages.py closure NAME   -> pip arguments installing NAME[test] with its smalti siblings
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "packages"


def load() -> dict[str, tuple[str, list[str], bool]]:
    """dir name -> (distribution name, sibling distributions it needs, has a test extra)."""
    out = {}
    for pyproject in sorted(ROOT.glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        deps = project.get("dependencies", []) + project.get("optional-dependencies", {}).get("test", [])
        siblings = [re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0] for d in deps if d.startswith("smalti-")]
        has_test = "test" in project.get("optional-dependencies", {})
        out[pyproject.parent.name] = (project["name"], siblings, has_test)
    return out


def ordered(packages: dict[str, tuple[str, list[str], bool]]) -> list[str]:
    by_dist = {dist: d for d, (dist, _, _) in packages.items()}
    done: list[str] = []

    def visit(d: str) -> None:
        if d in done:
            return
        for dep in packages[d][1]:
            if dep in by_dist:
                visit(by_dist[dep])
        done.append(d)

    for d in packages:
        visit(d)
    return done


def closure(name: str, packages: dict[str, tuple[str, list[str], bool]]) -> list[str]:
    by_dist = {dist: d for d, (dist, _, _) in packages.items()}
    needed: list[str] = []

    def visit(d: str) -> None:
        if d in needed:
            return
        needed.append(d)
        for dep in packages[d][1]:
            if dep in by_dist:
                visit(by_dist[dep])

    visit(name)
    args = []
    for d in ordered(packages):
        if d in needed:
            extra = "[test]" if d == name and packages[d][2] else ""
            args += ["-e", f"packages/{d}{extra}"]
    return args


if __name__ == "__main__":
    pkgs = load()
    if sys.argv[1] == "all":
        print(" ".join(ordered(pkgs)))
    elif sys.argv[1] == "closure":
        print(" ".join(closure(sys.argv[2], pkgs)))
