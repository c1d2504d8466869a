"""``smalti-checkpoint``: ``inspect`` a checkpoint (contents and verification) and ``export`` its model to safetensors.

Examples::

    smalti-checkpoint inspect outputs/run/checkpoints/ep0-ba100 --verify full
    smalti-checkpoint inspect s3://bucket/run/ep0-ba100
    smalti-checkpoint export outputs/run/checkpoints model.safetensors --dtype bfloat16

Nothing read from the checkpoint runs code: pickles that want classes outside the allow-lists are refused
(exit status 1, naming the file and the class) unless ``--trust-pickles`` is given.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from smalti.checkpoint.errors import CheckpointError
from smalti.checkpoint.hashes import entry_digest


def _resolve(args: argparse.Namespace):
    from smalti.checkpoint.resume import resolve_load_path

    return resolve_load_path(args.path, None, args.verify, trust_pickles=args.trust_pickles)


def _inspect(args: argparse.Namespace) -> int:
    from smalti.checkpoint.export import describe
    from smalti.checkpoint.state_io import EXTRA_DIR

    try:
        found = _resolve(args)
        rows = describe(found.folder, args.trust_pickles)
    except CheckpointError as exc:
        print(f"INVALID: {exc}", file=sys.stderr)
        return 1
    m = found.manifest
    ts = m.get("timestamp", {})
    digests = {rel: entry_digest(entry) or ("?", "") for rel, entry in m["files"].items()}
    algorithms = ", ".join(sorted({algorithm for algorithm, _ in digests.values()})) or "no files"
    print(f"checkpoint {found.source}")
    if args.verify == "none":
        print(f"  verified (none): manifest only, file digests ({algorithms}) not checked")
    else:
        print(f"  verified ({args.verify}): ok, sizes and {algorithms} digests of every file match the manifest")
    print(f"  time: epoch {ts.get('epoch')}, batch {ts.get('batch')}, sample {ts.get('sample')}, token {ts.get('token')}")
    print(f"  saved by {m['world_size']} ranks, mesh {m.get('mesh_shape')} {m.get('mesh_dim_names')}, writers {m.get('writer_ranks')}")
    print(f"  files ({len(m['files'])}, {sum(f['size'] for f in m['files'].values()) / 1e6:.2f} MB):")
    for rel, entry in m["files"].items():
        print(f"    {rel:<32} {entry['size']:>14,d} B  {digests[rel][0]} {digests[rel][1][:16]}")
    if not args.all:
        rows = [r for r in rows if r[0].startswith("model.")]
    print(f"  entries ({len(rows)}{'' if args.all else ', model only; --all for every entry'}):")
    for key, dtype, shape in rows:
        print(f"    {key:<60} {dtype:<10} {shape}")
    extras = sorted(p.name for p in (found.folder / EXTRA_DIR).glob("*.pt"))
    print(f"  rank-local state: {', '.join(extras)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from smalti.checkpoint.export import export_safetensors

    try:
        found = _resolve(args)
        tensors = export_safetensors(found.folder, Path(args.out), args.dtype, args.trust_pickles)
    except CheckpointError as exc:
        print(f"cannot export: {exc}", file=sys.stderr)
        return 1
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"wrote {args.out}: {len(tensors)} tensors, {size / 1e6:.2f} MB, from {found.source}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point; returns the exit status (1 when the checkpoint does not verify)."""
    parser = argparse.ArgumentParser(prog="smalti-checkpoint", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("inspect", "list a checkpoint's contents and verify it"),
                            ("export", "write the model weights as one safetensors file")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("path", help="checkpoint folder, or a save folder (its newest good checkpoint); local or s3://")
        if name == "export":
            p.add_argument("out", help="output .safetensors file")
            p.add_argument("--dtype", default=None, help="cast floating tensors, e.g. bfloat16")
        else:
            p.add_argument("--all", action="store_true", help="list optimizer entries too")
        p.add_argument("--verify", default="manifest", choices=["none", "manifest", "full"])
        p.add_argument("--trust-pickles", action="store_true",
                       help="read pickles that want classes outside the allow-lists (can run code from the "
                            "checkpoint): only for checkpoints from a source you trust")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return _inspect(args) if args.command == "inspect" else _export(args)


if __name__ == "__main__":
    sys.exit(main())
