"""Reading checkpoint files without running code from them.

A checkpoint may come from elsewhere (a download, a shared bucket), and its manifest is easy to rewrite to
match altered files, so a verified checkpoint is not a trusted one. Nothing read from it may run code:

- DCP's ``.metadata`` is a pickle. It is read by :func:`read_dcp_metadata` with an unpickler that resolves
  only the classes DCP's metadata is made of (the dataclasses of ``torch.distributed.checkpoint.metadata``,
  ``_StorageInfo``, ``torch.Size``, dtypes, layouts, paths); any other class or function is refused.
- The rank-local state (``extra/rank<r>.pt``) and the small objects DCP stores in its data files (optimizer
  hyperparameters) are ``torch.save`` files read with ``torch.load(weights_only=True)`` (:func:`load_torch`),
  torch's restricted unpickler: tensors, numbers, strings and containers only. The rank-local state is
  written in that form (:func:`to_safe_tree`), and checked to read back so before it is written.

A refused file raises :class:`~smalti.checkpoint.errors.UnsafeCheckpointError` naming the file and what it
wanted. ``trust_pickles=True`` (``checkpoint.trust_pickles=true``, ``smalti-checkpoint --trust-pickles``)
reads such files with full unpickling instead: only for checkpoints from a source the user trusts (older
checkpoints' rank-local files hold NumPy arrays, which need it).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pathlib
import pickle
import re
from collections import OrderedDict
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from smalti.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    UnsafeCheckpointError,
    UnsafePathError,
)
from smalti.checkpoint.limits import EntryTooLargeError, check_extent, decode_bounded, decoded_limit
from smalti.storage import UnsafeLocalPathError, check_no_links, open_beneath

log = logging.getLogger(__name__)

TRUST_HINT = (
    "only if you trust where this checkpoint comes from, load it with checkpoint.trust_pickles=true "
    "(smalti-checkpoint: --trust-pickles)"
)
#: how a NumPy array is stored in the rank-local state: ``{_NDARRAY: tensor, "dtype": "uint32"}``
_NDARRAY = "__ndarray__"


class _Refused(Exception):
    def __init__(self, wanted: str) -> None:
        super().__init__(wanted)
        self.wanted = wanted


@cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What a pickle of DCP's ``Metadata`` may name: exactly the classes and functions it is built from."""
    from torch.distributed.checkpoint import metadata as md

    from smalti.checkpoint._compat import MEM_FORMAT_ENCODING, StorageInfo, get_layout

    allowed: dict[tuple[str, str], Any] = {}
    for obj in (md.Metadata, md.MetadataIndex, md.TensorStorageMetadata, md.BytesStorageMetadata,
                md.ChunkStorageMetadata, md.TensorProperties, md.StorageMeta, MEM_FORMAT_ENCODING, StorageInfo):
        allowed[(obj.__module__, obj.__qualname__)] = obj
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = get_layout  # how a torch.layout pickles
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    allowed[("collections", "OrderedDict")] = OrderedDict
    for cls in (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath, pathlib.WindowsPath):
        allowed[("pathlib", cls.__name__)] = cls  # StorageMeta.checkpoint_id: the folder it was saved to
    return allowed


@cache
def _buildable_types() -> tuple[type, ...]:
    """The classes whose instances a metadata pickle may fill in with ``BUILD``: DCP's metadata dataclasses."""
    from torch.distributed.checkpoint import metadata as md

    from smalti.checkpoint._compat import StorageInfo

    return (md.Metadata, md.MetadataIndex, md.TensorStorageMetadata, md.BytesStorageMetadata,
            md.ChunkStorageMetadata, md.TensorProperties, md.StorageMeta, StorageInfo)


class _MetadataUnpickler(pickle._Unpickler):
    """An unpickler that resolves only :func:`_metadata_globals` (every way a pickle reaches code goes through
    ``find_class``: GLOBAL, STACK_GLOBAL, INST, OBJ and the copyreg extension codes), no persistent ids, and
    ``BUILD`` only on an instance of DCP's metadata dataclasses that this load itself created.

    ``BUILD`` sets attributes on whatever object is on the stack: on an allowed class or function (``PurePosixPath``,
    ``MetadataIndex``, ``torch.serialization._get_layout``) it would change the running process for every later
    caller, whatever happens to the rest of the file. It is the pure-Python unpickler (``pickle._Unpickler``),
    whose opcode table can be changed; the C one's cannot.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._created: dict[int, Any] = {}  # id -> object (kept alive, so that an id is never reused)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _metadata_globals()[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {pid!r}")

    def _creating(op: Any) -> Any:  # noqa: N805 - wraps an opcode handler of the table below
        """The handler of an opcode that makes an object: the object it leaves on the stack is noted as
        created by this load (only DCP's dataclasses: the other allowed callables return shared objects)."""

        def handler(self: _MetadataUnpickler) -> None:
            op(self)
            if self.stack and isinstance(self.stack[-1], _buildable_types()):
                self._created[id(self.stack[-1])] = self.stack[-1]

        return handler

    def _build(self) -> None:
        if len(self.stack) < 2:
            raise _Refused("BUILD with nothing to build")
        inst, state = self.stack[-2], self.stack[-1]
        if id(inst) not in self._created:
            what = getattr(inst, "__qualname__", None) if callable(inst) else None
            what = what or type(inst).__qualname__
            raise _Refused(f"BUILD (setting attributes) on {what}, which this file did not create")
        # A class with its own __setstate__ (TensorProperties) reads its state itself; the default sets attributes
        parts = () if "__setstate__" in type(inst).__dict__ else \
            state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:
            if part is not None and (not isinstance(part, dict) or
                                     any(not isinstance(k, str) or k.startswith("__") for k in part)):
                raise _Refused(f"BUILD with state {type(part).__name__} (only plain attribute names are allowed)")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.REDUCE[0]] = _creating(pickle._Unpickler.load_reduce)
    dispatch[pickle.NEWOBJ[0]] = _creating(pickle._Unpickler.load_newobj)
    dispatch[pickle.NEWOBJ_EX[0]] = _creating(pickle._Unpickler.load_newobj_ex)
    dispatch[pickle.OBJ[0]] = _creating(pickle._Unpickler.load_obj)
    dispatch[pickle.INST[0]] = _creating(pickle._Unpickler.load_inst)
    dispatch[pickle.BUILD[0]] = _build
    del _creating


def check_inside(rel: Any, where: str, what: str = "lists") -> str:
    """``rel`` if it is a plain relative path that stays inside its folder; else :class:`UnsafePathError`.

    Refused: non-strings, empty names, absolute paths (``/x``, ``C:\\x``, ``C:x``), backslashes, NUL, and any
    empty, ``.`` or ``..`` component (checkpoints never write such names, so no normalisation is needed)."""
    problem = None
    if not isinstance(rel, str) or not rel:
        problem = "is not a file name"
    elif "\\" in rel or "\x00" in rel:
        problem = "holds a backslash or NUL"
    elif rel.startswith("/") or re.match(r"^[A-Za-z]:", rel):
        problem = "is an absolute path"
    elif any(part in ("", ".", "..") for part in rel.split("/")):
        problem = "has an empty, '.' or '..' component"
    if problem:
        raise UnsafePathError(
            f"{where} {what} the file name {rel!r}, which {problem}: it would leave the checkpoint's folder. "
            "The file is corrupt or crafted; this checkpoint is refused",
            where,
        )
    return rel


def no_link_inside(folder: str | os.PathLike[str], rel: str, where: str) -> Path:
    """``folder / rel`` once no component of ``rel`` is a symbolic link (``lstat``), else
    :class:`UnsafePathError` naming the link and ``where`` (what named the file): a link would read or write
    outside the checkpoint's folder. A missing component raises ``FileNotFoundError``."""
    try:
        return check_no_links(folder, rel, where)
    except UnsafeLocalPathError as exc:
        raise UnsafePathError(f"{exc}; this checkpoint is refused", exc.url) from None


def open_inside(folder: str | os.PathLike[str], rel: str, where: str) -> io.BufferedReader:
    """File ``rel`` of ``folder`` opened for reading following no symbolic link on the way (``O_NOFOLLOW``
    per component, so a link swapped in after :func:`no_link_inside` is refused too: :class:`UnsafePathError`)."""
    try:
        return os.fdopen(open_beneath(folder, rel, os.O_RDONLY, where=where), "rb")
    except UnsafeLocalPathError as exc:
        raise UnsafePathError(f"{exc}; this checkpoint is refused", exc.url) from None


def read_dcp_metadata(path: str | os.PathLike[str], trust_pickles: bool = False) -> Metadata:
    """DCP's ``Metadata`` from the pickle at ``path``, admitting only the classes DCP's metadata holds.

    Raises :class:`UnsafeCheckpointError` (naming the file and the class it wanted) for anything else unless
    ``trust_pickles``; :class:`CheckpointCorruptError` when the file is not DCP metadata. The relative paths
    of its storage entries must stay inside the checkpoint folder (:func:`check_inside`).
    """
    path = Path(path)
    try:
        with open_inside(path.parent, path.name, "DCP's metadata") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as exc:
        if not trust_pickles:
            raise UnsafeCheckpointError(
                f"{path} asks the unpickler for {exc.wanted}, which DCP's metadata never holds: reading it could run "
                f"code, so it is refused; {TRUST_HINT}",
                str(path), [exc.wanted],
            ) from None
        log.warning("trust_pickles: unpickling %s, which wants %s (not DCP metadata's own class)", path, exc.wanted)
        with open(path, "rb") as f:
            metadata = pickle.load(f)  # noqa: S301 - the user said they trust this checkpoint
    except (FileNotFoundError, CheckpointCorruptError):
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged pickle fails in many ways
        raise CheckpointCorruptError(f"cannot read DCP metadata {path}: {exc!r}", str(path)) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata", str(path))
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    for index, info in (metadata.storage_data or {}).items():
        check_inside(getattr(info, "relative_path", None), str(path), "refers to")
        check_extent(info, None, f"the entry {getattr(index, 'fqn', index)!r} of {info.relative_path} in {path}")
    return metadata


def _unsafe_globals(source: Any) -> list[str]:
    try:
        if hasattr(source, "seek"):
            source.seek(0)
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # noqa: BLE001 - only for the message
        return []


def load_torch(source: str | os.PathLike[str] | io.IOBase, where: str, trust_pickles: bool = False) -> Any:
    """``torch.load(source, weights_only=True)`` on the CPU; what that refuses raises
    :class:`UnsafeCheckpointError` naming ``where`` and the globals it wanted, or, with ``trust_pickles``,
    is loaded with full unpickling."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        wanted = _unsafe_globals(source) or re.findall(r"GLOBAL (\S+)", str(exc)) or [str(exc).splitlines()[0]]
        if not trust_pickles:
            raise UnsafeCheckpointError(
                f"{where} wants {', '.join(wanted)}, which torch's weights-only loader does not admit: reading it "
                f"could run code, so it is refused; {TRUST_HINT}",
                where, wanted,
            ) from None
        log.warning("trust_pickles: loading %s with full unpickling (it wants %s)", where, ", ".join(wanted))
        if hasattr(source, "seek"):
            source.seek(0)
        return torch.load(source, map_location="cpu", weights_only=False)


class _NoLinkFileSystem(FileSystem):
    """DCP's local file access opening every file of the checkpoint ``O_NOFOLLOW``: a data file that is a
    symbolic link (to a file outside the checkpoint) is refused, not read."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        path = Path(path)
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open_inside(path.parent, path.name, "DCP's reader") as stream:
            yield stream


class _BoundedTransforms:
    """DCP's undoing of an entry's transforms (zstd), bounded: the entry decodes to at most what its tensor's
    metadata (or the object-record limit) allows, see :mod:`smalti.checkpoint.limits`."""

    def __init__(self, reader: SafeFileSystemReader) -> None:
        self.reader = reader

    def transform_load_stream(self, read_item: Any, transform_descriptors: Any, raw_stream: Any) -> Any:
        """``raw_stream`` itself when the entry has no transform, else its decoded bytes (a ``BytesIO``)."""
        if not transform_descriptors:
            return raw_stream
        index = read_item.storage_index
        info = self.reader.storage_data[index]
        where = f"the entry {index.fqn!r} of {Path(self.reader.path) / info.relative_path}"
        limit = decoded_limit(self.reader.dcp_metadata, index, where)
        raw = raw_stream.read_all() if hasattr(raw_stream, "read_all") else raw_stream.read(info.length)
        if len(raw) != info.length:
            raise CheckpointCorruptError(f"{where} ends after {len(raw)} of its {info.length} bytes (truncated)", where)
        return io.BytesIO(decode_bounded(raw, transform_descriptors, limit, where))


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader reading ``.metadata`` through :func:`read_dcp_metadata`, no file through a link, no
    entry outside its file and no transformed entry past its bound (:mod:`smalti.checkpoint.limits`)."""

    def __init__(self, path: str | os.PathLike[str], trust_pickles: bool = False) -> None:
        super().__init__(path)
        self.fs = _NoLinkFileSystem()
        self.transforms = _BoundedTransforms(self)  # type: ignore[assignment]
        self.trust_pickles = trust_pickles
        self.dcp_metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's (or with ``rank=``, that rank's) metadata, read without running code from it."""
        rank = kwargs.get("rank")
        metadata = read_dcp_metadata(self._get_metadata_path(rank), self.trust_pickles)
        metadata.storage_meta.load_id = self.load_id
        if rank is None:
            self.dcp_metadata = metadata
        return metadata

    def check_plan(self, plan: Any) -> None:
        """Before anything is read: every file ``plan`` reads is inside the folder and no link, and every
        entry's byte range lies inside its file (as long as the file is now)."""
        sizes: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            rel = info.relative_path
            if rel not in sizes:
                path = no_link_inside(self.path, check_inside(rel, "DCP's metadata"), "named by DCP's metadata")
                sizes[rel] = os.lstat(path).st_size
            check_extent(info, sizes[rel], f"the entry {item.storage_index.fqn!r} of {Path(self.path) / rel}")

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's read, once :meth:`check_plan` passes."""
        self.check_plan(plan)
        return super().read_data(plan, planner)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner reading the objects stored in data files (not tensors) through :func:`load_torch`,
    where DCP's own planner would unpickle them fully."""

    def __init__(self, *args: Any, trust_pickles: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trust_pickles = trust_pickles

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from smalti.checkpoint._compat import set_element

        fqn = read_item.dest_index.fqn
        info = (getattr(self.metadata, "storage_data", None) or {}).get(read_item.storage_index)
        where = f"the entry {fqn!r} of {getattr(info, 'relative_path', 'a DCP data file')}"
        obj = load_torch(value, where, self.trust_pickles)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def unwrap_unsafe(exc: BaseException) -> CheckpointError | None:
    """The refusal inside ``exc`` (DCP wraps what a rank raised while reading in a ``CheckpointException`` of
    every rank's failures): an :class:`UnsafeCheckpointError`, :class:`UnsafePathError` or
    :class:`EntryTooLargeError`, or ``None``."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        item = todo.pop()
        if isinstance(item, tuple) and item:  # DCP's (exception, traceback) pairs
            item = item[0]
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (UnsafeCheckpointError, UnsafePathError, EntryTooLargeError)):
            return item
        todo += [item.__cause__, item.__context__, *(getattr(item, "failures", None) or {}).values()]
    return None


def to_safe_tree(obj: Any) -> Any:
    """``obj`` with NumPy arrays (the NumPy RNG state) as tagged tensors and NumPy scalars as Python numbers,
    so that ``torch.load(weights_only=True)`` reads it; :func:`from_safe_tree` undoes it."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise CheckpointError("a NumPy array of Python objects cannot be saved in the rank-local state")
        return {_NDARRAY: torch.from_numpy(np.ascontiguousarray(obj).copy()), "dtype": obj.dtype.str}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        items = {key: to_safe_tree(value) for key, value in obj.items()}
        return OrderedDict(items) if isinstance(obj, OrderedDict) else items
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_safe_tree(value) for value in obj)
    if isinstance(obj, list):
        return [to_safe_tree(value) for value in obj]
    return obj


def from_safe_tree(obj: Any) -> Any:
    """Undo :func:`to_safe_tree`."""
    if isinstance(obj, dict):
        if set(obj) == {_NDARRAY, "dtype"} and isinstance(obj[_NDARRAY], torch.Tensor):
            return obj[_NDARRAY].numpy().astype(np.dtype(obj["dtype"]), copy=False)
        items = {key: from_safe_tree(value) for key, value in obj.items()}
        return OrderedDict(items) if isinstance(obj, OrderedDict) else items
    if isinstance(obj, tuple):
        return tuple(from_safe_tree(value) for value in obj)
    if isinstance(obj, list):
        return [from_safe_tree(value) for value in obj]
    return obj


def dump_safe(obj: Any, where: str, check: bool = True) -> bytes:
    """``torch.save`` bytes of ``to_safe_tree(obj)``, checked (unless ``check`` is false: then call
    :func:`check_safe` later) to load with ``weights_only=True``: what cannot be read back without unpickling
    code is refused at save time, naming the class."""
    buffer = io.BytesIO()
    torch.save(to_safe_tree(obj), buffer)
    data = buffer.getvalue()
    if check:
        check_safe(data, where)
    return data


def check_safe(data: bytes, where: str) -> None:
    """Raise :class:`CheckpointError` naming the classes when ``torch.save`` bytes ``data`` do not load with
    ``weights_only=True``."""
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        wanted = _unsafe_globals(io.BytesIO(data))
        raise CheckpointError(
            f"{where} would hold objects of {', '.join(wanted) or 'a class'} that only full unpickling can read "
            "back; the state a plugin (plugin_state_dict), scheduler or data loader returns must be tensors, "
            "numbers, strings, NumPy arrays and lists, tuples and dicts of them"
        ) from None
