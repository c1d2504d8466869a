"""``smalti``: inspect the installation. ``smalti plugins`` lists every plugin, its version, hooks and config path."""

from __future__ import annotations

import argparse
import sys

from smalti.core.plugins import get_plugin_manager


def list_plugins(out=sys.stdout) -> int:
    """Print each loaded plugin: distribution and version, module file, implemented hooks, config search path."""
    pm = get_plugin_manager()
    for name, plugin in sorted(pm.list_name_plugin(), key=lambda item: item[0]):
        info = pm.entry_point_info.get(name)
        dist = f"{info.distribution} {info.version}" if info else "smalti-core (builtin)"
        location = info.location if info else getattr(plugin, "__file__", repr(plugin))
        searchpath = getattr(plugin, "smalti_config_searchpath", None)
        config = searchpath() if callable(searchpath) else None
        print(f"{name}: {dist}", file=out)
        print(f"  module: {location}", file=out)
        print(f"  hooks: {', '.join(pm.implemented_hooks(plugin)) or '-'}", file=out)
        print(f"  config: {config or '-'}", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="smalti", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="list installed smalti plugins, their versions, hooks and config paths")
    args = parser.parse_args(argv)
    if args.command == "plugins":
        return list_plugins()
    return 2


if __name__ == "__main__":
    sys.exit(main())
