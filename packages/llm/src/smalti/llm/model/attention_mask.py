"""Attention whose memory grows linearly with the sequence, for every mask smalti supports.

:class:`AttentionMask` describes what each query sees (causal, packed documents by ``sequence_id``, a sliding
window, ALiBi slopes) without materialising a ``[T, T]`` mask; :func:`attend` computes attention from it with
PyTorch's ``scaled_dot_product_attention`` on *tiles*:

- plain causal (no mask): one SDPA call with ``is_causal``;
- packed documents: one ``is_causal`` SDPA call per document span (documents are contiguous runs of one id;
  queries never look outside their span, so the spans are independent attention problems);
- a sliding window or ALiBi, where SDPA has no kernel of its own: each span is cut into query chunks; a chunk
  attends to the keys it can see (from the window's start, or the span's start, up to the chunk's end) with a
  float bias ``[H, chunk, keys]``. Every chunk's bias is a *view* of one tensor (the bias depends only on
  ``j - i``), built once per forward and shared by all layers, so SDPA saves no per-chunk copy for backward.
- ``sequence_id`` whose ids are not contiguous runs (an id that comes back later in a row): query chunks with
  the document mask built per chunk and recomputed in backward (activation checkpointing), so nothing of size
  ``T x T`` is held.

Memory: the saved tensors are the tiles' queries, keys and values (views of the layer's own), their outputs
and SDPA's log-sum-exp: linear in ``T``. Slicing goes through :class:`_Tiles`, whose backward adds each tile's
gradient into one buffer (autograd's own slicing allocates a zero tensor the size of the whole input per
slice, which costs time quadratic in ``T`` for many chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

#: Elements of the shared bias tensor ``[H, chunk, keys]`` (64 MB in fp32); the query chunk shrinks to fit.
BIAS_ELEMENTS = 1 << 24
#: Query rows per chunk where chunking is needed (fewer when the key range is long, see ``BIAS_ELEMENTS``).
CHUNK_ROWS = 512
MIN_CHUNK_ROWS = 16

# One SDPA call: batch rows ``r0:r1``, queries ``q0:q1``, keys ``k0:q1``, and whether it needs the bias.
Tile = tuple[int, int, int, int, int, bool]


@dataclass
class AttentionMask:
    """What each query may attend to, described rather than materialised.

    Query ``i`` sees key ``j`` when ``j <= i``, both are in the same document (same ``sequence_id``), and, with
    a ``window``, ``i - window < j`` (Mistral's rule). With ALiBi ``slopes`` (one per head the attention
    computes, i.e. this rank's heads under sequence parallelism), ``slope * (j - i)`` is added to the score.

    Build it with :meth:`build`, once per forward; the layers share it (and the bias tensor it caches).
    """

    seq_len: int
    spans: list[list[tuple[int, int]]] | None = None
    slopes: torch.Tensor | None = None
    window: int | None = None
    sequence_id: torch.Tensor | None = None  # kept only when its ids are not contiguous runs
    _bias: dict[Any, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        seq_len: int,
        sequence_id: torch.Tensor | None = None,
        slopes: torch.Tensor | None = None,
        window: int | None = None,
    ) -> AttentionMask | None:
        """The mask of one forward pass over sequences of ``seq_len``, or ``None`` for plain causal attention.

        ``sequence_id [B, T]``: packed documents (any integer ids; padding is a document of its own). Reads the
        document boundaries to the host once (one device sync per forward, not per layer).
        """
        window = window if window is not None and window < seq_len else None  # a window as long as T masks nothing
        spans = None
        general = None
        if sequence_id is not None:
            spans = _document_spans(sequence_id)
            if spans is None:
                general = sequence_id
            elif all(row == [(0, seq_len)] for row in spans):
                spans = None  # one document per row: nothing to mask beyond causality
        if spans is None and general is None and slopes is None and window is None:
            return None
        return cls(seq_len, spans, slopes, window, general)

    # ------------------------------------------------------------------ tiles

    def geometry(self) -> tuple[int, int]:
        """``(chunk, keys)``: query rows per chunked tile and the longest key range of one (the bias tensor's
        last two dimensions). ``CHUNK_ROWS`` rows, fewer when the bias would exceed ``BIAS_ELEMENTS``."""
        heads = 1 if self.slopes is None else self.slopes.numel()
        longest = self.seq_len if self.spans is None else max(e - s for row in self.spans for s, e in row)
        if self.window is not None:
            chunk = BIAS_ELEMENTS // (heads * (CHUNK_ROWS + self.window - 1))
            chunk = max(MIN_CHUNK_ROWS, min(CHUNK_ROWS, chunk, longest))
            return chunk, min(longest, chunk + self.window - 1)
        chunk = max(MIN_CHUNK_ROWS, min(CHUNK_ROWS, BIAS_ELEMENTS // (heads * longest), longest))
        return chunk, longest

    def tiles(self, batch: int) -> list[Tile]:
        """The SDPA calls of one attention, in output order: ``(r0, r1, q0, q1, k0, biased)`` for batch rows
        ``r0:r1``, queries ``q0:q1`` and keys ``k0:q1``. An unbiased tile has ``k0 == q0`` and runs with
        ``is_causal``; a biased one with a view of :meth:`bias`."""
        rows = [(0, batch, [(0, self.seq_len)])] if self.spans is None else [
            (b, b + 1, spans) for b, spans in enumerate(self.spans)
        ]
        chunk = self.geometry()[0]
        tiles: list[Tile] = []
        for r0, r1, spans in rows:
            for s, e in spans:
                if self.slopes is None and (self.window is None or e - s <= self.window):
                    tiles.append((r0, r1, s, e, s, False))
                    continue
                for q0 in range(s, e, chunk):
                    k0 = s if self.window is None else max(s, q0 - self.window + 1)
                    tiles.append((r0, r1, q0, min(q0 + chunk, e), k0, True))
        return tiles

    def bias(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``[1, H|1, chunk, K]`` float: row ``a`` is query ``K - chunk + a``, column ``c`` is key ``c``; ``-inf``
        where causality or the window hide the key, else the ALiBi ``slope * (c - query)`` (or 0). The bias
        depends only on ``j - i``, so any tile's bias is a view of its last rows and columns. Cached per device
        and dtype (the layers of one forward share it)."""
        key = (device, dtype)
        hit = self._bias.get(key)
        if hit is not None:
            return hit
        chunk, keys = self.geometry()
        rel = torch.arange(keys, device=device)[None, :] - torch.arange(keys - chunk, keys, device=device)[:, None]
        allowed = rel <= 0
        if self.window is not None:
            allowed &= rel > -self.window
        if self.slopes is None:
            bias = torch.zeros(1, 1, chunk, keys, device=device, dtype=dtype)
        else:
            slopes = self.slopes.to(device=device, dtype=torch.float32)
            bias = (slopes[:, None, None] * rel.to(torch.float32)[None]).to(dtype)[None]
        bias = bias.masked_fill(~allowed, float("-inf"))
        self._bias[key] = bias
        return bias

    @staticmethod
    def tile_bias(bias: torch.Tensor, q0: int, q1: int, k0: int) -> torch.Tensor:
        """The view of ``bias`` for queries ``q0:q1`` and keys ``k0:q1``."""
        chunk, keys = bias.shape[-2], bias.shape[-1]
        return bias[..., chunk - (q1 - q0) :, keys - (q1 - k0) :]


def _document_spans(sequence_id: torch.Tensor) -> list[list[tuple[int, int]]] | None:
    """Per row, the ``(start, stop)`` of each run of one id; ``None`` when an id comes back after another."""
    b, t = sequence_id.shape
    change = torch.ones(b, t, dtype=torch.bool, device=sequence_id.device)
    change[:, 1:] = sequence_id[:, 1:] != sequence_id[:, :-1]
    rows, starts = change.nonzero(as_tuple=True)
    ids = sequence_id[rows, starts]
    rows_l, starts_l, ids_l = rows.tolist(), starts.tolist(), ids.tolist()
    spans: list[list[tuple[int, int]]] = [[] for _ in range(b)]
    seen: list[set[int]] = [set() for _ in range(b)]
    for r, s, i in zip(rows_l, starts_l, ids_l):
        if i in seen[r]:
            return None
        seen[r].add(i)
        if spans[r]:
            spans[r][-1] = (spans[r][-1][0], s)
        spans[r].append((s, t))
    return spans


class _Tiles(torch.autograd.Function):
    """Views ``x[r0:r1, :, a:e]`` for many (possibly overlapping) ranges; the backward adds each view's gradient
    into one zero buffer in place, instead of one whole-size gradient per view as autograd's slicing does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ranges: list[tuple[int, int, int, int]]) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.ranges = ranges
        ctx.shape = x.shape
        return tuple(x[r0:r1, :, a:e] for r0, r1, a, e in ranges)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        ref = next((g for g in grads if g is not None), None)
        if ref is None:
            return None, None
        out = ref.new_zeros(ctx.shape)
        for (r0, r1, a, e), g in zip(ctx.ranges, grads):
            if g is not None:
                out[r0:r1, :, a:e] += g
        return out, None


def _tiles(x: torch.Tensor, ranges: list[tuple[int, int, int, int]]) -> tuple[torch.Tensor, ...]:
    if not x.requires_grad:
        return tuple(x[r0:r1, :, a:e] for r0, r1, a, e in ranges)
    return _Tiles.apply(x, ranges)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of ``q [B, H, T, D]`` over ``k, v [B, H_kv, T, D]`` (``H_kv`` dividing ``H``) under
    ``mask`` (``None``: plain causal); returns ``[B, H, T, D]``."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return _attend_tiles(q, k, v, mask, scale, gqa)


# Eager under torch.compile: the tiles follow each batch's document boundaries, which would recompile per batch.
@torch.compiler.disable
def _attend_tiles(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float | None, gqa: bool
) -> torch.Tensor:
    if mask.sequence_id is not None:
        return _attend_general(q, k, v, mask, scale, gqa)
    tiles = mask.tiles(q.shape[0])
    q_tiles = _tiles(q, [(r0, r1, q0, q1) for r0, r1, q0, q1, _, _ in tiles])
    k_tiles = _tiles(k, [(r0, r1, k0, q1) for r0, r1, _, q1, k0, _ in tiles])
    v_tiles = _tiles(v, [(r0, r1, k0, q1) for r0, r1, _, q1, k0, _ in tiles])
    bias = mask.bias(q.device, q.dtype) if any(tile[5] for tile in tiles) else None
    outs = []
    for (_, _, q0, q1, k0, biased), qt, kt, vt in zip(tiles, q_tiles, k_tiles, v_tiles):
        if biased:
            tb = mask.tile_bias(bias, q0, q1, k0)
            outs.append(F.scaled_dot_product_attention(qt, kt, vt, attn_mask=tb, scale=scale, enable_gqa=gqa))
        else:
            outs.append(F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa))
    return _assemble(outs, tiles)


def _assemble(outs: list[torch.Tensor], tiles: list[Tile]) -> torch.Tensor:
    """Concatenate tile outputs along positions per row group, then the row groups along the batch."""
    rows: list[list[torch.Tensor]] = []
    last = None
    for out, tile in zip(outs, tiles):
        if tile[0] != last:
            rows.append([])
            last = tile[0]
        rows[-1].append(out)
    parts = [torch.cat(r, dim=2) if len(r) > 1 else r[0] for r in rows]
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


def _attend_general(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, scale: float | None, gqa: bool
) -> torch.Tensor:
    """Documents that are not contiguous runs: query chunks over every key before them, with the document
    mask built per chunk and rebuilt in backward (nothing ``T x T`` is held)."""
    sid = mask.sequence_id
    assert sid is not None
    b, t = sid.shape
    heads = 1 if mask.slopes is None else mask.slopes.numel()
    chunk = max(MIN_CHUNK_ROWS, min(CHUNK_ROWS, BIAS_ELEMENTS // max(1, heads * t)))
    tiles = []
    for r in range(b):
        for q0 in range(0, t, chunk):
            q1 = min(q0 + chunk, t)
            k0 = 0 if mask.window is None else max(0, q0 - mask.window + 1)
            tiles.append((r, r + 1, q0, q1, k0, True))
    q_tiles = _tiles(q, [(r0, r1, q0, q1) for r0, r1, q0, q1, _, _ in tiles])
    k_tiles = _tiles(k, [(r0, r1, k0, q1) for r0, r1, _, q1, k0, _ in tiles])
    v_tiles = _tiles(v, [(r0, r1, k0, q1) for r0, r1, _, q1, k0, _ in tiles])
    slopes = mask.slopes

    def one(qt: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, r: int, q0: int, q1: int, k0: int) -> torch.Tensor:
        rel = torch.arange(k0, q1, device=q.device)[None, :] - torch.arange(q0, q1, device=q.device)[:, None]
        allowed = (rel <= 0) & (sid[r, q0:q1, None] == sid[r, None, k0:q1])
        if mask.window is not None:
            allowed &= rel > -mask.window
        if slopes is None:
            bias = torch.zeros(1, 1, *rel.shape, device=q.device, dtype=q.dtype)
        else:
            bias = (slopes.to(q.device, torch.float32)[:, None, None] * rel.to(torch.float32)).to(q.dtype)[None]
        bias = bias.masked_fill(~allowed, float("-inf"))
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=scale, enable_gqa=gqa)

    outs = []
    for (r, _, q0, q1, k0, _), qt, kt, vt in zip(tiles, q_tiles, k_tiles, v_tiles):
        if torch.is_grad_enabled() and qt.requires_grad:
            outs.append(checkpoint(one, qt, kt, vt, r, q0, q1, k0, use_reentrant=False))
        else:
            outs.append(one(qt, kt, vt, r, q0, q1, k0))
    return _assemble(outs, tiles)
