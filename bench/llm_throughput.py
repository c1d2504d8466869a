"""Tokens/s and MFU of a smalti-llm recipe's model, and the smalti Trainer's cost over a plain PyTorch loop.

Builds the model of ``--recipe`` (a ``conf/model`` option of smalti-llm, e.g. gpt_tiny or mpt_1b) and trains it
on random tokens of ``--seq-len`` with (a) a plain PyTorch loop and (b) ``smalti.core.Trainer``, alternating
rounds so both see the same machine noise. Both sides do the same work: the same model, AdamW, autocast and,
with ``--fsdp``, FSDP2 ``fully_shard`` per block with the same mixed-precision policy (the plain loop calls
``fully_shard`` itself; smalti goes through its ``fsdp`` parallelism plugin).

Prints the median step time of each, tokens/s per device, MFU by LLM Foundry's formula
(``model.flops_per_batch`` of this rank's batch / step time / per-device peak; peak from ``--peak-tflops``,
default 989 for H100 bf16 on CUDA) and the ratio ``smalti / plain`` (goal on CPU: <= 1.05).

    python bench/llm_throughput.py [--recipe gpt_tiny] [--batch 16] [--seq-len 128] [--steps 40] [--rounds 3]

The H100 measurement (a 1B model at sequence 2048 in bf16 with FSDP; LLM Foundry publishes 41.82% MFU for
its 1B on H100):

    torchrun --nproc-per-node 1 bench/llm_throughput.py --recipe mpt_1b --fsdp --precision amp_bf16 \\
        --param-dtype bfloat16 --seq-len 2048 --batch 8 --steps 20 --rounds 2

(``python bench/llm_throughput.py --fsdp ...`` without torchrun starts a one-rank process group itself.)
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import socket
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

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, None: None}


class _Tokens(TensorDataset):
    def __getitem__(self, i):
        return {"input_ids": self.tensors[0][i]}


def build_model(recipe: str, seq_len: int, device: str, activation_checkpointing: str | None = None):
    cfg = OmegaConf.load(Path(str(resources.files("smalti.llm") / "conf" / "model" / f"{recipe}.yaml")))
    cfg.max_seq_len = max(seq_len, cfg.max_seq_len)
    cfg.init_device = device
    if activation_checkpointing:
        cfg.activation_checkpointing = activation_checkpointing
    torch.manual_seed(0)
    return instantiate(cfg)


def make_loader(steps: int, batch: int, seq_len: int, vocab: int) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (steps * batch, seq_len), generator=gen)
    return DataLoader(_Tokens(ids), batch_size=batch, shuffle=False, drop_last=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _mp_policy(args):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=_DTYPES[args.param_dtype], reduce_dtype=_DTYPES[args.reduce_dtype])


def plain_loop(args, loader, device: torch.device) -> list[float]:
    """A hand-written loop: what a user would write without smalti (FSDP2 applied by hand with ``--fsdp``)."""
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        model = build_model(args.recipe, args.seq_len, "meta", args.activation_checkpointing)
        for block in model.fsdp_blocks():
            fully_shard(block, mp_policy=_mp_policy(args))
        fully_shard(model, mp_policy=_mp_policy(args))
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights()
    else:
        model = build_model(args.recipe, args.seq_len, str(device), args.activation_checkpointing)
    if args.compile:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times: list[float] = []
    _sync(device)
    last = time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        opt.zero_grad(set_to_none=True)
        with autocast(args.precision, device):
            loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        loss.item()  # a real loop looks at its loss (and this waits for the device)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    del model, opt
    _release(device)
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


def smalti_loop(args, loader, device: torch.device) -> tuple[list[float], float]:
    parallelism = None
    if args.fsdp:
        from smalti.core.parallelism import FSDP

        parallelism = FSDP(param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype)
    model = build_model(args.recipe, args.seq_len, "meta" if args.fsdp else str(device), args.activation_checkpointing)
    timer = StepTimer()
    Trainer(model, loader, f"{args.steps}ba", optimizers=functools.partial(torch.optim.AdamW, lr=1e-4),
            callbacks={"timer": timer}, eval_interval=None, precision=args.precision, device=device,
            parallelism=parallelism, compile=args.compile).fit()
    flops = model.flops_per_batch(next(iter(loader)))
    del model
    _release(device)
    return timer.times, flops


def _start_process_group(device: torch.device) -> None:
    """One process group for ``--fsdp``: torchrun's, or a one-rank one on a free local port."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="gpt_tiny")
    parser.add_argument("--batch", type=int, default=16, help="samples per device per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="fp32", help="fp32, amp_bf16 or amp_fp16")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 per block on both sides (one rank without torchrun)")
    parser.add_argument("--param-dtype", default=None, choices=["bfloat16", "float32"], help="FSDP2 param dtype")
    parser.add_argument("--reduce-dtype", default=None, choices=["bfloat16", "float32"], help="FSDP2 reduce dtype")
    parser.add_argument("--activation-checkpointing", default=None, help="block, attention or ffn (all layers)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model on both sides")
    parser.add_argument("--peak-tflops", type=float, default=None, help="per-device peak (default 989 on CUDA)")
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if args.fsdp:
        _start_process_group(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    rank = int(os.environ.get("RANK", "0"))
    vocab = build_model(args.recipe, args.seq_len, "meta").vocab_size
    loader = make_loader(args.steps, args.batch, args.seq_len, vocab)
    plain, ours, flops = [], [], 0.0
    for _ in range(args.rounds):
        plain += plain_loop(args, loader, device)[args.warmup:]
        times, flops = smalti_loop(args, loader, device)
        ours += times[args.warmup:]
    p, s = statistics.median(plain), statistics.median(ours)
    tokens = args.batch * args.seq_len
    if rank == 0:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu threads={torch.get_num_threads()}"
        print(f"recipe={args.recipe} device={name} world={world} fsdp={args.fsdp} precision={args.precision} "
              f"param_dtype={args.param_dtype} batch/device={args.batch} seq_len={args.seq_len} "
              f"steps={args.steps}x{args.rounds} (first {args.warmup} of each round not timed) compile={args.compile}")
        print(f"plain PyTorch loop: {p * 1e3:9.2f} ms/step  {tokens / p:10.0f} tokens/s/device")
        print(f"smalti Trainer    : {s * 1e3:9.2f} ms/step  {tokens / s:10.0f} tokens/s/device")
        peak = args.peak_tflops or (989.0 if device.type == "cuda" else None)
        if peak:
            print(f"MFU (LLM Foundry formula, peak {peak} TFLOPS/device): smalti {flops / s / (peak * 1e12) * 100:.2f}%"
                  f"  plain {flops / p / (peak * 1e12) * 100:.2f}%")
        else:
            print(f"model FLOPs/s (LLM Foundry formula): {flops / s / 1e9:.2f} GFLOP/s")
        print(f"ratio smalti / plain: {s / p:.3f} (goal <= 1.05)")
    if args.fsdp:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
