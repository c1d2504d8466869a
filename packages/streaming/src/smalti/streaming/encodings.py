"""MDS column encodings: how each value becomes bytes in a shard, exactly as mosaicml-streaming lays them out."""

from __future__ import annotations

import functools
import json
import pickle
import struct
from collections.abc import Callable
from decimal import Decimal
from io import BytesIO
from typing import Any

import numpy as np

from smalti.streaming.errors import StreamingError

FIXED = {
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
    "float16": np.float16, "float32": np.float32, "float64": np.float64,
}
VARIABLE = ("bytes", "str", "json", "pkl", "str_int", "str_float", "str_decimal", "jpeg", "png", "pil",
            "list[pil]", "list[jpeg]", "list[png]", "jpeg_array", "jpegarray")
UNSAFE = ("pkl",)
_DTYPE_CODES = {"uint8": 8, "int8": 9, "uint16": 16, "int16": 17, "float16": 18, "uint32": 32, "int32": 33,
                "float32": 34, "uint64": 64, "int64": 65, "float64": 66}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
_WIDTHS = (np.uint8, np.uint16, np.uint32, np.uint64)


def _ndarray_spec(encoding: str) -> tuple[str | None, tuple[int, ...] | None]:
    parts = encoding.split(":")
    dtype = parts[1] if len(parts) > 1 and parts[1] else None
    shape = tuple(int(d) for d in parts[2].split(",")) if len(parts) > 2 else None
    if dtype is not None and dtype not in _DTYPE_CODES:
        raise StreamingError(f"encoding {encoding!r}: dtype {dtype} is not one of {', '.join(_DTYPE_CODES)}")
    return dtype, shape


def is_known(encoding: str) -> bool:
    return encoding in FIXED or encoding == "int" or encoding in VARIABLE or encoding.startswith("ndarray")


def fixed_size(encoding: str) -> int | None:
    """Bytes per value for fixed-size encodings, ``None`` for variable-size ones."""
    if encoding in FIXED:
        return np.dtype(FIXED[encoding]).itemsize
    if encoding == "int":
        return 8
    if encoding.startswith("ndarray"):
        dtype, shape = _ndarray_spec(encoding)
        if dtype is not None and shape is not None:
            return int(np.prod(shape)) * np.dtype(dtype).itemsize
    return None


def column_spec(encoding: str) -> tuple[np.dtype, tuple[int, ...]] | None:
    """``(dtype, shape)`` of one value when ``encoding`` stores a fixed-size number or array, else ``None``.

    Such a column can be read for many samples at once as a strided array (see ``ShardReader.column_views``).
    """
    if encoding in FIXED:
        return np.dtype(FIXED[encoding]), ()
    if encoding == "int":
        return np.dtype(np.int64), ()
    if encoding.startswith("ndarray"):
        dtype, shape = _ndarray_spec(encoding)
        if dtype is not None and shape is not None:
            return np.dtype(dtype), shape
    return None


def check(encoding: str, allow_unsafe_types: bool = False, column: str = "?") -> None:
    """Raise naming the column when ``encoding`` is unknown or unsafe (``pkl``) and not allowed."""
    if not is_known(encoding):
        raise StreamingError(f"column {column!r}: unknown encoding {encoding!r}")
    if encoding in UNSAFE and not allow_unsafe_types:
        raise StreamingError(
            f"column {column!r} uses {encoding!r}, which can run code when read; pass allow_unsafe_types=True "
            "if you trust the data"
        )


def encode(encoding: str, value: Any) -> bytes:
    """Bytes of ``value`` under ``encoding`` (a ``bytes`` value is stored verbatim)."""
    if isinstance(value, bytes) and encoding not in FIXED and encoding != "int":
        return value
    if encoding in FIXED:
        return np.asarray(value, dtype=FIXED[encoding]).tobytes()
    if encoding == "int":
        if not isinstance(value, int | np.integer):
            raise StreamingError(f"encoding 'int' needs a Python int, got {type(value).__name__}")
        return np.int64(value).tobytes()
    if encoding == "str":
        return value.encode("utf-8")
    if encoding == "json":
        return json.dumps(value.tolist() if isinstance(value, np.ndarray) else value).encode("utf-8")
    if encoding == "pkl":
        return pickle.dumps(value)
    if encoding in ("str_int", "str_float", "str_decimal"):
        return str(value).encode("utf-8")
    if encoding.startswith("ndarray"):
        return _encode_ndarray(encoding, value)
    return _encode_image(encoding, value)


@functools.lru_cache(maxsize=256)
def decoder(encoding: str) -> Callable[[bytes | memoryview], Any]:
    """A function decoding ``encoding``'s bytes, with the encoding parsed once (for the read loop)."""
    if encoding in FIXED:
        dtype = np.dtype(FIXED[encoding])
        return lambda data: np.frombuffer(data, dtype=dtype, count=1)[0]
    if encoding.startswith("ndarray"):
        dtype, shape = _ndarray_spec(encoding)
        if dtype is not None and shape is not None:
            np_dtype = np.dtype(dtype)
            return lambda data: np.frombuffer(data, dtype=np_dtype).reshape(shape).copy()
    if encoding in ("bytes", "str", "json", "str_int", "str_float", "str_decimal", "pkl") or \
            encoding.startswith("ndarray"):
        return lambda data: decode(encoding, data if isinstance(data, bytes) else bytes(data))
    return lambda data: decode(encoding, bytes(data))


def decode(encoding: str, data: bytes) -> Any:
    """The value ``data`` holds under ``encoding``."""
    if encoding in FIXED:
        return np.frombuffer(data, dtype=FIXED[encoding])[0]
    if encoding == "int":
        return int(np.frombuffer(data, dtype=np.int64)[0])
    if encoding == "bytes":
        return data
    if encoding == "str":
        return data.decode("utf-8")
    if encoding == "json":
        return json.loads(data.decode("utf-8"))
    if encoding == "pkl":
        return pickle.loads(data)
    if encoding == "str_int":
        return int(data.decode())
    if encoding == "str_float":
        return float(data.decode())
    if encoding == "str_decimal":
        return Decimal(data.decode())
    if encoding.startswith("ndarray"):
        return _decode_ndarray(encoding, data)
    return _decode_image(encoding, data)


def _encode_ndarray(encoding: str, value: Any) -> bytes:
    dtype, shape = _ndarray_spec(encoding)
    if isinstance(value, np.ndarray):
        arr = value
        if dtype is not None and arr.dtype != np.dtype(dtype):  # never cast silently: values could change
            raise StreamingError(f"encoding {encoding!r}: array of dtype {arr.dtype} given; convert it first")
    else:
        arr = np.asarray(value, dtype=dtype)
    if arr.ndim == 0 or arr.size == 0 or arr.ndim > 63:
        raise StreamingError(f"encoding {encoding!r}: arrays must have 1 to 63 dimensions and some elements")
    head = b""
    if dtype is None:
        if arr.dtype.name not in _DTYPE_CODES:
            raise StreamingError(f"encoding {encoding!r}: dtype {arr.dtype} is not storable; use one of "
                                 f"{', '.join(_DTYPE_CODES)}")
        head += bytes([_DTYPE_CODES[arr.dtype.name]])
    if shape is None:
        width = next(i for i, w in enumerate(_WIDTHS) if max(arr.shape) <= np.iinfo(w).max)
        head += bytes([(arr.ndim << 2) | width]) + np.asarray(arr.shape, dtype=_WIDTHS[width]).tobytes()
    elif tuple(arr.shape) != shape:
        raise StreamingError(f"encoding {encoding!r}: array of shape {arr.shape} does not match")
    return head + np.ascontiguousarray(arr).tobytes()


def _decode_ndarray(encoding: str, data: bytes) -> np.ndarray:
    dtype, shape = _ndarray_spec(encoding)
    pos = 0
    if dtype is None:
        dtype = _CODE_DTYPES[data[0]]
        pos = 1
    if shape is None:
        ndim, width = data[pos] >> 2, data[pos] & 3
        pos += 1
        size = np.dtype(_WIDTHS[width]).itemsize
        shape = tuple(int(d) for d in np.frombuffer(data, dtype=_WIDTHS[width], count=ndim, offset=pos))
        pos += ndim * size
    return np.frombuffer(data, dtype=dtype, offset=pos).reshape(shape).copy()


def _encode_image(encoding: str, value: Any) -> bytes:
    if encoding == "pil":
        mode = value.mode.encode()
        return struct.pack("<III", value.width, value.height, len(mode)) + mode + value.tobytes()
    if encoding == "jpeg" and getattr(value, "format", None) == "JPEG" and getattr(value, "filename", None):
        try:  # an image opened from a JPEG file is stored as that file's bytes, not re-encoded
            with open(value.filename, "rb") as f:
                return f.read()
        except OSError:
            pass
    if encoding in ("jpeg", "png"):
        buf = BytesIO()
        value.save(buf, format="JPEG" if encoding == "jpeg" else "PNG")
        return buf.getvalue()
    if encoding.startswith("list["):
        items = [_encode_image(encoding[5:-1], v) for v in value]
        return struct.pack(f"<II{len(items)}I", 0, len(items), *map(len, items)) + b"".join(items)
    if encoding in ("jpeg_array", "jpegarray"):
        items = [bytes(v) if isinstance(v, bytes | bytearray | memoryview) else _encode_image("jpeg", v)
                 for v in value]
        return struct.pack(f"<I{len(items)}I", len(items), *map(len, items)) + b"".join(items)
    raise StreamingError(f"unknown encoding {encoding!r}")


MAX_PIL_PIXELS = 1 << 28  # pixels of one ``pil`` image at most (PIL's own limit applies too, when it is set)


def _pil_bytes(mode: str, width: int, height: int) -> int:
    """The bytes ``Image.tobytes()`` gives for an image of ``mode`` and size (raise ``ValueError`` if unknown)."""
    from PIL import ImageMode

    if mode == "1":
        return (width + 7) // 8 * height
    info = ImageMode.getmode(mode)  # KeyError for an unknown mode
    return width * height * len(info.bands) * np.dtype(info.typestr).itemsize


def _pixel_limit() -> int:
    from PIL import Image

    return MAX_PIL_PIXELS if Image.MAX_IMAGE_PIXELS is None else min(MAX_PIL_PIXELS, 2 * Image.MAX_IMAGE_PIXELS)


def _decode_pil(data: bytes) -> Any:
    """A ``pil`` value, with its declared size checked against its bytes before any image is allocated."""
    from PIL import Image

    if len(data) < 12:
        raise StreamingError(f"a pil value of {len(data)} bytes is shorter than its 12-byte header")
    w, h, n = struct.unpack("<III", data[:12])
    try:
        mode = data[12 : 12 + n].decode()
    except UnicodeDecodeError:
        raise StreamingError(f"a pil value's mode {data[12 : 12 + n][:16]!r} is not text") from None
    if w * h > _pixel_limit():
        raise StreamingError(f"a pil value declares {w}x{h} = {w * h} pixels, more than the limit of "
                             f"{_pixel_limit()} (MAX_PIL_PIXELS / PIL's Image.MAX_IMAGE_PIXELS x2)")
    try:
        expected = _pil_bytes(mode, w, h)
    except (KeyError, ValueError, TypeError):
        raise StreamingError(f"a pil value has the unknown image mode {mode[:16]!r}") from None
    pixels = data[12 + n :]
    if len(pixels) != expected:
        raise StreamingError(f"a pil value declares a {w}x{h} {mode} image ({expected} bytes) but holds "
                             f"{len(pixels)} bytes of pixels")
    return Image.frombytes(mode, (w, h), pixels)


def _decode_image(encoding: str, data: bytes) -> Any:
    from PIL import Image

    if encoding == "pil":
        return _decode_pil(data)
    if encoding in ("jpeg", "png"):
        try:  # PIL refuses more than twice Image.MAX_IMAGE_PIXELS here, from the header, before decoding
            return Image.open(BytesIO(data))
        except Image.DecompressionBombError as exc:
            raise StreamingError(f"a {encoding} value is a decompression bomb: {exc}") from None
    if encoding.startswith("list[") or encoding in ("jpeg_array", "jpegarray"):
        offset = 4 if encoding.startswith("list[") else 0
        (n,) = struct.unpack("<I", data[offset : offset + 4])
        if offset + 4 + 4 * n > len(data):
            raise StreamingError(f"a {encoding} value declares {n} items, more than its {len(data)} bytes can hold")
        sizes = struct.unpack(f"<{n}I", data[offset + 4 : offset + 4 + 4 * n])
        pos, out = offset + 4 + 4 * n, []
        inner = encoding[5:-1] if encoding.startswith("list[") else "jpeg"
        for size in sizes:
            out.append(_decode_image(inner, data[pos : pos + size]))
            pos += size
        return out
    raise StreamingError(f"unknown encoding {encoding!r}")
