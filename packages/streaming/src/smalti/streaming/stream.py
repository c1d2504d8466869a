"""``Stream``: one MDS dataset to read (remote, local cache, split, mixing weight), and the times a
``proportion_schedule`` entry can take effect at."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smalti.streaming.errors import StreamingError
from smalti.streaming.index_trust import default_cache_root

SCHEDULE_UNITS = ("ep", "ba", "sp")
_AT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE]\+?[0-9]+)?)\s*([a-z]+)\s*$")


def parse_schedule_time(at: Any) -> tuple[int, str]:
    """``"2ep"``, ``"100ba"``, ``"3200sp"`` (or smalti-core's ``Time``) -> ``(value, unit)``.

    ``dur`` and ``tok`` are refused: the dataset cannot tell where they fall in its sample order.
    """
    if hasattr(at, "value") and hasattr(at, "unit"):  # smalti.core.time.Time, without importing smalti-core
        value, unit = at.value, str(getattr(at.unit, "value", at.unit))
    else:
        match = _AT.match(str(at))
        if not match:
            raise StreamingError(f"proportion_schedule: cannot read at={at!r}; give a whole number followed by "
                                 "ep, ba or sp (e.g. '2ep', '100ba', '3200sp')")
        value, unit = float(match.group(1)), match.group(2)
    if unit in ("dur", "tok"):
        raise StreamingError(f"proportion_schedule: at={at!r} is in '{unit}', which the dataset cannot place in "
                             "its sample order (it knows neither max_duration nor tokens per sample); use ep, ba "
                             "(global batches) or sp (global samples)")
    if unit not in SCHEDULE_UNITS:
        raise StreamingError(f"proportion_schedule: at={at!r} has unit {unit!r}; use one of ep, ba, sp")
    if float(value) != int(value) or value < 0:
        raise StreamingError(f"proportion_schedule: at={at!r} must be a whole, non-negative number of {unit}")
    return int(value), unit


@dataclass
class Stream:
    """One MDS dataset: ``remote`` (URL or path, optional) cached into ``local``, with one mixing weight.

    ``proportion`` is relative to the other streams; ``repeat`` (times per epoch) and ``choose`` (samples per
    epoch) are absolute. Give at most one.
    """

    remote: str | None = None
    local: str | None = None
    split: str | None = None
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("proportion", "repeat", "choose") if getattr(self, k) is not None]
        if len(given) > 1:
            raise StreamingError(f"stream {self.remote or self.local}: give one of proportion/repeat/choose, not {given}")
        if self.remote is None and self.local is None:
            raise StreamingError("a stream needs remote, local or both")
        self._private_root: str | None = None  # the per-user default cache this stream's local folder is in
        if self.local is None:
            import hashlib

            tag = hashlib.sha1(str(self.remote).encode()).hexdigest()[:16]
            self._private_root = str(default_cache_root())
            self.local = os.path.join(self._private_root, tag)

    @property
    def weight(self) -> tuple[str, float | int | None]:
        for kind in ("proportion", "repeat", "choose"):
            if getattr(self, kind) is not None:
                return kind, getattr(self, kind)
        return "none", None

    def local_dir(self) -> Path:
        return Path(self.local) / self.split if self.split else Path(self.local)

    def remote_path(self, name: str) -> str | None:
        """The URL (or path) of file ``name`` of this stream's remote copy; ``None`` without a remote."""
        root = self.remote_root()
        if root is None:
            return None
        return f"{root}/{name}" if "://" in root else os.path.join(root, name)

    def remote_root(self) -> str | None:
        """The URL (or folder) of this stream's remote copy (with ``split``); ``None`` without a remote."""
        if self.remote is None:
            return None
        parts = [self.remote.rstrip("/")] + ([self.split] if self.split else [])
        return "/".join(parts) if "://" in self.remote else os.path.join(*parts)

    @property
    def name(self) -> str:
        return str(self.remote or self.local)


def given_streams(streams: list[Stream | Mapping[str, Any]] | None, remote: str | None, local: str | None,
                  split: str | None) -> list[Stream]:
    """The dataset's streams: ``streams`` (mappings, as from YAML, made into ``Stream``) or one stream of
    ``remote``/``local``/``split``; giving both or neither is refused."""
    if streams is None:
        if remote is None and local is None:
            raise StreamingError("give streams=[Stream(...)] or remote/local")
        return [Stream(remote=remote, local=local, split=split)]
    if remote is not None or local is not None:
        raise StreamingError("give either streams or remote/local, not both")
    return [Stream(**dict(s)) if isinstance(s, Mapping) else s for s in streams]

