"""Hydra's "could not find an option" error, with the valid choices also for a bad option inside a list.

Hydra lists a group's options for ``callbacks=typo`` but not for ``callbacks=[speed_monitor,typo]`` (each list
item is loaded as a plain config path). :func:`install` adds the same "Available options" list to the latter.
"""

from __future__ import annotations

from typing import Any

_installed = False


def _with_options(original: Any) -> Any:
    def config_not_found_error(repo: Any, tree: Any) -> None:
        from hydra.core.object_type import ObjectType
        from hydra.errors import MissingConfigException

        try:
            original(repo, tree)
        except MissingConfigException as exc:
            path = exc.missing_cfg_file or ""
            if exc.options or "/" not in path:
                raise
            group, _, option = path.rpartition("/")
            options = repo.get_group_options(group, ObjectType.CONFIG)
            if not options:
                raise
            choices = "\n".join(f"\t{o}" for o in options)
            head, sep, tail = str(exc).partition("\nConfig search path:")
            message = (f"{head.rstrip()}\n'{option}' is not an option of group '{group}'.\n"
                       f"Available options in '{group}':\n{choices}\n{sep.lstrip()}{tail}")
            raise MissingConfigException(message, missing_cfg_file=path, options=options) from None

    return config_not_found_error


def install() -> None:
    """Make Hydra list the valid options when a list-valued group names one that does not exist (idempotent)."""
    global _installed
    if _installed:
        return
    from smalti.core._compat import hydra_defaults_list as defaults_list

    defaults_list.config_not_found_error = _with_options(defaults_list.config_not_found_error)
    _installed = True
