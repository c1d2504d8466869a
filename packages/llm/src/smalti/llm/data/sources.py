"""Reading documents from text, JSONL and Parquet files (local paths)."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from smalti.llm.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".text")


SHIPPED_PREFIX = "smalti-llm:"


def resolve_path(item: str | os.PathLike) -> Path:
    """A local path; ``smalti-llm:<name>`` names a file shipped in ``smalti/llm/assets``."""
    text = str(item)
    if text.startswith(SHIPPED_PREFIX):
        from importlib import resources

        return Path(str(resources.files("smalti.llm") / "assets" / text[len(SHIPPED_PREFIX):]))
    return Path(text).expanduser()


def expand_inputs(inputs: Iterable[str | os.PathLike]) -> list[Path]:
    """Files named by ``inputs``; a folder stands for its text, JSONL and Parquet files (sorted)."""
    out: list[Path] = []
    if isinstance(inputs, str | os.PathLike):
        inputs = [inputs]
    for item in inputs:
        path = resolve_path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p) is not None)
            if not found:
                raise DataError(f"input folder {path} holds no .txt, .jsonl/.json/.jsonl.gz or .parquet files")
            out.extend(found)
        elif path.is_file():
            out.append(path)
        else:
            raise DataError(f"input {str(path)!r} does not exist; give text, JSONL or Parquet files or folders")
    return out


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith((".jsonl", ".json", ".jsonl.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def iter_records(files: Iterable[str | os.PathLike]) -> Iterator[dict[str, Any]]:
    """Each record of JSONL or Parquet files as a dict; a text file gives one ``{"text": ...}`` per
    paragraph (blank-line separated)."""
    for path in expand_inputs(files):
        kind = _kind(path) or "text"
        if kind == "text":
            for para in path.read_text(encoding="utf-8").split("\n\n"):
                if para.strip():
                    yield {"text": para.strip()}
        elif kind == "jsonl":
            yield from _iter_jsonl(path)
        else:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            yield from table.to_pylist()


def _iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file, gzip-compressed when its name ends in ``.gz``."""
    gz = path.name.lower().endswith(".gz")
    try:
        with (gzip.open(path, "rt", encoding="utf-8") if gz else path.open(encoding="utf-8")) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{lineno} is not valid JSON ({exc.msg})") from exc
    except (gzip.BadGzipFile, EOFError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} cannot be read as {'gzip-compressed ' if gz else ''}UTF-8 JSONL ({exc})") from exc


def iter_documents(files: Iterable[str | os.PathLike], text_key: str = "text") -> Iterator[str]:
    """The text of each document in ``files`` (``text_key`` of JSONL/Parquet records)."""
    for record in iter_records(files):
        if text_key not in record:
            raise DataError(f"a record has no {text_key!r} key (keys: {sorted(record)}); pass --text-key")
        yield str(record[text_key])
