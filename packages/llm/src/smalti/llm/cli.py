"""``smalti-llm``: tokenizer training, data preparation, ICL evaluation and Hugging Face import/export.

    smalti-llm tokenizer train --input corpus.txt --output tokenizer.json --vocab-size 2048
    smalti-llm data prepare --input docs/ --out ./data/pretrain --mode pretrain --max-seq-len 2048
    smalti-llm data prepare --input pairs.jsonl --out s3://bucket/sft --mode finetune
    smalti-llm eval --model ./hf-folder --tasks default
    smalti-llm hf export --model-config model.yaml --weights model.pt --out ./hf-folder
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

log = logging.getLogger("smalti.llm.cli")


def _tokenizer_train(args: argparse.Namespace) -> int:
    from smalti.llm.tokenizer import train_bpe

    tok = train_bpe(args.input, args.output, vocab_size=args.vocab_size, min_frequency=args.min_frequency)
    print(f"wrote {args.output} ({tok.vocab_size} tokens)")
    return 0


def _data_prepare(args: argparse.Namespace) -> int:
    from smalti.llm.data.prepare import prepare

    counts = prepare(
        args.input, args.out, mode=args.mode, tokenizer=args.tokenizer, max_seq_len=args.max_seq_len,
        eval_fraction=args.eval_fraction, text_key=args.text_key, prompt_key=args.prompt_key,
        response_key=args.response_key, compression=None if args.compression == "none" else args.compression,
    )
    print(json.dumps(counts))
    return 0


def _load_model(args: argparse.Namespace) -> Any:
    """An LLM from a model folder (``--model``: Hugging Face Llama or smalti's layout, e.g. one downloaded from
    the MLflow registry) or a model YAML plus weights (``--model-config``)."""
    if args.model:
        from smalti.llm.export import load_model_folder

        return load_model_folder(args.model)
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    model = instantiate(OmegaConf.load(args.model_config))
    if args.weights:
        import torch

        if args.weights.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(args.weights)
        else:
            state = torch.load(args.weights, map_location="cpu", weights_only=True)
            state = state.get("model", state) if isinstance(state, dict) else state
        model.load_state_dict(state)
    return model


def _eval(args: argparse.Namespace) -> int:
    import torch

    from smalti.llm.icl import evaluate_tasks, load_tasks
    from smalti.llm.tokenizer import load_tokenizer

    model = _load_model(args)
    tokenizer = load_tokenizer(args.tokenizer or (args.model if args.model else "default"))
    device = torch.device(args.device)
    model.to(device)
    results = evaluate_tasks(load_tasks(args.tasks), model, tokenizer, device)
    print(json.dumps(results, indent=2))
    return 0


def _hf_export(args: argparse.Namespace) -> int:
    from smalti.llm.hf import export_hf

    export_hf(_load_model(args), args.out, dtype=args.dtype, tokenizer=args.tokenizer)
    print(f"wrote {args.out}")
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--model", help="a model folder: Hugging Face Llama (config.json + safetensors) or smalti's "
                       "(smalti_llm.json + model.safetensors)")
    group.add_argument("--model-config", help="a model YAML with _target_ (e.g. a conf/model option)")
    p.add_argument("--weights", help="model weights for --model-config (.safetensors or a torch state dict)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``smalti-llm``."""
    parser = argparse.ArgumentParser(prog="smalti-llm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    tok = sub.add_parser("tokenizer", help="tokenizers").add_subparsers(dest="action", required=True)
    train = tok.add_parser("train", help="train a byte-level BPE offline")
    train.add_argument("--input", nargs="+", required=True, help="text, JSONL or Parquet files or folders")
    train.add_argument("--output", required=True, help="tokenizer.json to write")
    train.add_argument("--vocab-size", type=int, default=2048)
    train.add_argument("--min-frequency", type=int, default=2)
    train.set_defaults(func=_tokenizer_train)

    data = sub.add_parser("data", help="data preparation").add_subparsers(dest="action", required=True)
    prep = data.add_parser("prepare", help="text/JSONL/Parquet to MDS shards (local or s3://)")
    prep.add_argument("--input", nargs="+", required=True)
    prep.add_argument("--out", required=True, help="output folder or s3://bucket/prefix")
    prep.add_argument("--mode", choices=["pretrain", "finetune"], default="pretrain")
    prep.add_argument("--tokenizer", default="default", help="'default', 'byte' or a tokenizer.json path")
    prep.add_argument("--max-seq-len", type=int, default=2048)
    prep.add_argument("--eval-fraction", type=float, default=0.0,
                      help="share of documents written to out/eval (the rest to out/train)")
    prep.add_argument("--text-key", default="text")
    prep.add_argument("--prompt-key", default="prompt")
    prep.add_argument("--response-key", default="response")
    prep.add_argument("--compression", default="zstd", help="zstd, none, ...")
    prep.set_defaults(func=_data_prepare)

    ev = sub.add_parser("eval", help="in-context-learning evaluation")
    _model_args(ev)
    ev.add_argument("--tasks", default="default", help="a task-list YAML or 'default' (the shipped tasks)")
    ev.add_argument("--tokenizer", default=None, help="default: the model folder's tokenizer.json, else the shipped one")
    ev.add_argument("--device", default="cpu")
    ev.set_defaults(func=_eval)

    hf = sub.add_parser("hf", help="Hugging Face interop").add_subparsers(dest="action", required=True)
    exp = hf.add_parser("export", help="write a Hugging Face Llama folder")
    _model_args(exp)
    exp.add_argument("--out", required=True)
    exp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    exp.add_argument("--tokenizer", default=None)
    exp.set_defaults(func=_hf_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except Exception as exc:
        from smalti.core.errors import SmaltiError

        if isinstance(exc, SmaltiError):
            print(f"smalti-llm: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
