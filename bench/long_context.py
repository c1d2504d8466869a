"""Long context: memory and time of one training step from 16K to 128K tokens, packed documents vs plain causal.

A tiny Llama (2 layers, d_model 64, 4 heads, 2 KV heads, RoPE, SwiGLU) trains one step (forward, fused
linear + cross-entropy loss, backward, AdamW) on one row of ``T`` tokens, split over 2 gloo ranks with Ulysses
sequence parallelism (``sp=2``):

- ``plain``: one document per row, plain causal attention;
- ``packed``: documents of 1,024 to 8,192 tokens (seeded) packed into the row, ``sequence_id`` masking them
  from each other (each document its own causal SDPA call, see ``smalti.llm.model.attention_mask``);
- ``alibi``: an MPT-shaped model (ALiBi, LayerNorm, GELU MLP) on packed documents at ``--alibi-t`` (32K),
  in ONE process holding every head (no sp), against the 4 GB ceiling.

Every (T, mode) runs in fresh processes. Memory per rank is the process's peak resident set during the step
(``VmHWM`` after resetting it through ``/proc/self/clear_refs``) and the step's own share: that peak minus the
resident set just before the step (model, optimizer, batch and a warm-up step at 2,048 tokens are already
there). The ratios use the step's share, the part that grows with ``T``:

- ``mem_per_token_growth``: packed step memory per token at the largest T over that at the smallest (goal <= 1.3);
- ``packed_mem_ratio`` / ``packed_time_ratio``: packed over plain at the largest T (goals <= 1.5).

    python bench/long_context.py                      # T = 16K, 32K, 64K, 128K (plain causal at 128K: minutes)
    python bench/long_context.py --max-t 16384        # a quick subset
    python bench/long_context.py --modes packed       # packed only (ratios against plain are then skipped)
    python bench/long_context.py --plain-max-t 65536  # plain causal up to 64K only (ratios taken there)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from smalti.llm import LLM

LENGTHS = (16384, 32768, 65536, 131072)
WARMUP_T = 2048


def _status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+)", text).group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set


def packed_sequence_id(seq_len: int, low: int, high: int, seed: int) -> torch.Tensor:
    """``[1, seq_len]`` document ids: lengths drawn uniformly from ``[low, high]``, the last one cut at the end."""
    gen = torch.Generator().manual_seed(seed)
    ids, doc, pos = torch.empty(seq_len, dtype=torch.long), 0, 0
    while pos < seq_len:
        n = int(torch.randint(low, high + 1, (1,), generator=gen))
        ids[pos : pos + n] = doc
        pos, doc = pos + n, doc + 1
    return ids[None]


def build(mode: str, seq_len: int) -> LLM:
    """The bench's model: tiny Llama, or tiny MPT (ALiBi) for ``alibi``."""
    torch.manual_seed(0)
    if mode == "alibi":
        return LLM(d_model=64, n_heads=4, n_layers=2, vocab_size=2048, max_seq_len=seq_len, position="alibi",
                   norm_type="low_precision_layernorm", ffn_type="mlp", bias=False)
    return LLM(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=2048, max_seq_len=seq_len,
               ffn_hidden_size=172, position="rope", norm_type="rmsnorm", ffn_type="glu", activation="silu",
               tie_embeddings=False)


def batch_for(mode: str, seq_len: int, low: int, high: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 2048, (1, seq_len), generator=gen)}
    if mode != "plain":
        batch["sequence_id"] = packed_sequence_id(seq_len, min(low, seq_len), min(high, seq_len), seed=2)
    return batch


def _step(model: LLM, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    out = model(batch)
    assert "logits" not in out, "the loss must not materialise [B, T, vocab] logits"
    loss = model.loss(out, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _worker(rank: int, world: int, port: int, mode: str, seq_len: int, low: int, high: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build(mode, seq_len)
    if world > 1:
        model.enable_sequence_parallel(dist.new_group(list(range(world))))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    _step(model, opt, batch_for(mode, WARMUP_T, min(low, WARMUP_T // 2), min(high, WARMUP_T // 2)))
    batch = batch_for(mode, seq_len, low, high)
    if world > 1:
        dist.barrier()
    _reset_peak()
    before = _status("VmRSS")
    start = time.perf_counter()
    loss = _step(model, opt, batch)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    result = {"rank": rank, "peak": peak, "step_mem": peak - before, "seconds": seconds, "loss": loss}
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode: str, seq_len: int, world: int, low: int, high: int) -> dict[str, float]:
    """One fresh set of ``world`` processes; the worst rank's peak, step memory and time."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_worker, args=(world, _free_port(), mode, seq_len, low, high, out), nprocs=world, join=True)
        results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    return {key: max(r[key] for r in results) for key in ("peak", "step_mem", "seconds")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-t", type=int, default=LENGTHS[0])
    parser.add_argument("--max-t", type=int, default=LENGTHS[-1])
    parser.add_argument("--modes", default="plain,packed,alibi", help="comma-separated: plain, packed, alibi")
    parser.add_argument("--plain-max-t", type=int, default=None,
                        help="run plain causal only up to this T (its time grows as T^2: 128K takes an hour on a "
                             "loaded 2-core machine); the packed/plain ratios are then those of the largest T run")
    parser.add_argument("--doc-min", type=int, default=1024)
    parser.add_argument("--doc-max", type=int, default=8192)
    parser.add_argument("--alibi-t", type=int, default=32768)
    parser.add_argument("--alibi-limit-gb", type=float, default=4.0)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    lengths = [t for t in LENGTHS if args.min_t <= t <= args.max_t] or [args.max_t]
    print(f"config: d_model=64 layers=2 heads=4 kv_heads=2 vocab=2048 fp32 cpu, 2 gloo ranks sp=2, 1 thread/rank, "
          f"documents {args.doc_min}-{args.doc_max} tokens, torch={torch.__version__}, load={os.getloadavg()[0]:.1f}")
    print(f"{'T':>7} {'mode':>6} {'peak/rank MB':>13} {'step MB':>8} {'step B/tok':>10} {'time s':>8}")
    table: dict[tuple[str, int], dict[str, float]] = {}
    for seq_len in lengths:
        for mode in (m for m in modes if m in ("plain", "packed")):
            if mode == "plain" and args.plain_max_t is not None and seq_len > args.plain_max_t:
                continue
            r = run(mode, seq_len, 2, args.doc_min, args.doc_max)
            table[mode, seq_len] = r
            print(f"{seq_len:>7} {mode:>6} {r['peak'] / 2**20:>13.0f} {r['step_mem'] / 2**20:>8.0f} "
                  f"{r['step_mem'] / seq_len:>10.0f} {r['seconds']:>8.2f}", flush=True)
    if "alibi" in modes:
        r = run("alibi", args.alibi_t, 1, args.doc_min, args.doc_max)
        verdict = "fits" if r["peak"] <= args.alibi_limit_gb * 2**30 else "EXCEEDS"
        print(f"alibi (MPT shape, packed, one process, all heads) T={args.alibi_t}: peak {r['peak'] / 2**30:.2f} GB, "
              f"step {r['step_mem'] / 2**20:.0f} MB, {r['seconds']:.2f} s: {verdict} {args.alibi_limit_gb:g} GB")
    top, low = lengths[-1], lengths[0]
    parts = [f"T={top}"]
    both = [t for t in lengths if ("packed", t) in table and ("plain", t) in table]
    if both:
        at = both[-1]
        packed, plain = table["packed", at], table["plain", at]
        tag = "" if at == top else f"@T={at}"  # plain causal was not run at the top length
        parts.append(f"packed_mem_ratio{tag} {packed['step_mem'] / plain['step_mem']:.2f}")
        parts.append(f"packed_time_ratio{tag} {packed['seconds'] / plain['seconds']:.2f}")
    if ("packed", top) in table and ("packed", low) in table:
        growth = (table["packed", top]["step_mem"] / top) / (table["packed", low]["step_mem"] / low)
        parts.append(f"mem_per_token_growth {growth:.2f}")
    print("long_context: " + " ".join(parts))


if __name__ == "__main__":
    sys.exit(main())
