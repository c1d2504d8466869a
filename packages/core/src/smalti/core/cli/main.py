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


RUN_GROUPS = ("algorithms", "callbacks", "logger", "health")


def list_run_plugins(overrides: list[str], out=sys.stdout) -> int:
    """Print what a ``smalti-train <overrides>`` run will register: each group's entries and their targets.

    Every entry can be switched off from the command line: ``<group>=[]`` drops a whole group,
    ``<group>.<name>=null`` one entry, ``checkpoint=none`` the checkpointer.
    """
    from hydra import compose, initialize_config_module
    from omegaconf import DictConfig

    from smalti.core.config.schema import register_configs
    from smalti.core.config.validate import validate_config

    register_configs()
    with initialize_config_module(config_module="smalti.core.conf", version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    validate_config(cfg)  # the same checks as smalti-train: a bad value fails here too
    for group in RUN_GROUPS:
        entries = {k: v for k, v in (cfg.get(group) or {}).items() if isinstance(v, DictConfig) and "_target_" in v}
        print(f"{group}:", file=out)
        for name, node in entries.items():
            print(f"  {name}: {node._target_}  (off: {group}.{name}=null)", file=out)
        if not entries:
            print("  -", file=out)
    checkpoint = cfg.get("checkpoint")
    target = checkpoint.get("_target_") if isinstance(checkpoint, DictConfig) else None
    print(f"checkpoint: {target or '-'}", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="smalti", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser("plugins", help="list installed smalti plugins, their versions, hooks and config paths")
    plugins.add_argument("--run", nargs=argparse.REMAINDER, metavar="OVERRIDES",
                         help="list instead the algorithms, callbacks, loggers and checkpointer a run with these "
                              "smalti-train overrides will have")
    sub.add_parser("plan", help="per-GPU memory, step time and MFU of a run: smalti plan <overrides> plan.gpu=h100 "
                   "plan.gpus=8").add_argument("overrides", nargs=argparse.REMAINDER)
    sub.add_parser("profile", help="top operators of the profiler callback's traces: smalti profile summary "
                   "outputs/<run>").add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "plan":
        from smalti.core.plan.report import main as plan_main

        return plan_main(args.overrides)
    if args.command == "profile":
        from smalti.core.callbacks.profiler import profile_main

        return profile_main(args.args)
    if args.command == "plugins":
        if args.run is None:
            return list_plugins()
        from hydra.errors import CompactHydraException

        from smalti.core.cli.report import report_config_error
        from smalti.core.errors import ConfigError

        try:
            return list_run_plugins(args.run)
        except (ConfigError, CompactHydraException) as exc:
            return report_config_error(exc, "smalti plugins --run")
    return 2


if __name__ == "__main__":
    sys.exit(main())
