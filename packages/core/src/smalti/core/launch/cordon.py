"""Read the cordon list smalti-health writes: hosts found bad, which launches keep their jobs off.

Accepted shapes (JSON or YAML): a list of host names; a list of mappings with ``host`` (or ``hostname``,
``node``) and an optional ``reason``; a mapping ``{host: reason}``; or any of these under a top-level key
``cordoned``, ``nodes`` or ``hosts``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from smalti.core.launch.errors import LaunchError
from smalti.core.launch.script_values import check_host_name, one_line

_HOST_KEYS = ("host", "hostname", "node")
_LIST_KEYS = ("cordoned", "nodes", "hosts")


@dataclass(frozen=True)
class CordonedHost:
    """One bad host and why it was cordoned."""

    host: str
    reason: str = ""


def read_cordon_file(path: str | os.PathLike[str]) -> list[CordonedHost]:
    """The cordoned hosts in ``path``, in file order without repeats. A missing file means an empty list."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise LaunchError(f"cordon file {path} is not valid JSON or YAML: {exc}") from exc
    return parse_cordon(data, str(path))


def parse_cordon(data: Any, source: str = "<cordon>") -> list[CordonedHost]:
    """Normalise any accepted cordon shape (see the module docstring) to a list of :class:`CordonedHost`.

    Every host must be one valid host name (:data:`~smalti.core.launch.script_values.HOST_NAME`): launchers write
    them into job scripts, so an entry holding a newline or a shell character refuses the whole file, naming it.
    Reasons are free text, folded onto one line.
    """
    if data is None:
        return []
    if isinstance(data, dict):
        for key in _LIST_KEYS:
            if key in data:
                return parse_cordon(data[key], source)
        entries: list[Any] = [{"host": host, "reason": reason} for host, reason in data.items()]
    elif isinstance(data, list):
        entries = data
    else:
        raise LaunchError(f"cordon file {source} holds a {type(data).__name__}; expected a list of hosts or a mapping")
    out: dict[str, CordonedHost] = {}
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            host, reason = entry, ""
        elif isinstance(entry, dict) and (key := next((k for k in _HOST_KEYS if k in entry), None)):
            host, reason = entry[key], entry.get("reason") or ""
        else:
            raise LaunchError(
                f"cordon file {source}: entry {i} ({entry!r}) names no host; use a host name or a mapping "
                f"with one of {', '.join(_HOST_KEYS)}"
            )
        host = check_host_name(str(host).strip(), f"cordon file {source}: entry {i}")
        if host not in out:
            out[host] = CordonedHost(host, one_line(str(reason)))
    return list(out.values())
