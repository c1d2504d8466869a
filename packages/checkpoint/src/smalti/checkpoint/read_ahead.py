"""Loading checkpoint files straight into the tensors, and checking their digests from the same bytes.

A load reads each data file front to back (its items in offset order) with ``O_DIRECT`` into a few reused
huge-page buffers, I/O threads keeping the next reads in flight, and copies each tensor's bytes from there into
the tensor it loads into (no ``torch.load`` of the tensor, no allocation, one memory copy):
:class:`ReadAheadFileSystemReader` over :mod:`smalti.checkpoint.bounce_read`. The disk fills huge pages
faster than a tensor's scattered 4 KiB pages (buffered or not; see the README's performance section), and the
copy runs beside the disk on the other core.

:class:`ReadAhead` is this rank's share of the files to check. As soon as the checkpoint is chosen it starts
reading them (into its buffers, then waiting for the load to take the bytes), so the disk works while the
trainer builds its state. Each file's digest (the algorithm its manifest entry names) is fed every byte of the
file once, in file order, from the buffers as the load goes through them: the tensors' bytes and the bytes
between them (zip headers, pickles, items this rank does not load) alike; files this rank checks but does not
load are read the same way, only hashed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import struct
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from smalti.checkpoint import bounce_read
from smalti.checkpoint._compat import PyTorchFileReader, narrow_tensor_by_index, weights_only_unpickler
from smalti.checkpoint.bounce_read import FileStream, ReadPipeline
from smalti.checkpoint.errors import CheckpointCorruptError, CheckpointError
from smalti.checkpoint.hashes import check_algorithm, new_hasher
from smalti.checkpoint.io import CHUNK_BYTES
from smalti.checkpoint.safe_load import SafeFileSystemReader, no_link_inside

#: how much of this rank's files is read ahead of the load (the size of the read buffers), unless told otherwise
DEFAULT_WINDOW_BYTES = 64 << 20


@dataclasses.dataclass
class AheadFile:
    """One file to check: its path relative to the checkpoint folder, its size from the manifest, and the
    digest to check it against as the manifest spells it, ``"<algorithm>:<hex>"`` (``None``: only its size)."""

    relpath: str
    size: int
    hash: str | None = None


class FileCheck:
    """The running digest of one file, fed its bytes in file order (:meth:`feed`), and its :meth:`verdict`."""

    def __init__(self, path: Path, expected: AheadFile) -> None:
        self.path = path
        self.expected = expected
        self.digest = new_hasher(expected.hash.partition(":")[0]) if expected.hash is not None else None
        self.hashed_to = 0

    def feed(self, start: int, view: memoryview) -> None:
        """Bytes ``[start, start + len(view))`` of the file: hashed if they come next in order (else ignored)."""
        if start == self.hashed_to:
            if self.digest is not None:
                self.digest.update(view)
            self.hashed_to += len(view)

    def verdict(self) -> CheckpointCorruptError | None:
        """What is wrong with the file once every byte is fed (``None``: it matches its manifest entry)."""
        if self.hashed_to != self.expected.size:
            try:
                # the whole size: the reads stopped a block past the entry's
                size = os.stat(self.path).st_size
            except OSError:
                size = self.hashed_to
            return CheckpointCorruptError(
                f"checkpoint file {self.path} has {size} bytes but the manifest says {self.expected.size}",
                str(self.path),
            )
        if self.digest is not None and self.expected.hash is not None:
            algorithm, _, hexdigest = self.expected.hash.partition(":")
            if self.digest.hexdigest() != hexdigest:
                return CheckpointCorruptError(
                    f"checkpoint file {self.path} has {algorithm} {self.digest.hexdigest()[:16]}… but the manifest "
                    f"says {hexdigest[:16]}… (corrupted)",
                    str(self.path),
                )
        return None


class ReadAhead:
    """This rank's share of the data files of ``folder`` to check (see the module docstring): reading starts
    at once, into ``window_bytes`` of buffers (at least ``bounce_read.DEFAULT_BUFFERS`` of 16 MiB); the load
    takes each file's bytes from :meth:`stream` (in :attr:`order`); :meth:`finish` reads and hashes what is
    left and raises the first problem (in file order)."""

    def __init__(
        self, folder: Path, files: list[AheadFile], window_bytes: int = DEFAULT_WINDOW_BYTES
    ) -> None:
        self.folder = folder
        self.files = {f.relpath: f for f in files}
        self.order = [f.relpath for f in files]
        self.window_bytes = window_bytes
        for f in files:  # an algorithm missing here fails now, in the caller's thread, naming the fix
            with contextlib.suppress(FileNotFoundError):  # (a missing file: the verdict names it)
                no_link_inside(folder, f.relpath, "listed in the manifest")  # a link out of the folder fails now
            if f.hash is not None:
                check_algorithm(f.hash.partition(":")[0], f"the manifest entry of {folder / f.relpath}")
        self._checks = {f.relpath: FileCheck(folder / f.relpath, f) for f in files}
        self.pipeline = (
            ReadPipeline(max(window_bytes // CHUNK_BYTES, bounce_read.DEFAULT_BUFFERS))
            if files
            else None
        )
        # one byte past the entry's size: a file longer than its entry shows
        self._streams = {
            f.relpath: self.pipeline.open(folder / f.relpath, [(0, f.size + 1)], self._checks[f.relpath].feed)
            for f in files
            if self.pipeline is not None
        }

    def check(self, relpath: str) -> FileCheck | None:
        """The digest of ``relpath`` (``None``: another rank checks it)."""
        return self._checks.get(relpath)

    def stream(self, relpath: str) -> FileStream | None:
        """The bytes of ``relpath`` as they are read (``None``: another rank checks it). Streams are taken in
        :attr:`order`: each one's bytes are all taken (:meth:`FileStream.drain`) before the next one's."""
        return self._streams.get(relpath)

    def finish(self, timeout: float | None = None) -> None:
        """Read and hash every byte not hashed yet and raise the first problem (in file order):
        :class:`CheckpointCorruptError` for a bad file, :class:`CheckpointError` for one that cannot be read."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for relpath in self.order:
                stream = self._streams[relpath]
                stream.deadline = deadline
                try:
                    stream.drain()
                except OSError as exc:
                    raise CheckpointError(f"reading checkpoint file {stream.path}: {exc}") from None
                finally:
                    stream.close()
                problem = self._checks[relpath].verdict()
                if problem is not None:
                    raise problem
        finally:
            if self.pipeline is not None:
                self.pipeline.close()


class _Window(io.RawIOBase):
    """A seekable read-only file over bytes ``[start, end)`` of a file; subclasses say where the bytes come from."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__()
        self._start = start
        self._end = end
        self._pos = start

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos - self._start

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: self._start, os.SEEK_CUR: self._pos, os.SEEK_END: self._end}[whence]
        self._pos = min(max(base + offset, self._start), self._end)
        return self.tell()


class _FileSpan(_Window):
    """A window over a file's :class:`~smalti.checkpoint.bounce_read.FileStream`; :meth:`copy_to` copies a
    tensor's bytes straight into it."""

    def __init__(self, stream: FileStream, start: int, end: int, path: Path) -> None:
        super().__init__(start, end)
        self._stream = stream
        self._path = path

    def copy_to(self, target: torch.Tensor, offset: int) -> None:
        """Copy ``target.numel()`` bytes from ``offset`` (within the span) into the uint8 tensor ``target``."""
        begin = self._start + offset
        if begin + target.numel() > self._end:
            raise CheckpointError(
                f"bytes {offset}..{offset + target.numel()} lie outside a span of {self._end - self._start}"
            )
        host = target if target.device.type == "cpu" else torch.empty(target.shape, dtype=torch.uint8)
        got = self._stream.read_into(begin, memoryview(host.numpy()).cast("B"))
        if got < target.numel():
            raise self._truncated(begin + got)
        if host is not target:
            target.copy_(host)

    def read_all(self) -> bytes:
        """The span's bytes (all of them: a file ending before raises :class:`CheckpointCorruptError`)."""
        data = self.read_at(0, self._end - self._start)
        if len(data) < self._end - self._start:
            raise self._truncated(self._start + len(data))
        return data

    def _truncated(self, at: int) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"checkpoint file {self._path} ends at byte {at}, before the end of the item at "
            f"{self._start}..{self._end} DCP's metadata points to (truncated)",
            str(self._path),
        )

    def read_at(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes from ``offset`` within the span (fewer at its end)."""
        n = max(min(n, self._end - self._start - offset), 0)
        if not n:
            return b""
        out = bytearray(n)
        got = self._stream.read_into(self._start + offset, memoryview(out))
        return bytes(out[:got]) if got < n else bytes(out)

    def readinto(self, target: Any) -> int:
        out = memoryview(target).cast("B")[: self._end - self._pos]
        if not len(out):
            return 0
        n = self._stream.read_into(self._pos, out)
        self._pos += n
        return n


class ReadAheadFileSystemReader(SafeFileSystemReader):
    """DCP's file reader reading each file once, front to back, tensors copied straight into their targets (see
    the module docstring), feeding the digests of the files ``read_ahead`` checks. ``.metadata`` is read without
    running code from it (see :mod:`smalti.checkpoint.safe_load`; ``trust_pickles`` lifts that)."""

    def __init__(
        self, path: str | os.PathLike[str], read_ahead: ReadAhead | None, trust_pickles: bool = False
    ) -> None:
        super().__init__(path, trust_pickles)
        self.read_ahead = read_ahead
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``.metadata``, unpickled once per reader (through the restricted unpickler): the load reads it
        before DCP does (to check the keys and make the optimizer's state), and on a large run it is the biggest
        file every rank reads whole."""
        if args or kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        self._metadata.storage_meta.load_id = self.load_id  # DCP's reset() gives each load its own id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        """Load ``plan``'s items: the files ``read_ahead`` checks first, in its order (those this rank does not
        load only hashed), then the others (only the bytes of their items); each file read once, front to
        back, its tensors copied straight into their targets where the layouts allow, else as DCP's reader
        would."""
        ahead = self.read_ahead
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        self.check_plan(plan)  # names inside the folder, no links, byte ranges inside the files
        live = ahead is not None and ahead.pipeline is not None and not ahead.pipeline.closed
        checked = list(ahead.order) if live and ahead is not None else []
        others = [rel for rel in per_file if rel not in checked]
        pipeline = ahead.pipeline if checked and ahead is not None else None
        own_pipeline = pipeline is None and bool(others)
        if own_pipeline:
            pipeline = ReadPipeline()
        streams: list[tuple[str, FileStream]] = [(rel, ahead.stream(rel)) for rel in checked]  # type: ignore[misc,union-attr]
        own: list[FileStream] = []
        try:
            # queued behind the checked files: the I/O threads go on from one into the next
            for rel in others:
                infos = [self.storage_data[item.storage_index] for item in per_file[rel]]
                assert pipeline is not None
                own.append(
                    pipeline.open(Path(self.path) / rel, [(i.offset, i.offset + i.length) for i in infos])
                )
                streams.append((rel, own[-1]))
            for rel, stream in streams:
                path = Path(self.path) / rel
                for item in sorted(
                    per_file.get(rel, ()), key=lambda i: self.storage_data[i.storage_index].offset
                ):
                    info = self.storage_data[item.storage_index]
                    self._load_item(
                        item, info, _FileSpan(stream, info.offset, info.offset + info.length, path), planner
                    )
                stream.drain()  # a checked file's bytes after its last item are hashed now: the next file's follow
        finally:
            for stream in own:
                stream.cancel()
            if own_pipeline:
                assert pipeline is not None
                pipeline.close()
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _load_item(self, item: Any, info: Any, span: _FileSpan, planner: LoadPlanner) -> None:
        """What DCP's reader does with one item's bytes: hand them over, or load the tensor into its target."""
        stream = self.transforms.transform_load_stream(item, info.transform_descriptors or (), span)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(span.read_all()) if stream is span else stream)
            return
        if stream is span:
            if self._copy_in_place(item, span, planner):
                return
            stream = io.BytesIO(span.read_all())  # the item's bytes in order (torch.load seeks about)
        if not stream.seekable():
            stream = io.BytesIO(stream.read(-1))
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointError(
                f"item {item.storage_index} has size {tuple(tensor.size())}, its target {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    @staticmethod
    def _copy_in_place(item: Any, span: _FileSpan, planner: LoadPlanner) -> bool:
        """Copy the item's tensor bytes from the file straight into its target; False (nothing
        done) where the layouts do not allow it, and ``torch.load`` takes over.

        ``torch.load`` would allocate a new tensor (fresh pages the kernel must zero and map) and copy into it,
        then DCP copies that into the target: two copies and an allocation, the largest CPU cost of a load.
        Here only the pickle is read (with its storages on the meta device, to learn dtype, shape, strides and
        offset), and when the (narrowed) saved tensor and the target are both contiguous with the same dtype
        and shape, the bytes are copied into the target from the read buffers: one copy.

        Where the tensor's record lies is learnt from the archive's start (:func:`_locate_from_start`), so the
        file is read front to back; only where that fails is the zip directory at the item's end read first.
        """
        located = _locate_from_start(span)
        from_start = located is not None
        if located is None:
            located = _locate_by_directory(span)
        if located is None:
            return False
        saved, record_start, record_size = located
        saved = narrow_tensor_by_index(saved, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if not (
            saved.is_contiguous()
            and target.is_contiguous()
            and saved.dtype == target.dtype
            and saved.size() == target.size()
        ):
            return False
        start = record_start + saved.storage_offset() * saved.element_size()
        nbytes = saved.numel() * saved.element_size()
        if start + nbytes > record_start + record_size:
            return False
        if nbytes:
            span.copy_to(target.reshape(-1).view(torch.uint8), start)
        if from_start and not _record_ends_at(span, record_start + record_size, record_size):
            return False  # not the layout it seemed: torch.load reads the item (over the bytes just read)
        planner.commit_tensor(item, target)
        return True


def _saved_on_meta(pickle: Any) -> tuple[torch.Tensor, str] | None:
    """The tensor a ``data.pkl`` describes, its storage on the meta device, and its storage's record key
    (``None``: not one tensor over one storage). Unpickled with torch's weights-only unpickler."""
    keys: list[str] = []

    def storage_on_meta(saved_id: Any) -> Any:
        _, storage_type, key, _, numel = saved_id
        keys.append(key)
        dtype = storage_type.dtype
        untyped = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    unpickler = weights_only_unpickler.Unpickler(pickle, encoding="utf-8")
    unpickler.persistent_load = storage_on_meta
    saved = unpickler.load()
    if not isinstance(saved, torch.Tensor) or len(keys) != 1:
        return None
    return saved, keys[0]


def _locate_by_directory(span: _FileSpan) -> tuple[torch.Tensor, int, int] | None:
    """``(saved tensor on meta, its record's offset in the span, the record's size)`` from the zip directory at
    the end of the item's archive (``None``: not a single little-endian tensor)."""
    try:
        archive = PyTorchFileReader(span)
        if archive.has_record("byteorder") and archive.get_record("byteorder") != b"little":
            return None
        found = _saved_on_meta(io.BytesIO(archive.get_record("data.pkl")))
        if found is None:
            return None
        saved, key = found
        record = f"data/{key}"
        return saved, archive.get_record_offset(record), archive.get_record_size(record)
    except Exception:  # noqa: BLE001 - anything unexpected: torch.load reads the item as DCP would
        return None


_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header, before its name and extra field
_LOCAL_SIGNATURE = 0x04034B50
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
#: how much of an item's start is read to find its tensor's record (the pickle and the small records before it)
HEAD_BYTES = 64 << 10


def _after_descriptor(data: bytes, at: int, size: int) -> int | None:
    """Where the zip data descriptor at ``at`` (of a record of ``size`` bytes, 32- or 64-bit sizes) ends;
    ``None`` if there is none that says ``size``."""
    if data[at : at + 4] != _DESCRIPTOR_SIGNATURE:
        return None
    if len(data) >= at + 16 and struct.unpack_from("<II", data, at + 8) == (size, size):
        return at + 16
    if len(data) >= at + 24 and struct.unpack_from("<QQ", data, at + 8) == (size, size):
        return at + 24
    return None


def _locate_from_start(span: _FileSpan) -> tuple[torch.Tensor, int, int] | None:
    """What :func:`_locate_by_directory` finds, learnt by walking the archive from its start instead: the
    local headers of ``data.pkl`` and the small records torch.save writes before the tensor's (each checked
    against the data descriptor after it). ``None`` where the item does not look exactly like that (the
    caller then reads the directory); the descriptor after the tensor's record is checked once its bytes
    are read (:func:`_record_ends_at`)."""
    try:
        head = span.read_at(0, HEAD_BYTES)

        def local_header(at: int) -> tuple[str, int] | None:
            if at + _LOCAL_HEADER.size > len(head):
                return None
            fields = _LOCAL_HEADER.unpack_from(head, at)
            if fields[0] != _LOCAL_SIGNATURE or fields[3] != 0:  # not a local header, or compressed
                return None
            name_len, extra_len = fields[9], fields[10]
            name = head[at + 30 : at + 30 + name_len].decode("utf-8")
            return name, at + 30 + name_len + extra_len

        first = local_header(0)
        if first is None or not first[0].endswith("/data.pkl"):
            return None
        prefix, pickle_start = first[0].removesuffix("data.pkl"), first[1]
        pickle = io.BytesIO(head)
        pickle.seek(pickle_start)
        found = _saved_on_meta(pickle)
        if found is None:
            return None
        saved, key = found
        at = _after_descriptor(head, pickle.tell(), pickle.tell() - pickle_start)
        for _ in range(8):  # .format_version, .storage_alignment, byteorder, ... then data/<key>
            if at is None:
                return None
            record = local_header(at)
            if record is None:
                return None
            name, data_start = record
            if name == f"{prefix}data/{key}":
                return saved, data_start, saved.untyped_storage().nbytes()
            end = head.find(_DESCRIPTOR_SIGNATURE, data_start)
            if end < 0 or (name == f"{prefix}byteorder" and head[data_start:end] != b"little"):
                return None
            at = _after_descriptor(head, end, end - data_start)
    except Exception:  # noqa: BLE001 - anything unexpected: the directory is read instead
        return None
    return None


def _record_ends_at(span: _FileSpan, at: int, size: int) -> bool:
    """Whether a data descriptor saying ``size`` follows a record at ``at`` in the span."""
    return _after_descriptor(span.read_at(at, 24), 0, size) is not None
