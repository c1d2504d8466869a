"""smalti's LLM against transformers' LlamaForCausalLM, on transformers' best plain settings and the same precision.

For each shape it builds one Llama config (``--family qwen3`` or ``gemma3``: a Qwen3 or Gemma 3 text config of
the same shape, head_dim ``d_model / heads``; Gemma 3 with a 512-token sliding window on its local layers) with
``transformers`` (random init, seeded), saves it with
``save_pretrained`` to a temporary folder with random token data, and trains it for ``--steps`` steps with

  (a) ``transformers.AutoModelForCausalLM.from_pretrained(attn_implementation="sdpa")``, its own loss with
      ``labels=input_ids``, the forward and loss under bf16 autocast (what ``TrainingArguments(bf16=True)`` does),
      ``torch.optim.AdamW(fused=True)`` (``optim="adamw_torch_fused"``) and, whenever smalti checkpoints
      activations (``--ac``), ``gradient_checkpointing_enable()``;
  (b) ``smalti.llm.hf.import_hf`` of the same folder through ``smalti.core.Trainer`` with smalti's defaults
      (fused chunked linear + cross-entropy, ``precision=amp_bf16`` as ``experiment=finetune_hf``) and the same
      ``torch.optim.AdamW``.

Both sides run at the same precision (``--precision``, bf16 autocast by default) with the same AdamW
implementation (``--adamw``); each worker reports the autocast state its model's forward actually ran under and its
optimizer's implementation, and the bench refuses to print a ratio when they differ. ``--precision-bought fp32``
also runs transformers in fp32 and prints that ratio, labelled as bought by precision (never the headline).

Three shapes by default (``--shapes``):

  head_heavy    vocab 128256, d_model 512, 4 layers, ffn 1536, 8/2 heads, seq 2048, batch 2: about three quarters
                of the FLOPs in the LM head (the fused loss decides it)
  llama1b_like  vocab 128256, d_model 1024, 8 layers, ffn 4096, 16/4 heads, seq 1024, batch 1: Llama-3.2-1B's
                vocabulary and proportions scaled to this machine (the head costs about what the blocks cost)
  long          the head_heavy model at seq 8192, batch 1 (attention-heavy)

``--vocab --d-model --ffn --layers --heads --kv-heads --seq --batch`` replace them with one ``custom`` shape
(the head_heavy values for what is not given).

Each side runs in a fresh subprocess (its peak RSS is its own: ``ru_maxrss``; peak CUDA memory on a GPU), the
order alternating over ``--rounds``. Every step's wall and process CPU time is printed. The speed ratio of a shape is
the ratio of median process CPU time per step (on a shared machine wall time includes waiting for a core; CPU
time is the work done; the wall ratio is printed beside it), the memory ratio the ratio of peak RSS. Every run's
first-step loss must agree with transformers' to 1e-4 relative; ``--check-steps N`` compares N-step curves to 1e-3.
The last line is the worst speed and the worst memory ratio over the shapes:

    llm_vs_hf: worst speed X.XX worst memory X.XX (same precision)

``--optimizer-in-backward`` runs smalti's side with ``Trainer(optimizer_in_backward=True)`` (each parameter's
AdamW step inside backward, its gradient freed at once): a setting transformers' ``Trainer`` lacks, so every
ratio line and the last line say so (``... (same precision; smalti optimizer_in_backward, a setting
transformers' Trainer lacks)``). ``--libc-malloc`` makes smalti's Trainer leave glibc's allocator alone
(``cpu_malloc_mmap_threshold=None``; by default it fixes the mmap threshold at 1 MiB on CPU), to measure that setting.
``--cpu-gemm auto|openblas|torch`` is smalti's ``trainer.cpu_gemm`` (default ``auto``: its fp32 CPU matrix products
through numpy's OpenBLAS where torch's MKL is slower, as on AMD CPUs); every shape's ratio line names the backend
smalti used (transformers' side always multiplies with torch.mm).

    OMP_NUM_THREADS=2 python bench/llm_vs_hf.py [--shapes head_heavy,llama1b_like,long --steps 3 --rounds 1]
    Levers on smalti's side: --ac block|attention|ffn (transformers then checkpoints too), --no-fused-loss,
    --dense-embedding-grad, --compile, --optimizer-in-backward, --cpu-gemm torch; on both: --precision fp32|amp_bf16, --adamw fused|foreach|loop; --json PATH writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LR = 1e-4
BETAS = (0.9, 0.95)
PRECISIONS = ("fp32", "amp_bf16")
SHAPE_KEYS = ("vocab", "d_model", "ffn", "layers", "heads", "kv_heads", "seq", "batch")
SHAPES: dict[str, dict[str, int]] = {
    "head_heavy": dict(vocab=128256, d_model=512, ffn=1536, layers=4, heads=8, kv_heads=2, seq=2048, batch=2),
    "llama1b_like": dict(
        vocab=128256, d_model=1024, ffn=4096, layers=8, heads=16, kv_heads=4, seq=1024, batch=1
    ),
    "long": dict(vocab=128256, d_model=512, ffn=1536, layers=4, heads=8, kv_heads=2, seq=8192, batch=1),
}
ADAMW = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}


def _peak_memory_mb(device: torch.device) -> dict[str, float]:
    out = {"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        out["cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _adamw(params, name: str) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=1e-8, weight_decay=0.0, **ADAMW[name])


def _optimizer_impl(opt: torch.optim.Optimizer) -> str:
    """Which AdamW implementation ``opt`` runs, read from the optimizer itself."""
    if opt.defaults.get("fused"):
        return "fused"
    return "foreach" if opt.defaults.get("foreach") else "loop"


def _watch_autocast(model: torch.nn.Module, device: torch.device, seen: list[str]) -> None:
    """Record the autocast state each forward of ``model`` actually runs under (``bfloat16`` or ``off``)."""

    def hook(module, args) -> None:
        on = torch.is_autocast_enabled(device.type)
        seen.append(str(torch.get_autocast_dtype(device.type)).removeprefix("torch.") if on else "off")

    model.register_forward_pre_hook(hook)


def run_hf(folder: Path, steps: int, device: torch.device, args: argparse.Namespace, precision: str) -> dict:
    """transformers' training step at its best plain settings: SDPA, ``labels=input_ids``, fused AdamW, bf16
    autocast of forward and loss for ``amp_bf16``, gradient checkpointing when smalti checkpoints activations."""
    from transformers import AutoModelForCausalLM

    data = torch.load(folder / "tokens.pt")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(device).train()
    if args.ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = _adamw(model.parameters(), args.adamw)
    autocast: list[str] = []
    _watch_autocast(model, device, autocast)
    losses, times, cpu_times = [], [], []
    for step in range(steps):
        ids = data[step].to(device)
        _sync(device)
        start, cpu = time.perf_counter(), time.process_time()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "amp_bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
    return {
        "losses": losses,
        "times": times,
        "cpu_times": cpu_times,
        "autocast": sorted(set(autocast)),
        "optimizer": _optimizer_impl(opt),
        "attention": model.config._attn_implementation,
        "checkpointing": bool(model.is_gradient_checkpointing),
        **_peak_memory_mb(device),
    }


def run_smalti(
    folder: Path, steps: int, device: torch.device, args: argparse.Namespace, precision: str
) -> dict:
    """smalti's import of the same folder, trained by smalti's Trainer with its defaults."""
    from smalti.core import Callback, Trainer, cpu_gemm
    from smalti.core.cpu_malloc import DEFAULT_MMAP_THRESHOLD
    from smalti.llm.hf import import_hf

    data = torch.load(folder / "tokens.pt")

    class Record(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self.start = self.cpu = 0.0

        def on_batch_start(self, state) -> None:
            _sync(device)
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_batch_end(self, state) -> None:
            self.losses.append(float(state.batch_loss))  # waits for the step, as the loss.item() of (a)
            self.times.append(time.perf_counter() - self.start)
            self.cpu_times.append(time.process_time() - self.cpu)

    seq = data.shape[-1]
    model = import_hf(folder, max_seq_len=seq, activation_checkpointing=args.ac)
    model.fused_loss = not args.no_fused_loss
    model.sparse_embedding_grad = not args.dense_embedding_grad
    autocast: list[str] = []
    _watch_autocast(model, device, autocast)
    built: list[torch.optim.Optimizer] = []

    def make_optimizer(params):
        built.append(_adamw(params, args.adamw))
        return built[-1]

    record = Record()
    start = time.perf_counter()
    trainer = Trainer(
        model,
        [{"input_ids": data[i]} for i in range(steps)],
        f"{steps}ba",
        eval_interval=None,
        device=device,
        compile=args.compile,
        precision=precision,
        callbacks={"record": record},
        optimizers=make_optimizer,
        optimizer_in_backward=args.optimizer_in_backward,
        cpu_malloc_mmap_threshold=None if args.libc_malloc else DEFAULT_MMAP_THRESHOLD,
        cpu_gemm=args.cpu_gemm,
    )
    setup = time.perf_counter() - start
    trainer.fit()
    return {
        "losses": record.losses,
        "times": record.times,
        "cpu_times": record.cpu_times,
        "autocast": sorted(set(autocast)),
        "optimizer": _optimizer_impl(built[0]),
        "attention": "sdpa",
        "checkpointing": bool(args.ac),
        "setup_s": setup,
        "cpu_gemm": cpu_gemm.backend(),
        **_peak_memory_mb(device),
    }


# --family: transformers' config and model classes, and the fields that differ from a Llama of the same shape.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500000.0}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_theta": 1000000.0, "head_dim": None}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": None, "sliding_window": 512}),
}


def make_folder(shape: dict[str, int], steps: int, folder: Path, family: str = "llama") -> None:
    """A seeded random model of ``family`` (Llama by default) saved by transformers, and the token batches both
    sides train on."""
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    extra = {k: shape["d_model"] // shape["heads"] if k == "head_dim" else v for k, v in extra.items()}
    config = getattr(transformers, config_name)(
        **extra,
        vocab_size=shape["vocab"],
        hidden_size=shape["d_model"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["seq"],
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    getattr(transformers, model_name)(config).save_pretrained(folder)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab"], (steps, shape["batch"], shape["seq"]), generator=gen)
    torch.save(tokens, folder / "tokens.pt")


def _child(side: str, precision: str, folder: Path, steps: int, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        side,
        "--worker-precision",
        precision,
        "--folder",
        str(folder),
        "--steps",
        str(steps),
        "--device",
        args.device,
        "--adamw",
        args.adamw,
    ]
    cmd += (["--compile"] if args.compile else []) + (["--ac", args.ac] if args.ac else [])
    cmd += ["--no-fused-loss"] if args.no_fused_loss else []
    cmd += ["--dense-embedding-grad"] if args.dense_embedding_grad else []
    cmd += ["--optimizer-in-backward"] if args.optimizer_in_backward else []
    cmd += ["--libc-malloc"] if args.libc_malloc else []
    cmd += ["--cpu-gemm", args.cpu_gemm]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{side} {precision} worker failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _label(side: str, precision: str) -> str:
    return f"{side} {precision}"


def _shapes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, dict[str, int]]:
    given = {k: getattr(args, k) for k in SHAPE_KEYS if getattr(args, k) is not None}
    if given:
        return {"custom": {**SHAPES["head_heavy"], **given}}
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        parser.error(f"--shapes {args.shapes!r}: unknown {unknown}; pick from {', '.join(SHAPES)}")
    return {n: SHAPES[n] for n in names}


def _check_same_terms(runs: dict[tuple[str, str], list[dict]], pair: tuple[tuple[str, str], ...]) -> None:
    """Both sides of the headline pair ran under the same autocast and the same AdamW implementation."""
    (hf, sm) = (runs[c][0] for c in pair)
    for key in ("autocast", "optimizer", "checkpointing"):
        if hf[key] != sm[key]:
            raise SystemExit(f"unfair comparison: transformers ran {key}={hf[key]}, smalti {key}={sm[key]}")


def bench_shape(name: str, shape: dict[str, int], args: argparse.Namespace, device: torch.device) -> dict:
    """Train both sides on one shape over ``--rounds`` alternating rounds; print and return the ratios."""
    pair = (("hf", args.precision), ("smalti", args.precision))
    configs = list(pair)
    if args.precision_bought and args.precision_bought != args.precision:
        configs.append(("hf", args.precision_bought))
    steps = max(args.steps, args.check_steps or 0)
    print(f"== shape {name}: " + " ".join(f"{k}={v}" for k, v in shape.items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="llm_vs_hf.") as tmp:
        folder = Path(tmp)
        make_folder(shape, steps, folder, args.family)
        runs: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
        for r in range(args.rounds):
            for config in configs if r % 2 == 0 else configs[::-1]:
                res = _child(*config, folder, args.steps, args)
                runs[config].append(res)
                print(
                    f"round {r} {_label(*config):15s}: step times "
                    + " ".join(f"{t:.2f}" for t in res["times"])
                    + " s (CPU "
                    + " ".join(f"{t:.2f}" for t in res["cpu_times"])
                    + f" s); peak RSS "
                    f"{res['rss_mb']:.0f} MB; autocast {','.join(res['autocast'])}, AdamW {res['optimizer']}, "
                    f"attention {res['attention']}, checkpointing {res['checkpointing']}"
                    + (f"; setup {res['setup_s']:.1f} s" if "setup_s" in res else "")
                    + (f"; CPU GEMM {res['cpu_gemm']}" if "cpu_gemm" in res else ""),
                    flush=True,
                )
        _check_same_terms(runs, pair)
        ref = runs[pair[0]][0]["losses"][0]
        first: dict[str, float] = {}
        for config, results in runs.items():
            diff = max(abs(res["losses"][0] - ref) for res in results) / abs(ref)
            first[_label(*config)] = results[0]["losses"][0]
            print(
                f"first-step loss {_label(*config):15s}: {results[0]['losses'][0]:.6f} (relative to "
                f"{_label(*pair[0])} {diff:.2e}, limit 1e-4)"
            )
            if diff > 1e-4:
                raise SystemExit(f"{name}: first-step losses differ by {diff:.2e} relative (limit 1e-4)")
        if args.check_steps:
            hf_c = _child(*pair[0], folder, args.check_steps, args)["losses"]
            sm_c = _child(*pair[1], folder, args.check_steps, args)["losses"]
            worst = max(abs(a - b) / abs(a) for a, b in zip(hf_c, sm_c, strict=True))
            print(
                f"{args.check_steps}-step loss curves: hf {hf_c[0]:.4f} -> {hf_c[-1]:.4f}, smalti {sm_c[0]:.4f} "
                f"-> {sm_c[-1]:.4f}; worst relative difference {worst:.2e} (limit 1e-3)"
            )
            if worst > 1e-3:
                raise SystemExit("loss curves differ by more than 1e-3 relative")
    tokens = shape["batch"] * shape["seq"]
    med, cpu, mem = {}, {}, {}
    for config in configs:
        med[config] = statistics.median(t for res in runs[config] for t in res["times"][args.warmup :])
        cpu[config] = statistics.median(t for res in runs[config] for t in res["cpu_times"][args.warmup :])
        mem[config] = max(res["rss_mb"] for res in runs[config])
        print(
            f"{_label(*config):15s}: median step {med[config]:.2f} s ({tokens / med[config]:.0f} tokens/s), "
            f"median CPU {cpu[config]:.2f} s/step ({tokens / cpu[config]:.0f} tokens/CPU-s), "
            f"peak RSS {mem[config]:.0f} MB"
        )
    hf, sm = pair
    out = {
        "shape": name,
        "speed": cpu[hf] / cpu[sm],
        "wall_speed": med[hf] / med[sm],
        "memory": mem[sm] / mem[hf],
        "first_losses": first,
        "terms": {
            side: {k: runs[c][0][k] for k in ("autocast", "optimizer", "attention", "checkpointing")}
            for side, c in (("hf", hf), ("smalti", sm))
        },
        "cpu_gemm": runs[sm][0]["cpu_gemm"],
    }
    print(
        f"{name}: same precision ({args.precision}) speed smalti/hf {out['speed']:.2f} (CPU time; wall "
        f"{out['wall_speed']:.2f}), memory smalti/hf {out['memory']:.2f}{_bought_by_setting(args)}; "
        f"smalti CPU GEMM: {_gemm_label(out['cpu_gemm'])}"
    )
    if len(configs) > 2:
        bought = configs[2]
        out["bought"] = {
            "precision": bought[1],
            "speed": cpu[bought] / cpu[sm],
            "memory": mem[sm] / mem[bought],
        }
        print(
            f"{name}: bought by precision (smalti {args.precision} vs hf {bought[1]}, NOT the headline): speed "
            f"{out['bought']['speed']:.2f}, memory {out['bought']['memory']:.2f}"
        )
    return out


def _gemm_label(backend: str) -> str:
    """Which library did smalti's fp32 CPU matrix products, so a reader sees where a gain comes from."""
    if backend == "openblas":
        return "openblas (numpy's OpenBLAS; torch's MKL on this AMD CPU is slower)"
    return "torch (torch.mm, as transformers)"


def _bought_by_setting(args: argparse.Namespace) -> str:
    """The label of ratios bought by a smalti setting that transformers' Trainer lacks ('' when none is on)."""
    if not args.optimizer_in_backward:
        return ""
    return "; smalti optimizer_in_backward, a setting transformers' Trainer lacks"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    for key in SHAPE_KEYS:
        p.add_argument(
            f"--{key.replace('_', '-')}", type=int, default=None, help="a custom shape (see above)"
        )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="first steps of each run not timed")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--check-steps", type=int, default=0, help="compare N-step loss curves (1e-3 relative)")
    p.add_argument(
        "--compile", action="store_true", help="torch.compile smalti's blocks (Trainer(compile=True))"
    )
    p.add_argument("--adamw", choices=list(ADAMW), default="fused", help="both sides' AdamW implementation")
    p.add_argument(
        "--ac",
        default=None,
        help="smalti's activation_checkpointing (block, attention, ffn); "
        "transformers then runs gradient_checkpointing_enable()",
    )
    p.add_argument(
        "--no-fused-loss", action="store_true", help="smalti with the plain linear + cross-entropy"
    )
    p.add_argument(
        "--dense-embedding-grad", action="store_true",
        help="smalti's token embedding with a dense gradient (model.sparse_embedding_grad=false)",
    )
    p.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="smalti steps each parameter inside backward (Trainer(optimizer_in_backward=True)); transformers' "
        "Trainer has no such setting, and the ratios are labelled so",
    )
    p.add_argument("--precision", choices=PRECISIONS, default="amp_bf16", help="both sides' precision")
    p.add_argument(
        "--precision-bought",
        choices=PRECISIONS,
        default=None,
        help="also run transformers at this precision and print that ratio, labelled (not the headline)",
    )
    p.add_argument("--family", choices=list(FAMILIES), default="llama",
                   help="the transformers family both sides train (smalti imports it through smalti.llm.hf)")
    p.add_argument("--json", type=Path, default=None, help="write every shape's ratios and terms here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--libc-malloc", action="store_true",
        help="smalti's Trainer leaves glibc's allocator alone (trainer.cpu_malloc_mmap_threshold=null), "
        "to measure what its default mmap threshold changes",
    )
    p.add_argument(
        "--cpu-gemm", choices=["auto", "openblas", "torch"], default="auto",
        help="smalti's trainer.cpu_gemm (its fp32 CPU matrix products through numpy's OpenBLAS or torch.mm); "
        "transformers' side always uses torch.mm",
    )
    p.add_argument("--worker", choices=["hf", "smalti"], help=argparse.SUPPRESS)
    p.add_argument("--worker-precision", choices=PRECISIONS, default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    device = torch.device(args.device)
    if args.worker:
        run = run_hf if args.worker == "hf" else run_smalti
        print(json.dumps(run(args.folder, args.steps, device, args, args.worker_precision)))
        return
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    shapes = _shapes(args, p)
    import transformers

    baseline = (
        f"transformers {transformers.__version__}, precision {args.precision}"
        + (" (bf16 autocast of forward and loss)" if args.precision == "amp_bf16" else "")
        + f", optimizer torch.optim.AdamW({args.adamw}), attention sdpa, gradient checkpointing "
        + ("on (smalti --ac " + args.ac + ")" if args.ac else "off (smalti checkpoints nothing)")
    )
    print(
        f"{device.type} threads={os.environ.get('OMP_NUM_THREADS', torch.get_num_threads())} torch="
        f"{torch.__version__} steps={args.steps}x{args.rounds} (first {args.warmup} not timed); smalti: "
        f"compile={args.compile} activation_checkpointing={args.ac} fused_loss={not args.no_fused_loss} "
        f"sparse_embedding_grad={not args.dense_embedding_grad} cpu_gemm={args.cpu_gemm}"
        + (" optimizer_in_backward=True (a setting transformers' Trainer lacks)" if args.optimizer_in_backward else ""),
        flush=True,
    )
    print(f"baseline: {baseline}", flush=True)
    results = [bench_shape(name, shape, args, device) for name, shape in shapes.items()]
    worst_speed = min(r["speed"] for r in results)
    worst_memory = max(r["memory"] for r in results)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "baseline": baseline,
                    "precision": args.precision,
                    "shapes": results,
                    "worst_speed": worst_speed,
                    "worst_memory": worst_memory,
                    "smalti_optimizer_in_backward": args.optimizer_in_backward,
                },
                indent=1,
            )
        )
    print(f"baseline: {baseline}")
    print(
        f"llm_vs_hf: worst speed {worst_speed:.2f} worst memory {worst_memory:.2f} (same precision"
        f"{_bought_by_setting(args)})"
    )


if __name__ == "__main__":
    main()
