"""The epoch order at pretraining scale: first batch, resume and streaming cost from 1e7 to 1e10 samples.

Measures the default ``shuffle_algo`` (``keyed``; ``--algo blocks`` for the other lazy order) over an index of
virtual shards (16,384 samples each, no data files: the order needs only the shard sizes), 8 canonical nodes,
64 data-parallel ranks of 32 samples. Every measurement runs in a fresh process, so its peak resident memory
(``VmHWM``, Python and NumPy included) is that of the measurement alone; times are wall clock, with the
process's CPU time beside them (on a loaded machine only the CPU time is comparable between runs).

- ``first_batch_s``: from the shard sizes to rank 0's first batch of ids (epoch 0), the order's tables built;
- ``resume_s``: the same, to the global batch holding sample position 7,777,777,777 of the epoch (1e10 only);
- ``ns_per_sample``: rank 0's ids of the whole epoch streamed batch after batch (``BlockOrder.iter_rank``),
  timed over ``--stream-samples`` of them taken at spread-out places of the epoch;
- mosaicml-streaming's py1e (``shuffle_order``, then grouped by node) at 1e7 for comparison, and the shuffle
  quality of py1e, blocks and keyed at 1e6 (the distribution of distances between consecutive samples'
  original positions, and the shards open in a window of 4,096 consecutive samples of a node; keyed also with
  chunks of 64 shards, what its default gives from 262,144 shards up).

    python bench/streaming_scale.py [--algo keyed|blocks] [--stream-samples 20000000] [--skip-quality]

The last line is ``streaming_scale: samples 1e10 first_batch_s X.XX peak_mb X resume_s X.XX ns_per_sample X.X
mem_growth X.XX``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

SHARD = 16_384
NODES, RANKS, BATCH = 8, 64, 32
RESUME_AT = 7_777_777_777


def virtual_sizes(samples: int) -> np.ndarray:
    """Shard sizes of an index of ``samples`` samples in shards of 16,384 (the last one shorter)."""
    count = -(-samples // SHARD)
    sizes = np.full(count, SHARD, dtype=np.int64)
    sizes[-1] = samples - SHARD * (count - 1)
    return sizes


def peak_mb() -> float:
    """This process's peak resident memory. On Linux ``ru_maxrss`` survives ``execve`` (a child started after
    the parent grew reports the parent's peak), so the new image's own high-water mark is read instead."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(kind: str, algo: str, samples: int, stream_samples: int) -> dict:
    from smalti.streaming.order import lazy_order

    G = RANKS * BATCH
    start, cpu = time.perf_counter(), time.process_time()
    sizes = virtual_sizes(samples)
    if kind == "old":
        from smalti.streaming.order import group_by_node, pad_to_batches, shuffle_order

        starts = np.concatenate([[0], np.cumsum(sizes)])
        shards = [np.arange(starts[i], starts[i + 1]) for i in range(len(sizes))]
        order, nodes = shuffle_order(shards, "py1e", 9176, 0, NODES)
        order = group_by_node(pad_to_batches(order, G), pad_to_batches(nodes, G), G)
        first = order[:BATCH]
        return {"first_batch_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
                "peak_mb": peak_mb(), "n": len(first)}
    order = lazy_order(algo, sizes, seed=9176, epoch=0, num_canonical_nodes=NODES, global_batch=G)
    if kind == "first":
        first = order.grid(0, 1, 0, BATCH)
        return {"first_batch_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
                "peak_mb": peak_mb(), "n": first.size}
    if kind == "resume":
        k = RESUME_AT // G
        batch = order.grid(k, k + 1)
        return {"resume_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "peak_mb": peak_mb(),
                "n": batch.size}
    # stream: rank 0's batches at 20 places spread over the epoch, each a run of consecutive batches
    per_place = max(1, stream_samples // 20 // BATCH)
    places = np.linspace(0, order.num_batches - per_place, 20).astype(np.int64)
    done = 0
    t, cpu = time.perf_counter(), time.process_time()
    for k in places:
        for ids in order.iter_rank(0, BATCH, start_batch=int(k)):
            done += ids.size
            if done >= (list(places).index(k) + 1) * per_place * BATCH:
                break
    elapsed = time.perf_counter() - t
    return {"ns_per_sample": elapsed / done * 1e9, "cpu_ns_per_sample": (time.process_time() - cpu) / done * 1e9,
            "peak_mb": peak_mb(), "n": done}


def run(kind: str, algo: str, samples: int, stream_samples: int = 0) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, algo, str(samples), str(stream_samples)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def quality(samples: int = 1_000_000) -> None:
    """py1e, blocks and keyed: how far apart consecutive samples come from, how many shards a node has open."""
    from smalti.streaming.order import shuffle_order
    from smalti.streaming.order_blocks import BlockOrder
    from smalti.streaming.order_keyed import KeyedOrder

    sizes = virtual_sizes(samples)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shards = [np.arange(starts[i], starts[i + 1]) for i in range(len(sizes))]
    kw = dict(seed=9176, epoch=0, num_canonical_nodes=1, global_batch=1, block_size=1 << 18)
    orders = {"py1e": shuffle_order(shards, "py1e", 9176, 0, 1, block_size=1 << 18)[0],
              "blocks": BlockOrder(sizes, **kw).full(), "keyed": KeyedOrder(sizes, **kw).full(),
              "keyed/64": KeyedOrder(sizes, chunk_shards=64, **kw).full()}
    print(f"quality at {samples:.0e} samples in {len(sizes)} shards, one canonical node, blocks of 262,144 "
          "samples (keyed/64: chunks of 64 shards):")
    print("  order      |jump| p10      p50      p90   shards open per 4,096: mean   max")
    for name, order in orders.items():
        jump = np.abs(np.diff(order))
        shard = np.searchsorted(starts, order, side="right") - 1
        open_ = [len(np.unique(shard[i : i + 4096])) for i in range(0, len(order), 4096)]
        p10, p50, p90 = np.percentile(jump, [10, 50, 90])
        print(f"  {name:9s} {p10:11.0f} {p50:8.0f} {p90:8.0f} {np.mean(open_):28.1f} {max(open_):5d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--algo", choices=("keyed", "blocks"), default=None,
                        help="the lazy order to measure (default: DEFAULT_SHUFFLE)")
    parser.add_argument("--stream-samples", type=int, default=20_000_000)
    parser.add_argument("--skip-quality", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], int(args.child[2]), int(args.child[3]))))
        return
    from smalti.streaming.order import DEFAULT_SHUFFLE

    algo = args.algo or DEFAULT_SHUFFLE
    if not args.skip_quality:
        quality()
    old = run("old", algo, 10**7)
    print(f"mosaicml-streaming's py1e at 1e7: first batch {old['first_batch_s']:.2f} s ({old['cpu_s']:.2f} s CPU), "
          f"peak {old['peak_mb']:.0f} MB")
    rows = []
    print(f"the {algo} order from 1e7 to 1e10 samples (py1e at 1e7 for comparison):")
    print("samples  shards    first_batch_s  cpu_s  peak_mb")
    print(f"1e7 py1e {len(virtual_sizes(10**7)):8d}  {old['first_batch_s']:13.3f}  {old['cpu_s']:5.3f}  "
          f"{old['peak_mb']:7.0f}")
    for exp in (7, 8, 9, 10):
        res = run("first", algo, 10**exp)
        rows.append(res)
        print(f"1e{exp:<6d} {len(virtual_sizes(10**exp)):8d}  {res['first_batch_s']:13.3f}  {res['cpu_s']:5.3f}  "
              f"{res['peak_mb']:7.0f}")
    if rows[0]["cpu_s"] > old["cpu_s"]:
        print(f"NOTE: at 1e7 the {algo} order's first batch took more CPU than py1e's")
    resume = run("resume", algo, 10**10)
    stream = run("stream", algo, 10**10, args.stream_samples)
    mem_growth = rows[-1]["peak_mb"] / rows[0]["peak_mb"]
    time_growth = rows[-1]["first_batch_s"] / rows[0]["first_batch_s"]
    cpu_growth = rows[-1]["cpu_s"] / rows[0]["cpu_s"]
    print(f"resume at sample {RESUME_AT:,}: {resume['resume_s']:.3f} s ({resume['cpu_s']:.3f} s CPU), "
          f"peak {resume['peak_mb']:.0f} MB")
    print(f"rank 0 streamed: {stream['ns_per_sample']:.1f} ns/sample ({stream['cpu_ns_per_sample']:.1f} CPU) over "
          f"{stream['n']:,} samples")
    print(f"growth 1e7 -> 1e10: memory {mem_growth:.2f}x, first batch {time_growth:.2f}x ({cpu_growth:.2f}x in CPU "
          "time, which a loaded machine does not inflate)")
    print(f"streaming_scale: samples 1e10 first_batch_s {rows[-1]['first_batch_s']:.2f} "
          f"peak_mb {rows[-1]['peak_mb']:.0f} resume_s {resume['resume_s']:.2f} "
          f"ns_per_sample {stream['ns_per_sample']:.1f} mem_growth {mem_growth:.2f}")


if __name__ == "__main__":
    main()
