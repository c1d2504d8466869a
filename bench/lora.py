"""LoRA and QLoRA against full finetuning and against transformers + PEFT (through TRL), at the same precision.

``--precision fp32`` (the default: this AVX2 CPU emulates bf16 products ~40x slower than fp32) runs every side's
products in fp32; ``--precision amp_bf16`` runs every side under bf16 autocast (PEFT's: TRL's ``bf16=True``).
The frozen base is held as the LoRA recipe holds it in the memory part (``model.lora.base_dtype`` default
``bfloat16``: 2 bytes a parameter, upcast for each product under fp32; QLoRA's NF4), against full finetuning's
fp32 weights; in the chat part smalti's base has PEFT's dtype (fp32 under fp32), so both sides compute the same
numbers. Every worker reports the precision
and autocast its forward ran under and its AdamW implementation (fused everywhere); the bench refuses to print a
ratio when they differ.

Part 1, memory and checkpoints. One seeded random Llama (bench/llm_vs_hf.py's ``llama1b_like`` shape by default:
Llama-3.2-1B's vocabulary and proportions scaled to this machine) is saved by ``transformers``; each run trains it
for ``--steps`` steps on the same token batches in a fresh subprocess through ``smalti.core.Trainer``, every side
with the same ``--checkpointing`` (``block``, as the chat part, or ``none``):

  full    smalti's ``import_hf``, every weight trained (fp32 weights)
  lora    the same with ``model.lora`` r 16, alpha 32, dropout 0.05, all linear layers: PEFT's usual settings,
          as ``experiment=finetune_hf_lora``, the base in bf16 (the recipe's ``base_dtype``)
  qlora   ``lora`` with ``base_dtype=nf4`` (torchao's NF4Tensor)

Memory is the peak RSS of the steps after the first (``/proc/self/clear_refs`` then ``VmHWM``: weights,
optimizer state and the step's transients). ``full`` and ``lora`` then save a smalti-checkpoint
(``Checkpointer``), timed the same way: bytes on disk and seconds.

Part 2, against PEFT on the chat finetune workload (bench/sft_vs_trl.py's data and TRL helpers): a seeded Llama
of the same shape with a Llama-3 chat tokenizer, ``--conversations`` heavy-tailed chat conversations
(``smalti.llm.data.make_long_tail_chat``), one epoch on each side, each in its own process:

  smalti  ``smalti-train experiment=finetune_hf_lora`` (packed rows with sequence ids, the fused loss), as many
          packed rows per batch as give it PEFT's optimizer steps (``ceil(rows / ceil(conversations / 8))``, as
          bench/sft_vs_trl.py sizes them)
  peft    TRL's ``SFTTrainer(peft_config=LoraConfig(...))`` with the same LoRA settings
          (``target_modules="all-linear"``), its default collator (one conversation per row, padded per batch),
          8 conversations per batch, ``assistant_only_loss=True``, ``optim="adamw_torch_fused"``

Both checkpoint activations per block (TRL's default), train the same assistant tokens (checked) and the same
number of adapter parameters (checked); speed is assistant tokens per whole-process CPU second, memory the
whole-process peak RSS (``os.wait4``). The last line:

    lora: mem_vs_full X.XX qlora_mem_vs_full X.XX vs_peft_speed X.XX vs_peft_memory X.XX ckpt_ratio X.XX

(``vs_peft_speed``: smalti's tokens/CPU-s over PEFT's, higher is better; ``vs_peft_memory``: smalti's peak over
PEFT's; ``ckpt_ratio``: LoRA checkpoint bytes over full; the save-time ratio is printed above it.)

    OMP_NUM_THREADS=1 python bench/lora.py [--precision fp32] [--checkpointing block] [--steps 3]
        [--conversations 40] [--max-len 1024] [--vocab ... --seq ... to replace the shape] [--json PATH]
        [--part memory|chat --json PART.json, then --from PART.json ... to join parts run apart]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm_vs_hf import PRECISIONS, SHAPE_KEYS, SHAPES, _adamw, _optimizer_impl, _watch_autocast, make_folder  # noqa: E402

LORA = {"r": 16, "alpha": 32, "dropout": 0.05, "targets": "all_linear"}
SIDES = ("full", "lora", "qlora")
#: The chat part's base dtype: PEFT's (TRL loads the model in the run's precision), so both sides compute alike.
PEFT_BASE_DTYPE = {"fp32": "float32", "amp_bf16": "bfloat16"}
#: The memory part's LoRA base dtype: the recipe's default (``model.lora.base_dtype``) at every precision.
LORA_BASE_DTYPE = "bfloat16"


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


class _Steps:
    """Times each step and resets the peak RSS after the first, so the peak is a training step's."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.cpu: list[float] = []
        self._cpu = 0.0

    def start(self) -> None:
        if len(self.losses) == 1:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        self._cpu = time.process_time()

    def end(self, loss: float) -> None:
        self.losses.append(loss)
        self.cpu.append(time.process_time() - self._cpu)

    def report(self, tokens: int) -> dict:
        return {"losses": self.losses, "cpu_times": self.cpu, "peak_mb": _status("VmHWM:") / 2**20,
                "tokens_per_cpu_s": tokens / statistics.median(self.cpu[1:] or self.cpu)}


def timed_saves(trainer, saves: int = 2) -> dict:
    """Save ``trainer``'s state ``saves`` times with a smalti-checkpoint ``Checkpointer`` (each into a fresh folder,
    timed from the call to the files committed), the same way on every side: the first save pays the process's
    one-off costs (lazy imports, the write buffers), the later ones are what each save of a run costs. Also counts
    the DCP entries (tensors and objects) a save writes: each costs a fixed serialisation overhead."""
    from torch.distributed.checkpoint import FileSystemReader

    from smalti.checkpoint import Checkpointer

    times = []
    for _ in range(saves):
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Checkpointer(save_folder=tmp, save_interval=None, save_on_fit_end=False)
            start = time.perf_counter()
            ckpt.save(trainer.state, trainer.logger)
            ckpt.wait()
            times.append(time.perf_counter() - start)
            files = [f for f in Path(tmp).rglob("*") if f.is_file()]
            written = sum(f.stat().st_size for f in files)
            entries = len(FileSystemReader(next(f.parent for f in files if f.name == ".metadata"))
                          .read_metadata().state_dict_metadata)
    return {"ckpt_s": times[0], "ckpt_s_later": times[1:], "ckpt_bytes": written, "ckpt_entries": entries}


def run_smalti(side: str, folder: Path, steps: int, precision: str, checkpointing: str) -> dict:
    """smalti's Trainer on the imported model: every weight (``full``), or LoRA / QLoRA adapters."""
    from smalti.core import Callback, Trainer
    from smalti.core.cpu_malloc import DEFAULT_MMAP_THRESHOLD, configure_cpu_malloc
    from smalti.llm.hf import import_hf

    configure_cpu_malloc(DEFAULT_MMAP_THRESHOLD, "cpu")  # before the import, as smalti-train sets it
    data = torch.load(folder / "tokens.pt")
    lora = None if side == "full" else {**LORA, "base_dtype": "nf4" if side == "qlora" else LORA_BASE_DTYPE}
    model = import_hf(folder, max_seq_len=data.shape[-1], lora=lora,
                      activation_checkpointing=None if checkpointing == "none" else checkpointing)
    autocast: list[str] = []
    _watch_autocast(model, torch.device("cpu"), autocast)
    record = _Steps()
    built: list[torch.optim.Optimizer] = []

    class Record(Callback):
        def on_batch_start(self, state) -> None:
            record.start()

        def on_batch_end(self, state) -> None:
            record.end(float(state.batch_loss))

    def make_optimizer(params):
        built.append(_adamw([p for p in params if p.requires_grad], "fused"))
        return built[-1]

    trainer = Trainer(model, [{"input_ids": data[i]} for i in range(steps)], f"{steps}ba", eval_interval=None,
                      precision=precision, callbacks={"record": Record()}, optimizers=make_optimizer)
    trainer.fit()
    out = {**record.report(data[0].numel()), "precision": precision, "checkpointing": checkpointing,
           "autocast": sorted(set(autocast)),
           "optimizer": _optimizer_impl(built[0]),
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "base_dtypes": sorted({type(p).__name__ if type(p).__name__ == "NF4Tensor" else str(p.dtype)
                                  for p in model.parameters() if not p.requires_grad})}
    if side in ("full", "lora"):
        out.update(timed_saves(trainer))
    return out


def run_peft(args: argparse.Namespace) -> dict:
    """transformers + PEFT through TRL's SFTTrainer, the way a PEFT user finetunes on chat data."""
    import peft
    from sft_vs_trl import run_trl

    config = peft.LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                             target_modules="all-linear", task_type="CAUSAL_LM")
    trl_args = argparse.Namespace(folder=args.folder, train=args.train, out=args.out, max_len=args.max_len,
                                  lr=args.lr, no_checkpointing=False, worker="trl")
    trl_args.precision = args.precision
    return {**run_trl(trl_args, peft_config=config), "precision": args.precision}


def _child(side: str, folder: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--folder", str(folder), "--steps", str(args.steps),
           "--precision", args.precision, "--checkpointing", args.checkpointing]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{side} worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _same_terms(runs: dict[str, dict], keys: tuple[str, ...]) -> None:
    terms = {side: tuple(str(r[k]) for k in keys) for side, r in runs.items()}
    if len(set(terms.values())) != 1:
        raise SystemExit(f"the runs did not run on the same terms {keys}: {terms}; no ratios")


def memory_part(args: argparse.Namespace, shape: dict[str, int]) -> dict[str, dict]:
    """Part 1: full, LoRA and QLoRA steps on the same token batches, each in a fresh process."""
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_folder(shape, args.steps, folder)
        for side in SIDES:
            runs[side] = r = _child(side, folder, args)
            print(f"{side:6s} peak {r['peak_mb']:9.1f} MB  {r['tokens_per_cpu_s']:9.1f} tokens/CPU-s  trainable "
                  f"{r['trainable'] / 1e6:8.2f} M  frozen {r['base_dtypes']}  {r['precision']} checkpointing "
                  f"{r['checkpointing']} autocast "
                  f"{r['autocast']}  adamw {r['optimizer']}  first loss {r['losses'][0]:.4f}"
                  + (f"  checkpoint {r['ckpt_bytes'] / 2**20:.1f} MB ({r['ckpt_entries']} entries) in "
                     f"{r['ckpt_s']:.3f} s, then {', '.join(f'{t:.3f}' for t in r['ckpt_s_later'])} s"
                     if "ckpt_s" in r else ""), flush=True)
    _same_terms(runs, ("precision", "checkpointing", "autocast", "optimizer"))
    print(save_time_line(runs["lora"], runs["full"]), flush=True)
    return runs


def save_time_line(lora: dict, full: dict) -> str:
    """LoRA's checkpoint save time over full finetuning's: the first save of each process, and the later ones."""
    line = f"checkpoint save time: lora {lora['ckpt_s']:.3f} s / full {full['ckpt_s']:.3f} s = " \
           f"{lora['ckpt_s'] / full['ckpt_s']:.3f}"
    if lora.get("ckpt_s_later") and full.get("ckpt_s_later"):
        mine, theirs = statistics.median(lora["ckpt_s_later"]), statistics.median(full["ckpt_s_later"])
        line += f"; later saves {mine:.3f} s / {theirs:.3f} s = {mine / theirs:.3f}"
    return line


def chat_part(args: argparse.Namespace, shape: dict[str, int]) -> dict[str, dict]:
    """Part 2: smalti's LoRA run and TRL + PEFT's over the same chat conversations, each in its own process."""
    import os

    from sft_vs_trl import (
        _check_terms,
        _lengths,
        _measured,
        make_data,
        side_smalti,
        smalti_batch_rows,
        smalti_rows,
    )
    from sft_vs_trl import make_folder as make_chat_folder

    with tempfile.TemporaryDirectory(prefix="lora_chat.") as tmp:
        work = Path(tmp)
        args.folder = work / "model"
        make_chat_folder({k: v for k, v in shape.items() if k not in ("seq", "batch")}, args.max_len, args.folder)
        args.train, args.eval = make_data(args.folder, args.conversations, 8, work / "data")  # eval: not run
        args.no_checkpointing = False
        print(f"chat data: {_lengths(args.train, args.folder)}", flush=True)
        rows = smalti_rows(args.folder, args.train, args.max_len)
        batch_rows = smalti_batch_rows(len(rows), args.conversations)  # PEFT's optimizer steps, not its tokens
        overrides = (f"precision={args.precision}", f"model.lora.base_dtype={PEFT_BASE_DTYPE[args.precision]}",
                     "callbacks.hf_export.merge=false")
        sm = side_smalti(args, batch_rows, rows, work, lora=overrides)
        sm["precision"] = args.precision
        adapter = next(work.rglob("adapter_model.safetensors"), None)
        if adapter is None:
            raise SystemExit("smalti's LoRA run wrote no adapter_model.safetensors")
        from safetensors.torch import load_file

        sm["trainable"] = sum(t.numel() for t in load_file(adapter).values())
        cmd = [sys.executable, __file__, "--worker", "peft", "--folder", str(args.folder), "--train", str(args.train),
               "--out", str(work / "peft"), "--max-len", str(args.max_len), "--lr", str(args.lr),
               "--precision", args.precision]
        start = time.perf_counter()
        done, cpu, rss = _measured(cmd, {**os.environ}, work)
        if done.returncode:
            raise SystemExit(f"peft worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
        theirs = {**json.loads(done.stdout.strip().splitlines()[-1]), "cpu_s": cpu,
                  "wall_s": time.perf_counter() - start, "rss_mb": rss}
    runs = {"smalti": sm, "peft": theirs}
    for name, r in runs.items():
        print(f"chat {name:6s}: {r['assistant_tokens']} assistant tokens in {r['steps']} steps of {r['rows']} rows "
              f"({r['row_tokens']} row tokens); CPU {r['cpu_s']:.1f} s (wall {r['wall_s']:.1f} s): "
              f"{r['assistant_tokens'] / r['cpu_s']:.1f} assistant tokens/CPU-s; peak RSS {r['rss_mb']:.0f} MB; "
              f"trainable {r['trainable'] / 1e6:.2f} M; {r['precision']} autocast {r['autocast']}, AdamW "
              f"{r['optimizer']}, checkpointing {r['checkpointing']}, {r['collator']}", flush=True)
    _check_terms(theirs, sm, "peft")
    _same_terms(runs, ("precision", "trainable"))
    return runs


def _joined(files: list[Path], precision: str, checkpointing: str, shape: dict[str, int]) -> dict[str, dict]:
    """The parts earlier ``--part`` runs wrote, refused when they ran at another precision, checkpointing or
    shape."""
    parts: dict[str, dict] = {}
    for file in files:
        earlier = json.loads(file.read_text())
        terms = (earlier["precision"], earlier.get("checkpointing"), earlier["shape"])
        if terms != (precision, checkpointing, shape):
            raise SystemExit(f"{file} holds a run at {terms}, not {(precision, checkpointing, shape)}: pass the "
                             "same --precision, --checkpointing and shape")
        for key in ("runs", "chat"):
            if key in earlier:
                parts[key] = earlier[key]
                print(f"{key} ({', '.join(earlier[key])}): from {file}", flush=True)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpointing", choices=("block", "none"), default="block",
                        help="memory part: activation checkpointing on every side (the chat part checkpoints "
                        "blocks on both sides, TRL's default)")
    parser.add_argument("--conversations", type=int, default=40, help="chat conversations, one epoch")
    parser.add_argument("--max-len", type=int, default=1024, help="chat: TRL max_length and smalti max_seq_len")
    parser.add_argument("--lr", type=float, default=2e-4)
    for key in SHAPE_KEYS:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--part", choices=("all", "memory", "chat"), default="all",
                        help="run one part only (its figures go to --json); --from then joins the parts")
    parser.add_argument("--from", dest="joined", nargs="+", type=Path, default=(),
                        help="take the parts these --json files of earlier --part runs hold instead of running them")
    parser.add_argument("--worker", choices=(*SIDES, "peft"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--train", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step warms up)")
    if args.worker:
        result = (run_peft(args) if args.worker == "peft"
                  else run_smalti(args.worker, args.folder, args.steps, args.precision, args.checkpointing))
        print(json.dumps(result))
        return
    shape = dict(SHAPES["llama1b_like"])
    shape.update({k: getattr(args, k) for k in SHAPE_KEYS if getattr(args, k) is not None})
    print(f"precision {args.precision}; shape:", " ".join(f"{k} {v}" for k, v in shape.items()), flush=True)
    parts = _joined(args.joined, args.precision, args.checkpointing, shape)
    if "runs" not in parts and args.part in ("all", "memory"):
        parts["runs"] = memory_part(args, shape)
    if "chat" not in parts and args.part in ("all", "chat"):
        parts["chat"] = chat_part(args, shape)
    if args.json:
        Path(args.json).write_text(json.dumps({"precision": args.precision, "checkpointing": args.checkpointing, "shape": shape, **parts}, indent=2,
                                              default=str))
    if set(parts) != {"runs", "chat"}:
        return
    runs, chat = parts["runs"], parts["chat"]
    full, lora, qlora = (runs[s] for s in SIDES)
    mine, theirs = chat["smalti"], chat["peft"]
    print(save_time_line(lora, full))
    ratios = {
        "mem_vs_full": lora["peak_mb"] / full["peak_mb"],
        "qlora_mem_vs_full": qlora["peak_mb"] / full["peak_mb"],
        "vs_peft_speed": (mine["assistant_tokens"] / mine["cpu_s"]) / (theirs["assistant_tokens"] / theirs["cpu_s"]),
        "vs_peft_memory": mine["rss_mb"] / theirs["rss_mb"],
        "ckpt_ratio": lora["ckpt_bytes"] / full["ckpt_bytes"],
    }
    if args.json:
        Path(args.json).write_text(json.dumps({"precision": args.precision, "checkpointing": args.checkpointing, "shape": shape, "runs": runs,
                                               "chat": chat, "ratios": ratios}, indent=2, default=str))
    print("lora: " + " ".join(f"{k} {v:.2f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
