"""An import-linter contract that no module of a package imports itself back through other modules.

import-linter's own ``acyclic_siblings`` looks at siblings only, so a package's ``__init__`` and a module
under it that import each other pass it. This contract takes every module of each listed package as a node
(``TYPE_CHECKING`` imports are not edges when the run excludes them) and reports each circle it finds, with
the import lines that close it. Used by the root ``pyproject.toml``'s ``[tool.importlinter]`` (needs the
``lint`` extra: import-linter).
"""

from __future__ import annotations

from typing import Any

from importlinter import Contract, ContractCheck, fields, output

from smalti.testing.house import import_circles


class AcyclicModulesContract(Contract):
    """No import circle among the modules of each package in ``packages``."""

    type_name = "acyclic_modules"

    packages = fields.ListField(subfield=fields.StringField())

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        circles: dict[str, list[list[str]]] = {}
        details: dict[tuple[str, str], str] = {}
        for package in self.packages:  # type: ignore[attr-defined]
            modules = {package, *graph.find_descendants(package)}
            edges = {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}
            found = import_circles(edges)
            if found:
                circles[package] = found
                for circle in found:
                    for importer in circle:
                        for imported in edges[importer] & set(circle):
                            lines = graph.get_import_details(importer=importer, imported=imported)
                            details[(importer, imported)] = ", ".join(
                                f"line {d['line_number']}: {d['line_contents']}" for d in lines)
        return ContractCheck(kept=not circles, metadata={"circles": circles, "details": details})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for package, found in check.metadata["circles"].items():
            for circle in found:
                output.print_error(f"{package}: {len(circle)} modules import each other in a circle:")
                members = set(circle)
                for (importer, imported), where in sorted(check.metadata["details"].items()):
                    if importer in members and imported in members:
                        output.print_error(f"  {importer} -> {imported} ({where})", bold=False)
                output.new_line()
