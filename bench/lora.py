"""LoRA and QLoRA against full finetuning and against transformers + PEFT, at the same precision.

One seeded random Llama (bench/llm_vs_hf.py's ``llama1b_like`` shape by default: Llama-3.2-1B's vocabulary and
proportions scaled to this machine) is saved by ``transformers``; each run below trains it for ``--steps`` steps
on the same token batches in a fresh subprocess, under bf16 autocast with ``torch.optim.AdamW(fused=True)``:

  full    smalti's ``import_hf`` through ``smalti.core.Trainer``, every weight trained (fp32 weights)
  lora    the same with ``model.lora`` r 16, alpha 32, dropout 0.05, all linear layers (bf16 frozen base, fp32
          adapters): PEFT's usual settings, as ``experiment=finetune_hf_lora``
  qlora   ``lora`` with ``base_dtype=nf4`` (torchao's NF4Tensor)
  peft    ``transformers`` (SDPA, base loaded in bf16) + ``peft.get_peft_model`` with the same LoRA settings
          (``target_modules="all-linear"``, adapters upcast to fp32 as PEFT does by default), its own loss

Memory is the peak RSS of the steps after the first (``/proc/self/clear_refs`` then ``VmHWM``: weights,
optimizer state and the step's transients); speed is tokens per process CPU second (median step; on a shared
machine CPU time is the work done). ``full`` and ``lora`` then save a smalti-checkpoint (``Checkpointer``): its
bytes on disk and seconds. Each worker reports the autocast state its forward ran under and its AdamW
implementation; the bench refuses to print ratios when the LoRA sides differ. The last line:

    lora: mem_vs_full X.XX qlora_mem_vs_full X.XX vs_peft_speed X.XX vs_peft_memory X.XX ckpt_ratio X.XX

(``vs_peft_speed``: smalti LoRA tokens/CPU-s over PEFT's, higher is better; ``vs_peft_memory``: smalti's peak over
PEFT's; ``ckpt_ratio``: LoRA checkpoint bytes over full; the save-time ratio is printed above it.)

    OMP_NUM_THREADS=2 python bench/lora.py [--steps 4] [--vocab ... --seq ... to replace the shape] [--json PATH]
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
from llm_vs_hf import SHAPE_KEYS, SHAPES, _adamw, _optimizer_impl, _watch_autocast, make_folder  # noqa: E402

LORA = {"r": 16, "alpha": 32, "dropout": 0.05, "targets": "all_linear"}
SIDES = ("full", "lora", "qlora", "peft")


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


def run_smalti(side: str, folder: Path, steps: int) -> dict:
    """smalti's Trainer on the imported model: every weight (``full``), or LoRA / QLoRA adapters."""
    from smalti.core import Callback, Trainer
    from smalti.llm.hf import import_hf

    data = torch.load(folder / "tokens.pt")
    lora = None if side == "full" else {**LORA, "base_dtype": "nf4" if side == "qlora" else "bfloat16"}
    model = import_hf(folder, max_seq_len=data.shape[-1], lora=lora)
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
                      precision="amp_bf16", callbacks={"record": Record()}, optimizers=make_optimizer)
    trainer.fit()
    out = {**record.report(data[0].numel()), "autocast": sorted(set(autocast)),
           "optimizer": _optimizer_impl(built[0]),
           "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if side in ("full", "lora"):
        from smalti.checkpoint import Checkpointer

        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Checkpointer(save_folder=tmp, save_interval=None, save_on_fit_end=False)
            start = time.perf_counter()
            ckpt.save(trainer.state, trainer.logger)
            ckpt.wait()
            out["ckpt_s"] = time.perf_counter() - start
            out["ckpt_bytes"] = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
    return out


def run_peft(folder: Path, steps: int) -> dict:
    """transformers + PEFT: the base in bf16, LoRA adapters (fp32) on every linear layer, bf16 autocast."""
    import peft
    from transformers import LlamaForCausalLM

    data = torch.load(folder / "tokens.pt")
    base = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = peft.get_peft_model(base, peft.LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"],
                                                      lora_dropout=LORA["dropout"], target_modules="all-linear",
                                                      task_type="CAUSAL_LM")).train()
    opt = _adamw([p for p in model.parameters() if p.requires_grad], "fused")
    autocast: list[str] = []
    _watch_autocast(model, torch.device("cpu"), autocast)
    record = _Steps()
    for step in range(steps):
        ids = data[step]
        record.start()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        record.end(loss.item())
    adapters = {p.dtype for n, p in model.named_parameters() if p.requires_grad}
    return {**record.report(data[0].numel()), "autocast": sorted(set(autocast)), "optimizer": _optimizer_impl(opt),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "adapter_dtypes": sorted(str(d) for d in adapters)}


def _child(side: str, folder: Path, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--folder", str(folder), "--steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{side} worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    for key in SHAPE_KEYS:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step warms up)")
    if args.worker:
        folder = Path(args.folder)
        result = run_peft(folder, args.steps) if args.worker == "peft" else run_smalti(args.worker, folder, args.steps)
        print(json.dumps(result))
        return
    shape = dict(SHAPES["llama1b_like"])
    shape.update({k: getattr(args, k) for k in SHAPE_KEYS if getattr(args, k) is not None})
    print("shape:", " ".join(f"{k} {v}" for k, v in shape.items()), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_folder(shape, args.steps, folder)
        runs = {}
        for side in SIDES:
            runs[side] = r = _child(side, folder, args.steps)
            print(f"{side:6s} peak {r['peak_mb']:9.1f} MB  {r['tokens_per_cpu_s']:9.1f} tokens/CPU-s  trainable "
                  f"{r['trainable'] / 1e6:8.2f} M  autocast {r['autocast']}  adamw {r['optimizer']}  first loss "
                  f"{r['losses'][0]:.4f}" + (f"  checkpoint {r['ckpt_bytes'] / 2**20:.1f} MB in {r['ckpt_s']:.3f} s"
                                             if "ckpt_s" in r else ""), flush=True)
    terms = {(tuple(runs[s]["autocast"]), runs[s]["optimizer"]) for s in SIDES}
    if len(terms) != 1:
        raise SystemExit(f"the runs did not run on the same terms (autocast, AdamW): {terms}; no ratios")
    full, lora, qlora, theirs = (runs[s] for s in SIDES)
    ratios = {
        "mem_vs_full": lora["peak_mb"] / full["peak_mb"],
        "qlora_mem_vs_full": qlora["peak_mb"] / full["peak_mb"],
        "vs_peft_speed": lora["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"],
        "vs_peft_memory": lora["peak_mb"] / theirs["peak_mb"],
        "ckpt_ratio": lora["ckpt_bytes"] / full["ckpt_bytes"],
    }
    print(f"checkpoint save time: lora {lora['ckpt_s']:.3f} s / full {full['ckpt_s']:.3f} s = "
          f"{lora['ckpt_s'] / full['ckpt_s']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": shape, "runs": runs, "ratios": ratios}, indent=2))
    print("lora: " + " ".join(f"{k} {v:.2f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
