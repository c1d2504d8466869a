"""Where a training step's memory goes, smalti against transformers: RSS at each phase of each step.

A profiling aid for bench/llm_vs_hf.py (issue 34), not a ratio bench. One side per process, on the same seeded
Llama folder and batches as llm_vs_hf.py (``make_folder``), fused AdamW on both sides. After each phase (forward
and loss, backward, optimizer step) it prints the process's RSS and the peak RSS within that phase (Linux:
``/proc/self/clear_refs`` resets the peak), with the phase's CPU seconds. After each backward of smalti's side it
also prints the bytes of live tensors (parameters, gradients, optimizer state and anything else reachable), so
RSS minus live tensors minus the process's start-up RSS is what the C allocator holds but no tensor uses.

    OMP_NUM_THREADS=1 python bench/llm_memory_phases.py hf     [--shape llama1b_like] [--layers 8] [--steps 3]
    OMP_NUM_THREADS=1 python bench/llm_memory_phases.py smalti [--precision fp32|amp_bf16] [--optimizer-in-backward]

``--optimizer-in-backward`` runs smalti with ``Trainer(optimizer_in_backward=True)``: the AdamW steps then run
inside the backward phase (its peak includes them) and no gradient is alive after it.

Set ``MALLOC_MMAP_THRESHOLD_=1048576`` to see how much of the peak is the allocator's (glibc) retained memory.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm_vs_hf import SHAPES, _adamw, make_folder  # noqa: E402


def _status_mb() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


def live_tensor_mb() -> float:
    """Bytes of every distinct tensor storage reachable from Python (gradients included), in MB."""
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # some objects warn when asked what they are
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if not torch.is_tensor(obj):
                continue
            for t in (obj, obj.grad) if obj.grad is not None else (obj,):
                # a row-sparse gradient (model.sparse_embedding_grad) holds its indices and values
                for part in (t._indices(), t._values()) if t.layout == torch.sparse_coo else (t,):
                    storage = part.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / 2**20


class Phases:
    """Marks phase ends: RSS now, the peak RSS since the last mark, and the CPU seconds the phase took."""

    def __init__(self, side: str) -> None:
        self.side = side
        self.cpu = time.process_time()

    def mark(self, name: str) -> None:
        mem, cpu = _status_mb(), time.process_time()
        print(f"{self.side:6s} {name:28s} rss {mem['VmRSS']:7.0f} MB  peak in phase {mem['VmHWM']:7.0f} MB  "
              f"cpu {cpu - self.cpu:7.2f} s", flush=True)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.cpu = time.process_time()


def run_hf(folder: Path, steps: int, precision: str, phases: Phases) -> None:
    from transformers import LlamaForCausalLM

    data = torch.load(folder / "tokens.pt")
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").train()
    opt = _adamw(model.parameters(), "fused")
    phases.mark("loaded")
    for step in range(steps):
        ids = data[step]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp_bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        phases.mark(f"{step} forward+loss")
        loss.backward()
        phases.mark(f"{step} backward")
        opt.step()
        phases.mark(f"{step} optimizer step")
        opt.zero_grad(set_to_none=True)


def run_smalti(folder: Path, steps: int, precision: str, phases: Phases, in_backward: bool = False) -> None:
    from smalti.core import Callback, Trainer
    from smalti.llm.hf import import_hf

    data = torch.load(folder / "tokens.pt")
    model = import_hf(folder, max_seq_len=data.shape[-1])
    phases.mark("imported")

    def marker(event: str) -> Callable[..., None]:
        def hook(self: Callback, state, *args, **kwargs) -> None:
            phases.mark(f"{int(state.timestamp.batch)} {event.removeprefix('on_')}")
            if event == "on_after_backward":
                print(f"{'':6s} live tensors {live_tensor_mb():7.0f} MB", flush=True)

        return hook

    events = ("on_after_forward", "on_after_backward", "on_after_optimizer_step")
    marks = type("Marks", (Callback,), {event: marker(event) for event in events})()
    trainer = Trainer(model, [{"input_ids": data[i]} for i in range(steps)], f"{steps}ba", eval_interval=None,
                      precision=precision, callbacks={"marks": marks}, optimizers=lambda p: _adamw(p, "fused"),
                      optimizer_in_backward=in_backward)
    phases.mark("trainer built")
    trainer.fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("side", choices=("hf", "smalti"))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama1b_like")
    parser.add_argument("--layers", type=int, default=None, help="replace the shape's layer count")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", choices=("fp32", "amp_bf16"), default="fp32")
    parser.add_argument("--folder", default=None, help="reuse (or write) the model folder here")
    parser.add_argument("--optimizer-in-backward", action="store_true",
                        help="smalti: step each parameter inside backward (Trainer(optimizer_in_backward=True))")
    args = parser.parse_args()
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["layers"] = args.layers
    folder = Path(args.folder or f"/tmp/smalti_llm_phases_{args.shape}_{shape['layers']}")
    if not (folder / "tokens.pt").exists():
        folder.mkdir(parents=True, exist_ok=True)
        make_folder(shape, args.steps, folder)
    phases = Phases(args.side)
    phases.mark("start")
    if args.side == "hf":
        if args.optimizer_in_backward:
            parser.error("--optimizer-in-backward is a smalti setting; transformers' Trainer has none")
        run_hf(folder, args.steps, args.precision, phases)
    else:
        run_smalti(folder, args.steps, args.precision, phases, args.optimizer_in_backward)


if __name__ == "__main__":
    main()
