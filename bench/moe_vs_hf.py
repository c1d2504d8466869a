"""smalti's imported Mixtral (experts on smalti-moe's dropless grouped GEMMs) against transformers' own
``MixtralForCausalLM``, training on the same folder at the same precision.

transformers 5.24's ``MixtralExperts`` is decorated with ``use_experts_implementation``: by default
(``experts_implementation`` unset) ``from_pretrained`` picks ``"grouped_mm"`` (``grouped_mm_experts_forward``:
sort the (token, slot) pairs by expert, gather the rows, ``torch.nn.functional.grouped_mm`` for both projections,
which has a CPU kernel in torch >= 2.9), not the per-expert Python loop of the class's own ``forward``. That loop
is ``experts_implementation="eager"`` (``--hf-experts eager`` here). The baseline line names the one that ran.

The bench writes one random Mixtral-like model with ``transformers`` (``save_pretrained``, seeded) and random
token data, then trains it for ``--steps`` steps in a fresh subprocess per side, each with
``torch.optim.AdamW(fused=True)`` and its loss including the load-balancing term (``output_router_logits``):

  (a) ``transformers.AutoModelForCausalLM.from_pretrained(attn_implementation="sdpa")`` (plus
      ``experts_implementation`` when ``--hf-experts`` names one), loss with ``labels=input_ids``;
  (b) ``smalti.llm.hf.import_hf`` of the same folder, ``model.loss(model(batch), batch)`` (fused chunked loss).

Both run fp32 by default or under bf16 autocast (``--precision amp_bf16``). Each worker prints every step's wall
and process CPU time; the speed figure is the ratio of tokens per process-CPU second (median step), smalti over
transformers (on a shared machine wall time includes waiting for a core), the memory figure smalti's peak RSS
over transformers'. The first losses must agree to 1e-4 relative or no ratio is printed. The last line:

    moe_vs_hf: speed X.XX memory X.XX

Default shape (Mixtral's proportions scaled to a CPU): vocab 32000, d_model 512, 8 experts of width 1792, top 2,
4 layers, 8/2 heads, sequence 512, batch 4.

    OMP_NUM_THREADS=1 python bench/moe_vs_hf.py [--steps 4] [--precision fp32|amp_bf16]
                                                [--hf-experts default|grouped_mm|eager] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(vocab=32000, d_model=512, ffn=1792, experts=8, top_k=2, layers=4, heads=8, kv_heads=2, seq=512,
             batch=4)
LR = 1e-4


def write_model(folder: Path, s: dict[str, int]) -> None:
    """A random Mixtral of shape ``s`` written by transformers, and the token batch both sides train on."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=s["vocab"], hidden_size=s["d_model"], intermediate_size=s["ffn"], num_local_experts=s["experts"],
        num_experts_per_tok=s["top_k"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=max(s["seq"], 64), output_router_logits=True,
        router_aux_loss_coef=0.02, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(folder)
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=torch.Generator().manual_seed(1))
    torch.save(ids, folder / "ids.pt")


def _smalti_terms() -> tuple[str, str]:
    """What smalti's experts ran on (the kernels and their CPU product) and smalti-core's CPU GEMM backend."""
    from smalti.core import cpu_gemm
    from smalti.moe import ops

    product = "openblas (smalti.core.cpu_gemm.matmul_into)" if ops.get_cpu_matmul() is not None else "torch"
    return f"smalti-moe dropless grouped GEMMs (torch backend), expert products on {product}", cpu_gemm.backend()


def worker(side: str, folder: Path, steps: int, precision: str, hf_experts: str = "default") -> dict:
    """Train ``side`` for ``steps`` steps; returns per-step times, losses, peak RSS, the terms it ran on and
    (transformers) the experts implementation ``from_pretrained`` chose."""
    ids = torch.load(folder / "ids.pt")
    gemm = "torch"  # transformers runs torch's own products
    if side == "hf":
        import transformers

        chosen = {} if hf_experts == "default" else {"experts_implementation": hf_experts}
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa",
                                                                  **chosen).train()
        experts = f"experts_implementation={model.config._experts_implementation}"

        def loss_fn() -> torch.Tensor:
            return model(input_ids=ids, labels=ids).loss
    else:
        from smalti.llm.hf import import_hf

        model = import_hf(folder).train()
        batch = {"input_ids": ids}
        experts, gemm = _smalti_terms()

        def loss_fn() -> torch.Tensor:
            return model.loss(model(batch), batch)

    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    amp = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "amp_bf16" else contextlib.nullcontext)
    losses, cpu, wall = [], [], []
    for _ in range(steps):
        c0, w0 = time.process_time(), time.perf_counter()
        with amp():
            loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        losses.append(float(loss))
    return {"losses": losses, "cpu_s": cpu, "wall_s": wall, "tokens_per_step": ids.numel(),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "experts": experts,
            "cpu_gemm": gemm,
            "terms": {"precision": precision, "adamw": "fused" if opt.defaults.get("fused") else "other"}}


def _run_side(side: str, folder: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--folder", str(folder), "--steps", str(args.steps),
           "--precision", args.precision, "--hf-experts", args.hf_experts]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"moe_vs_hf: the {side} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for key, value in SHAPE.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--precision", choices=("fp32", "amp_bf16"), default="fp32")
    parser.add_argument("--hf-experts", choices=("default", "grouped_mm", "eager"), default="default",
                        help="transformers' experts_implementation (default: what from_pretrained picks, grouped_mm)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", choices=("hf", "smalti"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.folder, args.steps, args.precision, args.hf_experts)))
        return
    shape = {key: getattr(args, key) for key in SHAPE}
    with tempfile.TemporaryDirectory(prefix="moe_vs_hf-") as tmp:
        folder = Path(tmp)
        write_model(folder, shape)
        results = {side: _run_side(side, folder, args) for side in ("hf", "smalti")}
    for side, r in results.items():
        steps = " ".join(f"{c:.2f}/{w:.2f}" for c, w in zip(r["cpu_s"], r["wall_s"], strict=True))
        print(f"{side:7s} cpu/wall s per step: {steps}  losses {r['losses'][0]:.6f}..{r['losses'][-1]:.6f}  "
              f"peak RSS {r['peak_rss_mb']:.0f} MB  [{r['experts']}]")
    hf, sm = results["hf"], results["smalti"]
    if hf["terms"] != sm["terms"]:
        raise SystemExit(f"moe_vs_hf: the sides ran on different terms {hf['terms']} vs {sm['terms']}: no ratio")
    rel = abs(sm["losses"][0] - hf["losses"][0]) / abs(hf["losses"][0])
    tolerance = 1e-4 if args.precision == "fp32" else 1e-2
    if rel > tolerance:
        raise SystemExit(f"moe_vs_hf: first losses differ by {rel:.2e} relative (> {tolerance}): no ratio")
    # After the first step (allocation and first-touch costs), as both sides' later steps are what a run repeats.
    def per_step(r: dict) -> float:
        return statistics.median(r["cpu_s"][1:] or r["cpu_s"])

    speed = per_step(hf) / per_step(sm)
    memory = sm["peak_rss_mb"] / hf["peak_rss_mb"]
    tokens = sm["tokens_per_step"]
    print(f"tokens per CPU second: transformers {tokens / per_step(hf):.0f}, smalti {tokens / per_step(sm):.0f}; "
          f"first losses {hf['losses'][0]:.6f} / {sm['losses'][0]:.6f} ({rel:.1e} relative); shape {shape}, "
          f"{args.precision}, fused AdamW both; smalti's CPU GEMM backend: {sm['cpu_gemm']} "
          f"(transformers: torch's own)")
    if args.json:
        args.json.write_text(json.dumps({"shape": shape, "precision": args.precision, "results": results,
                                         "speed": speed, "memory": memory}, indent=2))
    print(f"moe_vs_hf: speed {speed:.2f} memory {memory:.2f}")


if __name__ == "__main__":
    main()
