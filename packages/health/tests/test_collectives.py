"""Collective benchmarks: nccl-tests bandwidth arithmetic, and real runs on a 2-rank gloo group."""

import json

import pytest

from smalti.health.collectives import (
    DEFAULT_MAX_BYTES,
    bandwidths,
    bus_bandwidth_factor,
    default_max_bytes,
    run_collectives,
    run_pairwise,
)
from smalti.health.errors import HealthError
from smalti.health.results import Verdict
from smalti.testing import run_torchrun


def test_bus_bandwidth_factors_match_nccl_tests():
    assert bus_bandwidth_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_bandwidth_factor(op, 8) == pytest.approx(7 / 8)
    assert bus_bandwidth_factor("send_recv", 8) == 1.0
    assert bus_bandwidth_factor("all_reduce", 1) == 0.0
    with pytest.raises(HealthError, match="'allreduce'"):
        bus_bandwidth_factor("allreduce", 2)


def test_bandwidth_on_a_known_timing():
    # 1 GB all-reduced in 10 ms on 4 ranks: algbw 100 GB/s, busbw 100 * 2 * 3 / 4 = 150 GB/s
    algbw, busbw = bandwidths("all_reduce", 1_000_000_000, 4, 0.010)
    assert (algbw, busbw) == (pytest.approx(100.0), pytest.approx(150.0))
    assert bandwidths("all_gather", 2_000_000, 2, 0.001) == (pytest.approx(2.0), pytest.approx(1.0))


def test_default_sweep_reaches_256_mib_on_nccl_and_stays_small_on_gloo():
    assert DEFAULT_MAX_BYTES == {"nccl": 256 << 20, "gloo": 16 << 20}
    assert default_max_bytes() == 16 << 20  # no process group: the CPU default


@pytest.mark.world_size(2)
def test_every_op_and_size_on_two_gloo_ranks():
    results = run_collectives(("all_reduce", "all_gather", "reduce_scatter", "all_to_all"), (4096, 1 << 18),
                              iters=2)
    assert len(results) == 8 and all(r.verdict is Verdict.OK for r in results)
    for r in results:
        op, size = r.name.split("/")
        algbw = r.metrics[f"health/collectives/{op}/{size}/algbw_gbps"]
        busbw = r.metrics[f"health/collectives/{op}/{size}/busbw_gbps"]
        assert algbw > 0 and busbw == pytest.approx(algbw * bus_bandwidth_factor(op, 2))
    (pair,) = run_pairwise(1 << 16, iters=2)
    assert pair.name == "send_recv/0-1" and pair.metrics["health/collectives/send_recv/0-1/busbw_gbps"] > 0


@pytest.mark.world_size(2)
def test_min_busbw_gates_each_op_on_its_mean_over_the_large_sizes():
    sizes = (1024, 1 << 14, 1 << 16, 1 << 18)  # gate sizes: >= (1 << 18) / 16, i.e. the top three
    fails = run_collectives(("all_reduce", "all_gather"), sizes, iters=2, min_busbw_gbps=1e9)
    gates = {r.name: r for r in fails if r.name.endswith("/gate")}
    assert set(gates) == {"all_reduce/gate", "all_gather/gate"}
    assert all(r.verdict is Verdict.OK for r in fails if not r.name.endswith("/gate"))  # sizes only inform
    metrics = {k: v for r in fails for k, v in r.metrics.items()}
    for name, gate in gates.items():
        op = name.split("/")[0]
        large = [metrics[f"health/collectives/{op}/{s}/busbw_gbps"] for s in sizes[1:]]
        assert gate.metrics[f"health/collectives/{op}/gate_busbw_gbps"] == pytest.approx(sum(large) / 3)
        assert gate.verdict is Verdict.FAIL and "over 3 size(s) 16384..262144 B below --min-busbw 1e+09" in gate.message
    # a threshold the gloo link meets on its large messages passes, though the 1 KiB message is far below it
    floor = min(g.metrics[f"health/collectives/{n.split('/')[0]}/gate_busbw_gbps"] for n, g in gates.items()) / 10
    passes = run_collectives(("all_reduce", "all_gather"), sizes, iters=2, min_busbw_gbps=floor)
    assert [r.verdict for r in passes if r.name.endswith("/gate")] == [Verdict.OK, Verdict.OK]
    only_largest = run_collectives(("all_reduce",), sizes, iters=2, min_busbw_gbps=floor, gate_min_bytes=1 << 18)
    assert "over 1 size(s) 262144 B" in only_largest[-1].message
    with pytest.raises(HealthError, match="gate_min_bytes=524288 is above the largest swept size 262144"):
        run_collectives(("all_reduce",), sizes, min_busbw_gbps=1.0, gate_min_bytes=1 << 19)


def test_cli_gate_fails_under_torchrun():
    # One torchrun run (start-up dominates): the sweep's JSON from rank 0, and the gate's non-zero exit.
    gate = run_torchrun("smalti.health.cli", 2, ["collectives", "--ops", "all_reduce", "--max-bytes", "4096",
                                                 "--min-busbw", "1e9", "--json"], module=True, timeout=120)
    assert gate.returncode != 0, (gate.stdout + gate.stderr)[-2000:]
    rank0 = "".join(line.split(":", 1)[1] + "\n" for line in gate.stdout.splitlines() if line.startswith("[default0]:"))
    rows = json.loads(rank0)
    assert [r["name"] for r in rows] == ["all_reduce/1024", "all_reduce/4096", "all_reduce/gate"]
    *sizes, gate = rows
    assert all(r["verdict"] == "ok" and r["metrics"][f"health/collectives/{r['name']}/busbw_gbps"] > 0 for r in sizes)
    assert gate["verdict"] == "fail" and "below --min-busbw 1e+09" in gate["message"]
