"""``smalti-health``: node and GPU checks, collective and compute benchmarks, the cordon list.

    smalti-health gpu [--json]                       NVML checks of every GPU on this node
    torchrun --nproc-per-node N -m smalti.health.cli collectives [--ops all_reduce,all_gather] [--min-busbw 100]
    smalti-health compute [--seconds 2]              matmul FLOP/s vs peak (and vs peers under torchrun)
    smalti-health cordon add|remove|list --file cordon.json|s3://b/k [HOST --reason ...]
    smalti-health preflight [--cordon FILE] [--add-to-cordon] [--require-gpu]

Exit codes:
    0   healthy (or, for ``cordon``, done)
    1   a check failed (``gpu`` verdict fail, ``collectives`` an op's large-message mean busbw below
        ``--min-busbw``, ``compute`` below a bound)
    2   bad arguments or input (the message names the value at fault)
    4   ``gpu``: there is no GPU or NVML on this machine
    93  ``preflight``: this node must not run the job (cordoned, or a check failed): do not restart here
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from smalti.health.results import CheckResult, Verdict, worst

NO_GPU_EXIT = 4
CHECK_FAILED_EXIT = 1
BAD_INPUT_EXIT = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="smalti-health", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    gpu = sub.add_parser("gpu", help="NVML checks of every GPU: ECC, remapped rows, XIDs, throttling")
    gpu.add_argument("--deadline", type=float, default=5.0, help="seconds each NVML call may take")
    gpu.add_argument("--fail-on-warn", action="store_true")
    col = sub.add_parser("collectives", help="collective bandwidth sweep on the current process group")
    col.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,all_to_all")
    col.add_argument("--min-bytes", type=int, default=1 << 10)
    col.add_argument("--max-bytes", type=int, default=None,
                     help="largest message (default 256 MiB on NCCL, 16 MiB on gloo)")
    col.add_argument("--factor", type=int, default=4, help="size multiplier between steps of the sweep")
    col.add_argument("--iters", type=int, default=5)
    col.add_argument("--warmup", type=int, default=1)
    col.add_argument("--min-busbw", type=float, default=None,
                     help="GB/s; fail when an op's mean busbw over the large sizes (see --gate-min-bytes) is below it")
    col.add_argument("--gate-min-bytes", type=int, default=None,
                     help="sizes the --min-busbw gate averages: at least this many bytes (default max-bytes / 16)")
    col.add_argument("--pairwise", action="store_true", help="also time send/recv between every pair of ranks")
    comp = sub.add_parser("compute", help="matmul FLOP/s of this device vs its peak and its peers")
    comp.add_argument("--seconds", type=float, default=1.0)
    comp.add_argument("--size", type=int, default=2048)
    comp.add_argument("--min-fraction-of-median", type=float, default=0.8)
    comp.add_argument("--min-fraction-of-peak", type=float, default=None)
    cor = sub.add_parser("cordon", help="edit or show the cordon list of bad hosts")
    cor.add_argument("action", choices=["add", "remove", "list"])
    cor.add_argument("host", nargs="?")
    cor.add_argument("--file", required=True, help="cordon file, local path or s3://bucket/key")
    cor.add_argument("--reason", default="")
    pre = sub.add_parser("preflight", help="node checks before joining a job; exit 93 means keep off this node")
    pre.add_argument("--cordon", default=None, help="cordon file (local or s3://) to check this host against")
    pre.add_argument("--host", default=None, help="this node's name (default $SMALTI_NODE_NAME or the host name)")
    pre.add_argument("--add-to-cordon", action="store_true", help="cordon this host when a check fails")
    pre.add_argument("--require-gpu", action="store_true")
    pre.add_argument("--fail-on-warn", action="store_true")
    pre.add_argument("--compute-seconds", type=float, default=0.0, help="also run the matmul check this long")
    pre.add_argument("--min-fraction-of-peak", type=float, default=None)
    pre.add_argument("--deadline", type=float, default=5.0)
    for sp in (gpu, col, comp, cor, pre):
        sp.add_argument("--json", action="store_true", help="print results as JSON")
    return p


def _emit(results: list[CheckResult], as_json: bool) -> None:
    if as_json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
        return
    for r in results:
        print(f"[{r.verdict.value:>4}] {r.name}: {r.message}")


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    if lo <= 0 or hi < lo or factor < 2:
        raise ValueError(f"size sweep --min-bytes {lo} --max-bytes {hi} --factor {factor}: need 0 < min <= max, factor >= 2")
    out, size = [], lo
    while size <= hi:
        out.append(size)
        size *= factor
    return out


def _run(args: argparse.Namespace) -> int:
    if args.command == "gpu":
        from smalti.health.gpu import check_gpus

        results = check_gpus(call_deadline_s=args.deadline)
        _emit(results, args.json)
        if "health/gpu/count" in results[0].metrics:
            return NO_GPU_EXIT
        bad = {Verdict.FAIL, Verdict.WARN} if args.fail_on_warn else {Verdict.FAIL}
        return CHECK_FAILED_EXIT if worst(*(r.verdict for r in results)) in bad else 0
    if args.command == "collectives":
        from smalti.core import distributed
        from smalti.health.collectives import default_max_bytes, run_collectives, run_pairwise

        distributed.init_process_group()
        try:
            ops = [o.strip() for o in args.ops.split(",") if o.strip()]
            max_bytes = args.max_bytes or default_max_bytes()
            results = run_collectives(ops, _sizes(args.min_bytes, max_bytes, args.factor),
                                      args.iters, args.warmup, min_busbw_gbps=args.min_busbw,
                                      gate_min_bytes=args.gate_min_bytes)
            if args.pairwise:
                results += run_pairwise(max_bytes, args.iters)
        finally:
            distributed.shutdown()
        if distributed.get_rank() == 0:
            _emit(results, args.json)
        return CHECK_FAILED_EXIT if any(r.verdict == Verdict.FAIL for r in results) else 0
    if args.command == "compute":
        from smalti.core import distributed
        from smalti.health.compute import run_compute_check

        distributed.init_process_group()
        try:
            result = run_compute_check(size=args.size, seconds=args.seconds,
                                       min_fraction_of_median=args.min_fraction_of_median,
                                       min_fraction_of_peak=args.min_fraction_of_peak)
        finally:
            distributed.shutdown()
        _emit([result], args.json)
        return CHECK_FAILED_EXIT if result.verdict == Verdict.FAIL else 0
    if args.command == "cordon":
        from smalti.health.cordon import add_to_cordon, read_cordon, remove_from_cordon

        if args.action != "list" and not args.host:
            raise ValueError(f"cordon {args.action} needs a HOST")
        if args.action == "add":
            add_to_cordon(args.file, args.host, args.reason)
        elif args.action == "remove" and not remove_from_cordon(args.file, args.host):
            print(f"{args.host} was not cordoned in {args.file}", file=sys.stderr)
        hosts = read_cordon(args.file)
        if args.json:
            print(json.dumps([{"host": h.host, "reason": h.reason} for h in hosts], indent=2))
        else:
            for h in hosts:
                print(f"{h.host}\t{h.reason}")
        return 0
    from smalti.health.preflight import run_preflight

    outcome = run_preflight(cordon=args.cordon, host=args.host, require_gpu=args.require_gpu,
                            add_to_cordon_on_fail=args.add_to_cordon, fail_on_warn=args.fail_on_warn,
                            compute_seconds=args.compute_seconds, min_fraction_of_peak=args.min_fraction_of_peak,
                            call_deadline_s=args.deadline)
    _emit(outcome.results, args.json)
    if outcome.exit_code:
        print(f"smalti-health preflight: host {outcome.host} must not run this job (exit {outcome.exit_code})",
              file=sys.stderr)
    return outcome.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``smalti-health`` console script; returns the exit code (see the module docstring)."""
    args = _parser().parse_args(argv)
    from smalti.health.errors import HealthError

    try:
        return _run(args)
    except (HealthError, ValueError, OSError) as exc:
        print(f"smalti-health {args.command}: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT


if __name__ == "__main__":
    sys.exit(main())
