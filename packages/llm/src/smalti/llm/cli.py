"""``smalti-llm``: tokenizer training, data preparation, ICL evaluation and Hugging Face import/export.

    smalti-llm tokenizer train --input corpus.txt --output tokenizer.json --vocab-size 2048
    smalti-llm data prepare --input docs/ --out ./data/pretrain --mode pretrain --max-seq-len 2048
    smalti-llm data prepare --input pairs.jsonl --out s3://bucket/sft --mode finetune
    smalti-llm eval --model ./hf-folder --tasks default
    smalti-llm hf export --model-config model.yaml --weights model.pt --out ./hf-folder
    smalti-llm hf export --checkpoint outputs/run/checkpoints/ep1-ba500 --out ./hf-folder
    smalti-llm generate --model outputs/run/hf --prompt "Why is the sky blue?" --chat
    smalti-llm generate --model /models/base --adapter outputs/run/adapter --prompt "Why is the sky blue?"
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
    if args.checkpoint:
        from smalti.llm.hf.checkpoint_export import export_checkpoint

        export_checkpoint(args.checkpoint, args.out, pretrained=args.pretrained, dtype=args.dtype,
                          max_shard_size=args.max_shard_size, tokenizer=args.tokenizer, merge=args.merge)
    else:
        from smalti.llm.hf.exporter import export_hf

        # the family comes from the model's shape (the mpt_* recipes: GPT-2 with learned positions, MPT with ALiBi)
        export_hf(_load_model(args), args.out, dtype=args.dtype, tokenizer=args.tokenizer or "default",
                  max_shard_size=args.max_shard_size)
    print(f"wrote {args.out}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch

    from smalti.llm.export import load_model_folder
    from smalti.llm.generate import eos_ids, generate_ids
    from smalti.llm.hf.folder import resolve_folder
    from smalti.llm.hf_tokenizer import HFTokenizer

    folder = resolve_folder(args.model, key="--model")
    tokenizer = HFTokenizer.from_folder(folder)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    else:
        prompt = tokenizer.encode(args.prompt, add_special_tokens=True)
    model = (load_model_folder(folder) if args.adapter is None else _with_adapter(folder, args.adapter))
    model = model.to(torch.device(args.device))
    new = generate_ids(model, list(prompt), args.max_new_tokens, args.temperature, args.top_p, args.seed,
                       eos_ids(folder, tokenizer))
    print(tokenizer.decode(new, skip_special_tokens=True))
    return 0


def _with_adapter(folder: Any, adapter: str) -> Any:
    """The Hugging Face model in ``folder`` with a PEFT LoRA adapter folder on it (fp32 base, no dropout)."""
    from smalti.llm.hf.importer import PretrainedLLM, import_hf
    from smalti.llm.lora.peft_format import lora_settings

    base = PretrainedLLM(folder, require_tokenizer=False)  # on meta: its family names the adapter's modules
    settings = {**lora_settings(adapter, base), "dropout": 0.0, "base_dtype": "float32", "init_from": str(adapter)}
    return import_hf(folder, lora=settings).eval()


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
    exp = hf.add_parser("export", help="write a Hugging Face folder (the source's family; else the family "
                        "whose shape the model has, MPT-shaped models as GPT-2 or MPT)")
    source = exp.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a committed smalti-checkpoint folder (or a save folder: its newest)")
    source.add_argument("--model", help="a model folder: Hugging Face or smalti's (smalti_llm.json)")
    source.add_argument("--model-config", help="a model YAML with _target_ (e.g. a conf/model option)")
    exp.add_argument("--weights", help="model weights for --model-config (.safetensors or a torch state dict)")
    exp.add_argument("--pretrained", help="with --checkpoint: the Hugging Face folder the run started from "
                     "(default: model.pretrained in the run's .hydra/config.yaml)")
    exp.add_argument("--out", required=True, help="the Hugging Face folder; for a LoRA checkpoint, the folder that "
                     "gets adapter/ (PEFT's format) and hf/ (merged)")
    exp.add_argument("--no-merge", dest="merge", action="store_false",
                     help="for a LoRA checkpoint: write the adapter folder only, not the merged model")
    exp.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                     help="default: the source model's torch_dtype, else float32")
    exp.add_argument("--max-shard-size", default="2GB", help="split the weights into files of at most this size")
    exp.add_argument("--tokenizer", default=None, help="for models not imported from Hugging Face: a tokenizer name or "
                     "tokenizer.json (default: smalti's shipped one)")
    exp.set_defaults(func=_hf_export)

    gen = sub.add_parser("generate", help="generate text from a Hugging Face model folder (greedy or top-p)")
    gen.add_argument("--model", required=True, help="a local Hugging Face model folder (e.g. outputs/<run>/hf)")
    gen.add_argument("--adapter", default=None, help="a PEFT LoRA adapter folder to apply to --model (e.g. "
                     "outputs/<run>/adapter, or one PEFT's save_pretrained wrote)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    gen.add_argument("--system", default=None, help="with --chat: a system message first")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    gen.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0: nucleus sampling mass")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling")
    gen.add_argument("--device", default="cpu")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except Exception as exc:
        from smalti.core.errors import SmaltiError
        from smalti.storage import StorageError

        if isinstance(exc, SmaltiError | StorageError):
            print(f"smalti-llm: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
