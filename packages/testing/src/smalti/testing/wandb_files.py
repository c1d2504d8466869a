"""Reads an offline W&B run file (``run-*.wandb``) back, so tests can check what a logger wrote.

The file is W&B's record log: a 7-byte header, then 32 KiB blocks of chunks, each with a
``crc32 | length (u16) | type (u8)`` header; types 1 (full), 2 (first), 3 (middle), 4 (last) join into
records, each a ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7


def read_records(path: str | Path) -> list[Any]:
    """Every protobuf record in the run file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (no :W&B header)")
    records, chunk, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        if kind == 0 and length == 0:
            break
        chunk += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def history(path: str | Path) -> list[dict[str, Any]]:
    """The logged history rows (``run.log`` calls) as dicts of key -> value."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def config(path: str | Path) -> dict[str, Any]:
    """The run config as updated through ``run.config``."""
    out: dict[str, Any] = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") == "config":
            for item in record.config.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
