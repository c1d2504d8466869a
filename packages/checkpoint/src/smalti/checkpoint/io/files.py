"""Opening checkpoint files with ``O_DIRECT`` where the file system takes it, leaving it for the bytes it
refuses, and the kernel's writeback hint for page-cache writes."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import sys
from collections.abc import Callable
from typing import Any

_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: how checkpoint files are opened for reading: a file that is a link (out of its folder) is refused (ELOOP)
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
#: ``sync_file_range`` flag: start writeback of the range's dirty pages; do not wait for it
SYNC_FILE_RANGE_WRITE = 2


def open_maybe_direct(path: str | os.PathLike[str], flags: int, direct: bool) -> tuple[int, bool]:
    """``os.open`` (close-on-exec) with ``O_DIRECT`` added when ``direct`` and the file system allows it; the
    descriptor and whether it is direct (a file system without direct I/O answers EINVAL: the file opens
    without it)."""
    flags |= getattr(os, "O_CLOEXEC", 0)
    if direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o666), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o666), False


def leave_direct_io(fd: int) -> None:
    """Turn ``O_DIRECT`` off for an open file (for an unaligned tail, or a file system that refuses direct I/O
    on the first read or write although it accepted the open)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def libc_function(name: str, argtypes: list[Any]) -> Any | None:
    """Linux libc's ``name`` through ctypes (returning a C ``int``, ``errno`` kept for
    :func:`ctypes.get_errno`), for calls the ``os`` module does not expose; None elsewhere or where it is
    missing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def _load_sync_file_range() -> Callable[[int, int, int, int], None] | None:
    """Linux's ``sync_file_range(2)``, raising :class:`OSError` when it fails; None elsewhere."""
    function = libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
    if function is None:
        return None

    def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
        if function(fd, offset, nbytes, flags) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))

    return sync_file_range


#: ``sync_file_range(fd, offset, nbytes, flags)`` on Linux, ``None`` elsewhere
sync_file_range = _load_sync_file_range()
