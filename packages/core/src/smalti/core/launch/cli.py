"""``smalti-launch``: scale-out helpers around ``smalti-train``.

    smalti-launch k8s --nodes 4 --gpus-per-node 8 --image REG/smalti:TAG [--cordon cordon.json] -- <overrides>
    smalti-launch logs RUN [--no-follow] [--goodput]
    smalti-launch preflight [-- <smalti-health preflight args>]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from smalti.core.launch.errors import LaunchError


def _split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Options before ``--``, passthrough arguments (Hydra overrides, preflight args) after it."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _parser() -> argparse.ArgumentParser:
    from smalti.core.launch.k8s import default_job_name

    parser = argparse.ArgumentParser(prog="smalti-launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    k8s = sub.add_parser("k8s", help="write a Kubeflow PyTorchJob manifest that runs smalti-train under torchrun")
    k8s.add_argument("--nodes", type=int, required=True, help="worker pods, one per node")
    k8s.add_argument("--gpus-per-node", type=int, default=0, help="GPUs each pod requests (nvidia.com/gpu)")
    k8s.add_argument("--nproc-per-node", type=int, default=None, help="ranks per pod (default: GPUs, else 1)")
    k8s.add_argument("--min-nodes", type=int, default=None, help="elastic lower bound (--nnodes=MIN:MAX)")
    k8s.add_argument("--image", default=os.environ.get("SMALTI_IMAGE", "smalti:latest"),
                     help="container image with smalti installed (default: $SMALTI_IMAGE or smalti:latest)")
    k8s.add_argument("--name", default=default_job_name(), help="job name, also the run name and rendezvous id")
    k8s.add_argument("--namespace", default=None)
    k8s.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts (in-pod restarts)")
    k8s.add_argument("--backoff-limit", type=int, default=3, help="pod re-creations before the job fails")
    k8s.add_argument("--rdzv-port", type=int, default=29400)
    k8s.add_argument("--cordon", default=None, help="smalti-health's cordon file (JSON/YAML); its hosts are avoided")
    k8s.add_argument("--no-preflight", action="store_true", help="leave out the smalti-launch preflight init container")
    k8s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra container variable")
    k8s.add_argument("--pvc", default=None, help="PersistentVolumeClaim mounted as the working folder (outputs, checkpoints)")
    k8s.add_argument("--mount-path", default="/workspace")
    k8s.add_argument("-o", "--output", default=None, help="write the manifest here instead of stdout")

    logs = sub.add_parser("logs", help="print (and follow) the merged per-rank logs of a run")
    logs.add_argument("run", help="run name (outputs/RUN, multirun/RUN) or a run folder")
    logs.add_argument("--root", default="outputs", help="where run folders live (default: outputs)")
    logs.add_argument("--no-follow", action="store_true", help="print what is there and exit")
    logs.add_argument("--interval", type=float, default=0.5, help="seconds between polls when following")
    logs.add_argument("--goodput", action="store_true",
                      help="print the goodput breakdown of every attempt (outputs/RUN/goodput.jsonl) and exit")

    pre = sub.add_parser("preflight", help="run smalti-health's preflight on this node (exit code passed through)")
    pre.add_argument("--require", action="store_true", help="fail when smalti-health is not installed")
    return parser


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _k8s(args: argparse.Namespace, overrides: list[str]) -> int:
    from smalti.core.launch.cordon import read_cordon_file
    from smalti.core.launch.k8s import PyTorchJobOptions, build_pytorchjob, parse_env, to_yaml

    if args.cordon and not Path(args.cordon).exists():
        raise LaunchError(f"--cordon {args.cordon}: no such file")
    opts = PyTorchJobOptions(
        name=args.name, nodes=args.nodes, gpus_per_node=args.gpus_per_node, nproc_per_node=args.nproc_per_node,
        min_nodes=args.min_nodes, image=args.image, namespace=args.namespace, max_restarts=args.max_restarts,
        backoff_limit=args.backoff_limit, rdzv_port=args.rdzv_port, overrides=overrides, env=parse_env(args.env),
        cordoned=read_cordon_file(args.cordon) if args.cordon else [], preflight=not args.no_preflight,
        pvc=args.pvc, mount_path=args.mount_path,
    )
    text = to_yaml(build_pytorchjob(opts))
    if args.output:
        _write_atomic(Path(args.output), text)
        print(f"smalti-launch: wrote {args.output} (kubectl apply -f {args.output})", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point."""
    options, passthrough = _split_overrides(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(options)
    try:
        if args.command == "k8s":
            return _k8s(args, passthrough)
        if args.command == "logs":
            from smalti.core.launch.logs import find_run_dir, show_logs

            if args.goodput:
                from smalti.core.launch.goodput import show_goodput

                return show_goodput(find_run_dir(args.run, args.root), sys.stdout)
            return show_logs(find_run_dir(args.run, args.root), follow=not args.no_follow, interval_s=args.interval)
        if args.command == "preflight":
            from smalti.core.launch.preflight import run_preflight

            return run_preflight(passthrough, require=args.require)
    except LaunchError as exc:
        print(f"smalti-launch {args.command}: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
