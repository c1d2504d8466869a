"""Local folders and files that another user cannot redirect: per-user caches, and opens that refuse links.

A cache in a predictable place every user shares (``/tmp/<app>``) lets anyone plant a symbolic link where a
download will write, or a file where a load will read. :func:`user_cache_dir` is a per-user cache folder
(under ``$XDG_CACHE_HOME``, else ``<tmp>/smalti-<uid>``) made ``0700`` and checked: a link, a folder owned
by someone else or one that others may write into is refused (:class:`UnsafeLocalPathError`).
:func:`check_no_links` and :func:`open_beneath` refuse a link at any component of a path below a folder
(the file a manifest or index names, or a folder on the way to it), ``lstat`` and ``O_NOFOLLOW`` per step.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from smalti.storage.errors import UnsafeLocalPathError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def check_private_dir(path: str | os.PathLike[str], create: bool = True) -> Path:
    """``path`` as a folder only its owner can change: created ``0700`` (parents too) if missing, then refused
    with :class:`UnsafeLocalPathError` if it is a link, not a folder, owned by another user, or writable by
    group or others (``chmod 700`` it, or choose another folder)."""
    path = Path(path)
    if create and not os.path.lexists(path):
        with contextlib.suppress(FileExistsError):  # made meanwhile, or planted: checked below like any other
            path.mkdir(mode=0o700, parents=True)
    info = os.lstat(path)
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a folder"
    elif hasattr(os, "getuid") and info.st_uid != _uid():
        problem = f"is owned by uid {info.st_uid}, not this user (uid {_uid()})"
    elif info.st_mode & 0o022:
        problem = f"may be written by other users (mode {stat.S_IMODE(info.st_mode):o})"
    if problem:
        raise UnsafeLocalPathError(
            f"cache folder {path} {problem}: another user could plant files or links in it, so it is refused; "
            "remove it, or make it this user's own with mode 700, or choose another cache folder", str(path)
        )
    return path


def user_cache_dir(app: str) -> Path:
    """This user's cache folder for ``app`` (``"checkpoint"``, ``"streaming"``), checked as
    :func:`check_private_dir` checks it: ``$XDG_CACHE_HOME/smalti/<app>`` when ``XDG_CACHE_HOME`` is set,
    else ``<tempdir>/smalti-<uid>/<app>`` (fast local disk, as before, but one ``0700`` root per user)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        root = check_private_dir(Path(xdg) / "smalti")
    else:
        root = check_private_dir(Path(tempfile.gettempdir()) / f"smalti-{_uid()}")
    return check_private_dir(root / app)


def _refuse_link(folder: Path, rel: str, where: str | None) -> UnsafeLocalPathError:
    return UnsafeLocalPathError(
        f"{folder / rel} is a symbolic link{f' ({where})' if where else ''}: files are read and written only "
        "inside their folder, so it is refused; replace the link by the file it points to", str(folder / rel)
    )


def check_no_links(folder: str | os.PathLike[str], rel: str, where: str | None = None) -> Path:
    """``folder / rel`` after checking (``lstat``) that no component of ``rel`` is a symbolic link; raises
    :class:`UnsafeLocalPathError` naming the link (and ``where``, what named the file). Missing components
    raise ``FileNotFoundError``."""
    folder = Path(folder)
    parts = Path(rel).parts
    for i in range(1, len(parts) + 1):
        sub = "/".join(parts[:i])
        if stat.S_ISLNK(os.lstat(folder / sub).st_mode):
            raise _refuse_link(folder, sub, where)
    return folder / rel


def open_beneath(
    folder: str | os.PathLike[str], rel: str, flags: int = os.O_RDONLY, mode: int = 0o666, where: str | None = None
) -> int:
    """``os.open(folder / rel, flags, mode)`` following no symbolic link below ``folder``: each folder on the
    way is opened ``O_NOFOLLOW | O_DIRECTORY`` relative to the last, the file itself ``O_NOFOLLOW``, so a link
    swapped in after a check is refused too (:class:`UnsafeLocalPathError`). ``folder`` itself may be a link."""
    folder = Path(folder)
    parts = Path(rel).parts
    dir_fd = os.open(folder, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        for i, part in enumerate(parts[:-1]):
            try:
                fd = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
            except OSError:
                if os.path.islink(folder.joinpath(*parts[: i + 1])):
                    raise _refuse_link(folder, "/".join(parts[: i + 1]), where) from None
                raise
            os.close(dir_fd)
            dir_fd = fd
        try:
            return os.open(parts[-1], flags | _NOFOLLOW | _CLOEXEC, mode, dir_fd=dir_fd)
        except OSError:
            if os.path.islink(folder / rel):
                raise _refuse_link(folder, rel, where) from None
            raise
    finally:
        os.close(dir_fd)
