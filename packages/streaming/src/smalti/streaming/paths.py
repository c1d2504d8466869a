"""Names read from files (shard basenames in ``index.json``, sub-index folders) must stay inside their folder.

A basename such as ``../../x.mds`` or ``/etc/x`` would otherwise make a download write, and cache eviction
delete, outside the dataset's cache folder.
"""

from __future__ import annotations

import re

from smalti.streaming.errors import UnsafePathError

_DRIVE = re.compile(r"^[A-Za-z]:")


def escapes(name: object) -> bool:
    """Whether ``name`` is not a relative path naming something inside the folder it is joined to.

    Refused: non-strings, empty names, ``.``, absolute paths (``/x``, ``\\x``, ``C:x``), any ``..`` part
    (``/`` or ``\\`` separated), and NUL bytes.
    """
    if not isinstance(name, str) or "\0" in name or name.startswith(("/", "\\")) or _DRIVE.match(name):
        return True
    parts = [p for p in re.split(r"[\\/]", name) if p not in ("", ".")]
    return not parts or ".." in parts


def check_name(name: object, source: object, entry: str) -> str:
    """``name`` itself when it stays inside its folder; else raise naming the file ``source`` and the ``entry``."""
    if escapes(name):
        raise UnsafePathError(
            f"{source}: {entry} is {name!r}, which is not a relative path inside the dataset folder (it is "
            "absolute, empty or goes up with '..'); refused, so that nothing is written or deleted outside the "
            "folder. Fix the file (names are relative, like 'shard.00000.mds' or 'part0/shard.00000.mds') or "
            "write it again"
        )
    return name  # type: ignore[return-value]
