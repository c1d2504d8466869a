"""``write_parallel``: turn inputs into one MDS dataset through a function, in several processes.

The counterpart of LitData's ``optimize(fn, inputs, ...)``: each process writes a contiguous part of the
inputs with :class:`~smalti.streaming.MDSWriter` into a sub-folder, and the dataset's ``index.json`` (listing
the parts in input order) is written last, so a failed or interrupted run never looks like a dataset.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from smalti.streaming.errors import StreamingError
from smalti.streaming.mds import DEFAULT_SIZE_LIMIT, DEFAULT_ZSTD_FRAME_SIZE, MDSWriter, merge_index


def _write_part(fn: Callable[[Any], Any], first: int, inputs: list[Any], out: Path, columns: dict[str, str],
                options: dict[str, Any]) -> int:
    """Write ``fn(x)`` for each of ``inputs`` (numbered from ``first``) to ``out``; the number of samples."""
    count = 0
    with MDSWriter(out, columns, **options) as writer:
        for number, item in enumerate(inputs, start=first):
            try:
                result = fn(item)
                samples = [result] if isinstance(result, Mapping) else result
                for sample in samples:
                    writer.write(sample)
                    count += 1
            except Exception as exc:
                raise StreamingError(f"write_parallel: fn failed on input {number} ({item!r:.100}): "
                                     f"{type(exc).__name__}: {exc}; nothing was published (no index.json in "
                                     f"{out.parent})") from exc
    return count


def write_parallel(fn: Callable[[Any], Mapping[str, Any] | Iterable[Mapping[str, Any]]], inputs: Iterable[Any],
                   out: str | os.PathLike[str], columns: dict[str, str], *, num_workers: int | None = None,
                   compression: str | None = None, hashes: list[str] | None = None,
                   size_limit: int | str | None = DEFAULT_SIZE_LIMIT, exist_ok: bool = False,
                   allow_unsafe_types: bool = False,
                   zstd_frame_size: int | str | None = DEFAULT_ZSTD_FRAME_SIZE) -> Path:
    """Write ``fn(x)`` for every ``x`` of ``inputs`` as one MDS dataset in the local folder ``out``.

    ``fn`` returns one sample (a mapping of ``columns``) or an iterable of samples. The samples keep the
    inputs' order. ``num_workers`` processes (default: the CPU count, at most one per input) each write a
    contiguous share of the inputs into ``out/part-NNNNN/``; ``fn`` must then be picklable (a module-level
    function). With ``num_workers=1`` everything runs in this process. The dataset's ``index.json`` is
    written last. An exception in ``fn`` is raised as :class:`StreamingError` naming the input. The writer
    options are :class:`~smalti.streaming.MDSWriter`'s. Returns ``out``.
    """
    if "://" in str(out):
        raise StreamingError(f"write_parallel(out={str(out)!r}) writes to a local folder; write there, then copy "
                             "the folder to the store (or use MDSWriter(out=URL) in one process)")
    items = list(inputs)
    if not items:
        raise StreamingError("write_parallel: inputs is empty; give at least one input")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not exist_ok:
        raise StreamingError(f"output directory {out} is not empty; pass exist_ok=True to overwrite")
    workers = max(1, min(num_workers or os.cpu_count() or 1, len(items)))
    options = {"compression": compression, "hashes": hashes, "size_limit": size_limit, "exist_ok": exist_ok,
               "allow_unsafe_types": allow_unsafe_types, "zstd_frame_size": zstd_frame_size}
    bounds = [len(items) * k // workers for k in range(workers + 1)]
    parts = [(f"part-{k:05d}", bounds[k], items[bounds[k] : bounds[k + 1]]) for k in range(workers)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.json").unlink(missing_ok=True)  # exist_ok: an old index must not outlive a failed run
    if workers == 1:
        for name, first, share in parts:
            _write_part(fn, first, share, out / name, columns, options)
    else:
        with ProcessPoolExecutor(workers) as pool:
            futures = [pool.submit(_write_part, fn, first, share, out / name, columns, options)
                       for name, first, share in parts]
            for future in futures:
                future.result()
    merge_index(out, [name for name, _, _ in parts])
    return out
