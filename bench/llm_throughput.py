"""Tokens/s and MFU of a smalti-llm recipe's model, and the smalti Trainer's cost over a plain PyTorch loop.

Builds the model of ``--recipe`` (a ``conf/model`` option of smalti-llm, e.g. gpt_tiny or mpt_1b) and trains it
on random tokens of ``--seq-len`` with (a) a plain PyTorch loop and (b) ``smalti.core.Trainer``, alternating
rounds so both see the same machine noise. Prints the median step time of each, tokens/s, MFU by LLM Foundry's
formula (``model.flops_per_batch`` / step time / peak; peak from ``--peak-tflops``, default 989 for H100 bf16
on CUDA) and the ratio ``smalti / plain`` (goal on CPU: <= 1.05).

    python bench/llm_throughput.py [--recipe gpt_tiny] [--batch 16] [--seq-len 128] [--steps 40] [--rounds 3]
    python bench/llm_throughput.py --recipe mpt_1b --device cuda --precision amp_bf16 --seq-len 2048 --batch 8
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from importlib import resources
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from smalti.core import Callback, Trainer
from smalti.core.precision import autocast


class _Tokens(TensorDataset):
    def __getitem__(self, i):
        return {"input_ids": self.tensors[0][i]}


def build_model(recipe: str, seq_len: int, device: str):
    cfg = OmegaConf.load(Path(str(resources.files("smalti.llm") / "conf" / "model" / f"{recipe}.yaml")))
    cfg.max_seq_len = max(seq_len, cfg.max_seq_len)
    cfg.init_device = device
    torch.manual_seed(0)
    return instantiate(cfg)


def make_loader(steps: int, batch: int, seq_len: int, vocab: int) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (steps * batch, seq_len), generator=gen)
    return DataLoader(_Tokens(ids), batch_size=batch, shuffle=False, drop_last=True)


def plain_loop(args, loader) -> list[float]:
    model = build_model(args.recipe, args.seq_len, args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    device = torch.device(args.device)
    times, last = [], time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        opt.zero_grad(set_to_none=True)
        with autocast(args.precision, device):
            loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        loss.item()  # a real loop looks at its loss
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


class StepTimer(Callback):
    """Wall time between consecutive batch ends: the whole cost of a step, hooks included."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.last = 0.0

    def on_fit_start(self) -> None:
        self.last = time.perf_counter()

    def on_batch_end(self) -> None:
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now


def smalti_loop(args, loader) -> tuple[list[float], float]:
    model = build_model(args.recipe, args.seq_len, args.device)
    timer = StepTimer()
    Trainer(model, loader, f"{args.steps}ba", optimizers=functools.partial(torch.optim.AdamW, lr=1e-4),
            callbacks={"timer": timer}, eval_interval=None, precision=args.precision, device=args.device).fit()
    flops = model.flops_per_batch(next(iter(loader)))
    return timer.times, flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="gpt_tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--peak-tflops", type=float, default=None, help="per-device peak (default 989 on CUDA)")
    args = parser.parse_args()
    vocab = build_model(args.recipe, args.seq_len, "meta").vocab_size
    loader = make_loader(args.steps, args.batch, args.seq_len, vocab)
    plain, ours, flops = [], [], 0.0
    for _ in range(args.rounds):
        plain += plain_loop(args, loader)[args.warmup:]
        times, flops = smalti_loop(args, loader)
        ours += times[args.warmup:]
    p, s = statistics.median(plain), statistics.median(ours)
    tokens = args.batch * args.seq_len
    print(f"recipe={args.recipe} device={args.device} precision={args.precision} batch={args.batch} "
          f"seq_len={args.seq_len} steps={args.steps}x{args.rounds} threads={torch.get_num_threads()}")
    print(f"plain PyTorch loop: {p * 1e3:8.2f} ms/step  {tokens / p:10.0f} tokens/s")
    print(f"smalti Trainer    : {s * 1e3:8.2f} ms/step  {tokens / s:10.0f} tokens/s")
    peak = args.peak_tflops or (989.0 if args.device.startswith("cuda") else None)
    if peak:
        print(f"MFU (LLM Foundry formula, peak {peak} TFLOPS): {flops / s / (peak * 1e12) * 100:.2f}%")
    else:
        print(f"model FLOPs/s (LLM Foundry formula): {flops / s / 1e9:.2f} GFLOP/s")
    print(f"ratio smalti / plain: {s / p:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
