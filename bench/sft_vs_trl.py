"""Chat finetuning end to end: smalti's ``experiment=finetune_hf`` against TRL's ``SFTTrainer``.

One seeded Llama (``transformers``' ``LlamaForCausalLM``, random init, ``save_pretrained`` safetensors) with a
Llama-3-style chat tokenizer whose template marks assistant text with ``{% generation %}`` (what TRL's
assistant-only loss needs and smalti's chat data reads too), and one seeded chat JSONL from
``smalti.llm.data.make_long_tail_chat`` (heavy-tailed lengths: median about 300 tokens, about 1% above 3,000,
prompts 30-60% of the tokens, 1-4 exchanges) plus a held-out split. Each side trains one epoch over the same
train file, so the same assistant tokens (conversations longer than ``--max-len`` keep their first tokens on both
sides), in its own process:

  (a) TRL's ``SFTTrainer`` with its defaults where the user keeps them: its default collator
      (``DataCollatorForLanguageModeling``: one conversation per row, padded to the batch's longest),
      ``per_device_train_batch_size=8``, ``gradient_checkpointing=True``; and ``bf16=True`` (autocast on CPU;
      ``bf16=False`` under ``--precision fp32``, fp32 weights either way),
      ``optim="adamw_torch_fused"``, ``assistant_only_loss=True``, ``max_length=--max-len``, SDPA attention;
      then (``--packed``) again with ``packing=True`` (TRL's best-fit-decreasing packing, padding-free);
  (b) ``smalti-train experiment=finetune_hf`` (packed rows with sequence ids, the fused linear + cross-entropy,
      ``precision=--precision``, fused AdamW) with ``model.activation_checkpointing=block`` as TRL checkpoints,
      and as many packed rows per batch as give it the optimizer steps of TRL's default run.

Both use the same learning rate (``--lr``, linear decay to 0, no warm-up), AdamW betas (0.9, 0.999), eps 1e-8,
no weight decay and gradient clipping at norm 1.0. Every process's whole-command CPU time (user + system, model
loading and tokenization included) and peak RSS come from ``os.wait4``; the speed is assistant tokens trained
per CPU second (each side counts the tokens its batches carry with a label), the memory the peak RSS. Each
side's trained model is then scored by the same code (``transformers``, fp32) on the held-out split: mean
cross-entropy over its assistant tokens, which must agree within 2%. The bench refuses to print a ratio when
the sides ran at different precision or optimizer implementations or trained different numbers of assistant
tokens. The last line:

    sft_vs_trl: default speed X.XX memory X.XX packed speed X.XX memory X.XX

    OMP_NUM_THREADS=2 python bench/sft_vs_trl.py [--shape llama1b_like] [--conversations 400] [--packed]
        [--precision fp32|amp_bf16]   (default amp_bf16 on a GPU or a CPU with bf16 instructions, else fp32)
    (needs trl==1.16.0: pip install 'smalti-llm[bench]'); --json PATH writes every figure.
    --sides smalti,trl,trl_packed runs some sides only (--json keeps each as soon as it is scored); --from
    A.json B.json ... joins sides of earlier runs on the same terms and prints the ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm_vs_hf import SHAPES, _watch_autocast  # noqa: E402

TRL_BATCH = 8  # SFTConfig's per_device_train_batch_size default
BETAS = (0.9, 0.999)
SMALL = dict(vocab=128256, d_model=256, ffn=768, layers=4, heads=4, kv_heads=2)
TINY = dict(vocab=512, d_model=32, ffn=96, layers=2, heads=4, kv_heads=2)
MODEL_SHAPES = {**{k: v for k, v in SHAPES.items() if k != "long"}, "small": SMALL, "tiny": TINY}
TOLERANCE = 0.02
PRECISIONS = ("fp32", "amp_bf16")


def default_precision() -> str:
    """``amp_bf16`` on a GPU or a CPU with bf16 instructions (avx512_bf16 or AMX), else ``fp32``: without them
    PyTorch emulates bf16 matrix products on the CPU (about 40x slower than fp32 on an AVX2-only machine), so
    a bf16 run at a real shape takes hours and measures the emulation rather than either trainer."""
    if torch.cuda.is_available():
        return "amp_bf16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "fp32"
    return "amp_bf16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "fp32"

TRAIN_TEMPLATE = r"""{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
    {%- set turns = messages %}
{%- endif %}
{{- bos_token }}
{%- if system_message %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' + system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in turns %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def make_folder(shape: dict[str, int], max_len: int, folder: Path) -> None:
    """A seeded random Llama and its Llama-3-style chat tokenizer, as ``save_pretrained`` writes them."""
    import tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    from smalti.testing.hf_tokenizers import write_chat_tokenizer

    write_chat_tokenizer(folder, "llama3")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TRAIN_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    llama = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["d_model"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=max_len, rope_theta=500000.0,
        tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=tok.token_to_id("<|begin_of_text|>"),
        eos_token_id=tok.token_to_id("<|eot_id|>"),
    )
    torch.manual_seed(0)
    LlamaForCausalLM(llama).save_pretrained(folder)


def make_data(folder: Path, n_train: int, n_eval: int, out: Path) -> tuple[Path, Path]:
    """The heavy-tailed train and held-out chat JSONL, token counts measured with the folder's tokenizer."""
    from smalti.llm.data.make_long_tail_chat import heavy_tailed_chat, word_costs_from, write_jsonl

    count = word_costs_from(folder)
    return (write_jsonl(heavy_tailed_chat(n_train, 0, count), out / "train.jsonl"),
            write_jsonl(heavy_tailed_chat(n_eval, 1, count), out / "eval.jsonl"))


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def run_trl(args: argparse.Namespace, peft_config=None) -> dict:
    """TRL's SFTTrainer over the train file (one epoch); saves the trained model to ``--out``. ``peft_config``
    (a ``peft.LoraConfig``) trains PEFT adapters the way a PEFT user does, ``SFTTrainer(peft_config=...)``."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(line) for line in args.train.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(args.folder)
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32, attn_implementation="sdpa")
    autocast: list[str] = []
    # on a decoder layer, not the model: accelerate enters autocast inside the model's own forward, and TRL's
    # fused LM head reads lm_head.weight without calling the module
    _watch_autocast(model.model.layers[-1], torch.device("cpu"), autocast)
    config = SFTConfig(
        output_dir=str(args.out / "trl_run"), bf16=getattr(args, "precision", "amp_bf16") == "amp_bf16",
        optim="adamw_torch_fused", assistant_only_loss=True,
        max_length=args.max_len, packing=args.worker == "trl_packed", per_device_train_batch_size=TRL_BATCH,
        gradient_checkpointing=not args.no_checkpointing, num_train_epochs=1, learning_rate=args.lr,
        lr_scheduler_type="linear", adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=1e-8,
        weight_decay=0.0, max_grad_norm=1.0, save_strategy="no", eval_strategy="no", report_to="none",
        logging_steps=10, use_cpu=True, dataloader_num_workers=0, seed=0,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tok,
                         peft_config=peft_config)
    collate = trainer.data_collator
    counted = {"assistant_tokens": 0, "rows": 0, "row_tokens": 0}

    def counting_collator(features):
        batch = collate(features)
        counted["assistant_tokens"] += int((batch["labels"] != -100).sum())
        counted["rows"] += int(batch["input_ids"].shape[0])
        counted["row_tokens"] += int(batch["input_ids"].numel())
        return batch

    trainer.data_collator = counting_collator
    result = trainer.train()
    trainer.save_model(str(args.out / "hf"))
    tok.save_pretrained(str(args.out / "hf"))
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return {
        **counted,
        "steps": int(result.global_step),
        "train_losses": losses,
        "autocast": sorted(set(autocast)),
        "optimizer": "fused" if opt.defaults.get("fused") else "foreach" if opt.defaults.get("foreach") else "loop",
        "checkpointing": bool(model.is_gradient_checkpointing),
        "collator": type(collate).__name__,
        "padding_free": bool(getattr(collate, "padding_free", False)),
        "attention": model.config._attn_implementation,
        "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    }


def smalti_rows(folder: Path, train: Path, max_len: int) -> list[dict[str, torch.Tensor]]:
    """smalti's packed training rows of the train file (what ``data=chat`` builds)."""
    from smalti.llm.data.chat import ChatDataset

    ds = ChatDataset(path=str(train), tokenizer=str(folder), max_seq_len=max_len, packing=True)
    return [ds[i] for i in range(len(ds))]


def smalti_batch_rows(packed_rows: int, conversations: int) -> int:
    """Packed rows per batch for smalti's side: as many optimizer steps as TRL's default collator makes (one
    conversation per row, ``TRL_BATCH`` a batch), so both follow the same learning-rate schedule. A run of a few
    steps from a random model is decided by its number of steps: at 16 conversations, 3 steps against TRL's 2
    left smalti's held-out loss 4% lower."""
    steps = -(-conversations // TRL_BATCH)
    return max(1, -(-packed_rows // steps))


def smalti_command(args: argparse.Namespace, batch_rows: int, run_dir: Path) -> list[str]:
    """The ``smalti-train experiment=finetune_hf`` command of side (b)."""
    return [
        sys.executable, "-m", "smalti.core.cli.train", "experiment=finetune_hf", f"model.pretrained={args.folder}",
        f"data.train.path={args.train}", f"data.eval.path={args.eval}", f"model.max_seq_len={args.max_len}",
        f"data.global_train_batch_size={batch_rows}", "data.drop_last=false", "trainer.max_duration=1ep",
        "trainer.eval_interval=null", "callbacks=[hf_export]", "logger=[jsonl]", f"hydra.run.dir={run_dir}",
        f"optimizer.lr={args.lr}", f"optimizer.betas=[{BETAS[0]},{BETAS[1]}]", "scheduler.t_warmup=0ba",
        "model.activation_checkpointing=" + ("null" if args.no_checkpointing else "block"),
        f"precision={args.precision}",
    ]


def _measured(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run ``cmd``; return it with its whole-command CPU seconds and peak RSS (MB), read from ``os.wait4``."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(cmd, proc.returncode, out.read().decode(), err.read().decode())
    return done, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def side_trl(args: argparse.Namespace, packed: bool, work: Path) -> dict:
    """Side (a) in its own process."""
    out = work / ("trl_packed" if packed else "trl")
    cmd = [sys.executable, __file__, "--worker", "trl_packed" if packed else "trl", "--folder", str(args.folder),
           "--train", str(args.train), "--out", str(out), "--max-len", str(args.max_len), "--lr", str(args.lr),
           "--precision", args.precision]
    cmd += ["--no-checkpointing"] if args.no_checkpointing else []
    start = time.perf_counter()
    done, cpu, rss = _measured(cmd, {**os.environ}, work)
    if done.returncode:
        raise SystemExit(f"TRL side failed ({done.returncode}):\n{done.stderr[-4000:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    return {**res, "cpu_s": cpu, "wall_s": time.perf_counter() - start, "rss_mb": rss, "model": out / "hf"}


def side_smalti(args: argparse.Namespace, batch_rows: int, rows: list[dict], work: Path,
                lora: tuple[str, ...] | None = None) -> dict:
    """Side (b): ``smalti-train experiment=finetune_hf`` in its own process; with ``lora`` (overrides),
    ``experiment=finetune_hf_lora`` instead, and no merged Hugging Face folder is looked for."""
    import yaml

    run_dir = work / "smalti"
    env = {**os.environ, "SMALTI_RUN_NAME": "sft_vs_trl", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    cmd = smalti_command(args, batch_rows, run_dir)
    if lora is not None:
        cmd = [c.replace("experiment=finetune_hf", "experiment=finetune_hf_lora") for c in cmd]
        cmd += [o for o in lora if o.split("=")[0] not in {c.split("=")[0] for c in cmd}]
    done, cpu, rss = _measured(cmd, env, work)
    if done.returncode:
        raise SystemExit(f"smalti side failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    from smalti.core.loggers import read_jsonl

    losses = {}
    for metrics_file in run_dir.rglob("*.jsonl"):
        for record in read_jsonl(metrics_file):
            if "loss/train/total" in record.get("metrics", {}):
                losses[record["step"]] = record["metrics"]["loss/train/total"]
    precision = config["trainer"]["precision"]
    return {
        "assistant_tokens": int(sum(int((r["labels"] != -100).sum()) for r in rows)),
        "rows": len(rows),
        "row_tokens": sum(int(r["input_ids"].numel()) for r in rows),
        "steps": len(losses),
        "train_losses": [losses[s] for s in sorted(losses)],
        "autocast": ["bfloat16"] if "bf16" in str(precision) else ["off"],
        "precision": str(precision),
        "optimizer": "fused" if config["optimizer"].get("fused") else "foreach/loop",
        "checkpointing": config["model"].get("activation_checkpointing") not in (None, "null"),
        "collator": "packed rows with sequence ids",
        "cpu_s": cpu, "wall_s": time.perf_counter() - start, "rss_mb": rss,
        "model": _exported(run_dir) if lora is None else None,
    }


def _exported(run_dir: Path) -> Path:
    found = sorted(p.parent for p in run_dir.rglob("config.json") if (p.parent / "model.safetensors").exists()
                   or any(p.parent.glob("*.safetensors")))
    if not found:
        raise SystemExit(f"smalti side wrote no Hugging Face folder under {run_dir}")
    return found[0]


def eval_loss(model_dir: Path, eval_file: Path, max_len: int) -> float:
    """Mean cross-entropy (fp32) over the assistant tokens of the held-out conversations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for line in eval_file.read_text().splitlines():
            enc = tok.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            ids = torch.tensor(enc["input_ids"][:max_len])
            labels = torch.where(torch.tensor(enc["assistant_masks"][:max_len]) == 1, ids, -100)
            logits = model(ids[None]).logits[0, :-1].float()
            target = labels[1:]
            if (target != -100).any():
                total += float(torch.nn.functional.cross_entropy(logits, target, ignore_index=-100,
                                                                 reduction="sum"))
                count += int((target != -100).sum())
    return total / count


def _check_terms(trl: dict, sm: dict, label: str) -> None:
    for key in ("autocast", "optimizer", "checkpointing"):
        if trl[key] != sm[key]:
            raise SystemExit(f"unfair comparison ({label}): TRL ran {key}={trl[key]}, smalti {key}={sm[key]}")
    if trl["assistant_tokens"] != sm["assistant_tokens"]:
        raise SystemExit(f"{label}: TRL trained {trl['assistant_tokens']} assistant tokens, smalti "
                         f"{sm['assistant_tokens']}: not the same data")


def _report(name: str, res: dict, loss: float) -> None:
    print(f"{name:11s}: {res['assistant_tokens']} assistant tokens in {res['steps']} steps of {res['rows']} rows "
          f"({res['row_tokens']} row tokens, {res['assistant_tokens'] / res['row_tokens']:.0%} trained); CPU "
          f"{res['cpu_s']:.1f} s (wall {res['wall_s']:.1f} s): {res['assistant_tokens'] / res['cpu_s']:.0f} "
          f"assistant tokens/CPU-s; peak RSS {res['rss_mb']:.0f} MB; held-out loss {loss:.4f}; autocast "
          f"{','.join(res['autocast'])}, AdamW {res['optimizer']}, checkpointing {res['checkpointing']}, "
          f"{res['collator']}", flush=True)


def _lengths(rows_file: Path, folder: Path) -> str:
    from smalti.llm.tokenizer import load_tokenizer

    tok = load_tokenizer(folder)
    lengths, prompt_shares = [], []
    for line in rows_file.read_text().splitlines():
        ids, mask = tok.encode_chat(json.loads(line)["messages"])[:2]
        lengths.append(len(ids))
        prompt_shares.append(1 - sum(mask) / len(ids))
    return (f"{len(lengths)} conversations: median {statistics.median(lengths):.0f} tokens, mean "
            f"{statistics.mean(lengths):.0f}, {sum(n > 3000 for n in lengths) / len(lengths):.1%} above 3,000, "
            f"longest {max(lengths)}; prompt share median {statistics.median(prompt_shares):.0%}")


SIDES = ("smalti", "trl", "trl_packed")


def _terms(args: argparse.Namespace, digest: str) -> dict:
    """What two runs must share for their sides to be compared: model, data, precision and training settings."""
    return {"shape": args.shape, "precision": args.precision, "max_len": args.max_len, "lr": args.lr,
            "checkpointing": not args.no_checkpointing, "data": digest}


def _joined(files: list[Path], terms: dict) -> dict[str, dict]:
    """The sides earlier ``--json`` runs wrote, refused when they ran on other terms (model, data, precision)."""
    sides: dict[str, dict] = {}
    for file in files:
        try:
            earlier = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"--from {file}: not a sft_vs_trl --json file ({exc})") from exc
        if earlier.get("terms") != terms:
            raise SystemExit(f"--from {file}: ran on {earlier.get('terms')}, this run is {terms}; pass the same "
                             "--shape, --conversations, --eval-conversations, --max-len, --lr, --precision and "
                             "checkpointing")
        for name, res in earlier["sides"].items():
            sides[name] = res
            print(f"{name}: from {file}", flush=True)
    return sides


def _write(path: Path | None, result: dict) -> None:
    """Write ``result`` to ``path`` whole: a reader never sees a half-written file."""
    if path is None:
        return
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(result, indent=1))
    part.replace(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(MODEL_SHAPES), default="llama1b_like")
    p.add_argument("--conversations", type=int, default=400, help="train conversations (one epoch)")
    p.add_argument("--eval-conversations", type=int, default=40)
    p.add_argument("--max-len", type=int, default=1024, help="TRL max_length and smalti model.max_seq_len")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--packed", action="store_true", help="also run TRL with packing=True")
    p.add_argument("--sides", default=None,
                   help="comma-separated sides to run in this process, of smalti,trl,trl_packed (default: all, "
                   "trl_packed only with --packed); --json then holds them for a later --from")
    p.add_argument("--from", dest="joined", nargs="+", type=Path, default=(),
                   help="take the sides these --json files of earlier runs (same terms) hold instead of running them")
    p.add_argument("--no-checkpointing", action="store_true", help="neither side checkpoints activations")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="both sides: fp32 (TRL bf16=False; smalti precision=fp32) or amp_bf16 (TRL bf16=True, "
                   "autocast; smalti precision=amp_bf16); fp32 weights either way. Default: amp_bf16 on a GPU "
                   "or a CPU with bf16 instructions, else fp32")
    p.add_argument("--json", type=Path, default=None,
                   help="write every figure here, rewritten after each side so a finished side is kept")
    p.add_argument("--worker", choices=["trl", "trl_packed"], help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--train", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--eval", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.precision = args.precision or default_precision()
    if args.worker:
        print(json.dumps(run_trl(args)))
        return
    wanted = ["smalti", "trl"] + (["trl_packed"] if args.packed else [])
    if args.sides is not None:
        wanted = [s.strip() for s in args.sides.split(",") if s.strip()]
        unknown = sorted(set(wanted) - set(SIDES))
        if unknown or not wanted:
            p.error(f"--sides {args.sides!r}: unknown side(s) {unknown}; choose from {','.join(SIDES)}")
    import transformers
    import trl

    shape = MODEL_SHAPES[args.shape]
    print(f"cpu threads={os.environ.get('OMP_NUM_THREADS', torch.get_num_threads())} torch={torch.__version__} "
          f"shape {args.shape}: " + " ".join(f"{k}={v}" for k, v in shape.items()) + f" max_len={args.max_len}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="sft_vs_trl.") as tmp:
        work = Path(tmp)
        args.folder = work / "model"
        make_folder(shape, args.max_len, args.folder)
        args.train, args.eval = make_data(args.folder, args.conversations, args.eval_conversations, work / "data")
        digest = _digest(args.train, args.eval)
        print(f"data (sha256 {digest}): train {_lengths(args.train, args.folder)}", flush=True)
        terms = _terms(args, digest)
        rows = smalti_rows(args.folder, args.train, args.max_len)
        batch_rows = smalti_batch_rows(len(rows), args.conversations)
        baseline = (
            f"trl {trl.__version__} SFTTrainer, transformers {transformers.__version__}: precision {args.precision} "
            f"(bf16={args.precision == 'amp_bf16'}{', autocast' if args.precision == 'amp_bf16' else ''}, fp32 "
            f"weights), "
            f"optim=adamw_torch_fused, assistant_only_loss=True, attention sdpa, per_device_train_batch_size="
            f"{TRL_BATCH}, gradient_checkpointing={not args.no_checkpointing}, max_length={args.max_len}, "
            f"lr {args.lr} linear, betas {BETAS}, max_grad_norm 1.0; default collator, then packing=True (bfd)"
        )
        print(f"baseline: {baseline}", flush=True)
        print(f"smalti: experiment=finetune_hf precision={args.precision}, {batch_rows} packed rows of {args.max_len} per batch "
              f"(as many optimizer steps as TRL's default {TRL_BATCH} conversations a batch), activation_checkpointing="
              f"{'null' if args.no_checkpointing else 'block'}", flush=True)
        result: dict = {"baseline": baseline, "shape": args.shape, "precision": args.precision, "terms": terms,
                        "sides": _joined(list(args.joined), terms), "ratios": {}}
        for name in wanted:
            if name in result["sides"]:
                continue
            res = (side_smalti(args, batch_rows, rows, work) if name == "smalti"
                   else side_trl(args, name == "trl_packed", work))
            loss = eval_loss(res["model"], args.eval, args.max_len)
            result["sides"][name] = {k: v for k, v in res.items() if k != "model"} | {"eval_loss": loss}
            _write(args.json, result)
    for name in SIDES:
        if name in result["sides"]:
            _report(name, result["sides"][name], result["sides"][name]["eval_loss"])
    sm = result["sides"].get("smalti")
    if sm is None or "trl" not in result["sides"]:
        print("sft_vs_trl: no ratio (smalti's side and TRL's default side are needed: run the missing ones with "
              "--sides, then join the --json files with --from)")
        return
    for name in ("trl", "trl_packed"):
        if name not in result["sides"]:
            continue
        res = result["sides"][name]
        _check_terms(res, sm, name)
        gap = abs(sm["eval_loss"] - res["eval_loss"]) / res["eval_loss"]
        speed = (sm["assistant_tokens"] / sm["cpu_s"]) / (res["assistant_tokens"] / res["cpu_s"])
        memory = sm["rss_mb"] / res["rss_mb"]
        same_steps = sm["steps"] == res["steps"]
        result["ratios"][name] = {"speed": speed, "memory": memory, "eval_loss_gap": gap, "same_steps": same_steps}
        print(f"smalti vs {name}: speed {speed:.2f} (assistant tokens per CPU second), memory {memory:.2f} "
              f"(peak RSS), held-out loss {sm['eval_loss']:.4f} vs {res['eval_loss']:.4f} ({gap:.1%} apart, "
              f"limit {TOLERANCE:.0%}" + ("" if same_steps else f" not applied: {sm['steps']} optimizer steps "
                                          f"against {res['steps']}") + ")", flush=True)
        if gap > TOLERANCE and same_steps:
            raise SystemExit(f"held-out losses differ by {gap:.1%} (limit {TOLERANCE:.0%})")
    _write(args.json, result)
    default = result["ratios"]["trl"]
    packed = result["ratios"].get("trl_packed")
    print(f"baseline: {result['baseline']}")
    print(f"sft_vs_trl: default speed {default['speed']:.2f} memory {default['memory']:.2f} packed "
          + (f"speed {packed['speed']:.2f} memory {packed['memory']:.2f}" if packed else "not run (--packed)"))


if __name__ == "__main__":
    main()
