"""Compile every Triton kernel of smalti-moe ahead of time for real GPU targets, without a GPU.

``python -m smalti.moe.aot [--target sm_80,sm_90] [--dtype bf16,fp16,fp32]`` prints one Markdown table
row per kernel, launch configuration, target and dtype: registers per thread, spilled bytes, shared
memory and a verdict. It exits 1 when a configuration fails to compile, needs more shared memory than
the target gives one block, or spills registers.

Which configurations: the kernels are not listed by hand. The real layer (GLU with each activation and
MLP, forward and backward), ``ops.grouped_mm`` and the expert-parallel row copies run on the CPU at the
DBRX-like shapes (``model=moe_dbrx_like`` of smalti-llm) with every kernel launch intercepted; each
launch is specialised the way Triton's launcher does it (an int equal to 1 becomes a constant, ints and
pointers divisible by 16 are marked so) and an autotuned kernel expands into every config of its list,
since the autotuner may pick any of them. The counts of rows (tokens, entries) change from batch to batch;
they are compiled at their divisible-by-16 specialisation, the usual case for ``batch * seq_len`` tokens.
A ``@triton.jit`` kernel that no scenario launches is itself reported as a failure.

Registers and spills come from ``ptxas -v`` (the ptxas that ships with Triton), shared memory from
Triton's metadata. Limits per block (the opt-in maximum): 232448 bytes on sm_90, 166912 on sm_80.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from smalti.moe.errors import MoEError

#: Shared memory one block may use (``cudaDevAttrMaxSharedMemoryPerBlockOptin``) per target.
TARGETS: dict[str, tuple[int, int]] = {"sm_80": (80, 166912), "sm_90": (90, 232448)}
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: smalti-llm's ``model=moe_dbrx_like`` (d_model 256, expert ffn 448, 16 experts, top-4, GLU/silu) at a
#: micro batch of 2 sequences of its max_seq_len 256.
DBRX_LIKE: dict[str, int] = {"hidden_size": 256, "ffn_hidden_size": 448, "num_experts": 16, "top_k": 4,
                             "tokens": 2 * 256}

_TORCH_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                torch.int32: "i32", torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                torch.bool: "i1"}


@dataclass(frozen=True)
class Case:
    """One compilation: a kernel with its specialised signature, constants and launch options."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    divisible: tuple[int, ...]
    num_warps: int
    num_stages: int

    @property
    def dtype(self) -> str:
        """The floating-point type of the first float pointer argument, ``-`` for integer-only kernels."""
        for _, ty in self.signature:
            if ty.startswith("*f") or ty.startswith("*bf"):
                return ty[1:]
        return "-"

    def describe(self) -> str:
        """Constants and launch options in one short string (``BLOCK_N=128 A_GATHER w8 s3``)."""
        parts = []
        for name, value in self.constexprs:
            if isinstance(value, bool):
                if value:
                    parts.append(name)
            else:
                parts.append(f"{name}={value}")
        return " ".join(parts + [f"w{self.num_warps}", f"s{self.num_stages}"])

    def weight(self) -> int:
        """Tile volume times pipeline stages: the heaviest case of a kernel is the likeliest to run out."""
        volume = 1
        for name, value in self.constexprs:
            if name.startswith("BLOCK") and isinstance(value, int):
                volume *= value
        return volume * self.num_stages


@dataclass
class Row:
    """The result of compiling one :class:`Case` for one target."""

    target: str
    case: Case
    sites: tuple[str, ...]
    regs: int | None = None
    spill: int | None = None
    shared: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def verdict(self) -> str:
        return "ok" if self.ok else "FAIL: " + "; ".join(self.problems)


# ----------------------------------------------------------------------------------------------- recording


@dataclass
class _Launch:
    kernel: str
    case: Case
    configs: list[tuple[dict[str, Any], int, int]]
    site: str


def _kernel_module():
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise MoEError("smalti.moe.aot compiles for GPUs; unset TRITON_INTERPRET=1 (the interpreter changes the "
                       "kernels' block sizes and autotune lists)")
    try:
        from smalti.moe import triton_kernels
    except ImportError as exc:
        raise MoEError(f"smalti.moe.aot needs Triton ({exc}); pip install 'smalti-moe[triton]'") from exc
    return triton_kernels


def kernels() -> dict[str, Any]:
    """Every launchable ``@triton.jit`` kernel of smalti-moe by name (device helpers called by others left out)."""
    import triton

    module = _kernel_module()
    found = {name: obj for name, obj in vars(module).items()
             if isinstance(obj, (triton.runtime.JITFunction, triton.runtime.Autotuner))}
    sources = {name: _jit(obj).src for name, obj in found.items()}
    helpers = {name for name in found if any(re.search(rf"\b{name}\(", src) for other, src in sources.items()
                                             if other != name)}
    return {name: obj for name, obj in found.items() if name not in helpers}


def _jit(obj: Any) -> Any:
    """The ``JITFunction`` under an autotuner (or the kernel itself)."""
    import triton

    while isinstance(obj, triton.runtime.Autotuner):
        obj = obj.fn
    return obj


def _specialise(jit_fn: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[dict, dict, list[int]]:
    """Signature, constants and divisible argument indices as Triton's launcher would derive them."""
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    divisible: list[int] = []
    values = dict(zip(jit_fn.arg_names, args)) | kwargs
    for param in jit_fn.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            if name in values:
                constexprs[name] = values[name]
            continue
        value = values[name]
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TORCH_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0 and not param.do_not_specialize_on_alignment:
                divisible.append(param.num)
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:
                signature[name] = "constexpr"
                constexprs[name] = 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize and not param.do_not_specialize_on_alignment:
                divisible.append(param.num)
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise MoEError(f"kernel {jit_fn.__name__}: cannot specialise argument {name}={value!r}")
    return signature, constexprs, divisible


class _Recorder:
    """Stands in for a kernel object: ``kernel[grid](*args)`` records the launch instead of running it."""

    def __init__(self, name: str, kernel: Any, sink: list[_Launch], phase: list[str]) -> None:
        self.name, self.kernel, self.sink, self.phase = name, kernel, sink, phase

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kwargs: Any) -> None:
            jit_fn = _jit(self.kernel)
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            signature, constexprs, divisible = _specialise(jit_fn, args, kwargs)
            configs = ([(dict(c.kwargs), c.num_warps, c.num_stages) for c in _candidates(self.kernel, args, kwargs)]
                       if hasattr(self.kernel, "configs")
                       else [({}, options.get("num_warps", 4), options.get("num_stages", 3))])
            case = Case(self.name, tuple(signature.items()), tuple(sorted(constexprs.items())), tuple(divisible), 0, 0)
            self.sink.append(_Launch(self.name, case, configs, f"{_caller()} {self.phase[0]}"))

        return launch


def _candidates(autotuner: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The autotune configs the autotuner would time for this launch (after its ``early_config_prune``)."""
    prune = getattr(autotuner, "early_config_prune", None)
    if prune is None:
        return list(autotuner.configs)
    return list(prune(autotuner.configs, dict(zip(_jit(autotuner).arg_names, args)), **kwargs))


def _caller() -> str:
    """The public wrapper of :mod:`smalti.moe.triton_kernels` that is launching (``gather_mm``, ...)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "smalti.moe.triton_kernels" and not frame.f_code.co_name.startswith("_"):
            return frame.f_code.co_name
        frame = frame.f_back
    return "?"


@contextlib.contextmanager
def _recording(sink: list[_Launch], phase: list[str]) -> Iterator[None]:
    from smalti.moe import ops

    module = _kernel_module()
    saved = {name: getattr(module, name) for name in kernels()}
    saved_reason = ops.triton_unavailable_reason
    try:
        for name, kernel in saved.items():
            setattr(module, name, _Recorder(name, kernel, sink, phase))
        ops.triton_unavailable_reason = lambda device=None: None  # the layer may take the triton path on the CPU
        yield
    finally:
        for name, kernel in saved.items():
            setattr(module, name, kernel)
        ops.triton_unavailable_reason = saved_reason


def record(dtype: torch.dtype, shapes: dict[str, int] | None = None) -> list[_Launch]:
    """Every kernel launch made by the layer (GLU x silu/gelu/relu and MLP; forward and backward),
    ``ops.grouped_mm`` and the expert-parallel row gather/scatter at ``shapes`` (default :data:`DBRX_LIKE`).
    """
    from smalti.moe import MoE, ops

    s = dict(DBRX_LIKE, **(shapes or {}))
    d, f, e, k, t = s["hidden_size"], s["ffn_hidden_size"], s["num_experts"], s["top_k"], s["tokens"]
    sink: list[_Launch] = []
    phase = ["fwd"]
    gen = torch.Generator().manual_seed(0)

    def fwd_bwd(run) -> None:
        phase[0] = "fwd"
        out = run()
        phase[0] = "bwd"
        out.float().sum().backward()

    with _recording(sink, phase):
        for mlp_type, activation in (("glu", "silu"), ("glu", "gelu"), ("glu", "relu"), ("mlp", "silu")):
            layer = MoE(hidden_size=d, ffn_hidden_size=f, num_experts=e, top_k=k, mlp_type=mlp_type,
                        activation=activation, backend="triton", dtype=dtype)
            x = torch.randn(t, d, generator=gen).to(dtype).requires_grad_()
            fwd_bwd(lambda layer=layer, x=x: layer(x)[0])
        a = torch.randn(t * k, d, generator=gen).to(dtype).requires_grad_()
        w = torch.randn(e, d, f, generator=gen).to(dtype).requires_grad_()
        ids = torch.randint(0, e, (t, k), generator=gen)
        perm, _, offsets = ops.sort_by_expert(ids, e, "torch")
        fwd_bwd(lambda: ops.grouped_mm(a, w, offsets, "triton"))
        x = torch.randn(t, d, generator=gen).to(dtype).requires_grad_()
        gates = torch.rand(t, k, generator=gen).to(dtype).requires_grad_()
        fwd_bwd(lambda: ops.scatter_rows(ops.gather_rows(x, perm, k, "triton") * 2, perm, gates, k, "triton"))
    return sink


# ----------------------------------------------------------------------------------------------- cases


def _parse_config(spec: str) -> tuple[str, dict[str, Any]]:
    """``KERNEL:NAME=VALUE,...`` (``num_warps``/``num_stages`` allowed) into ``(kernel, values)``."""
    kernel, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise MoEError(f"--config {spec!r}: expected KERNEL:NAME=VALUE[,NAME=VALUE...], "
                       "e.g. _grouped_mm_kernel:BLOCK_N=256,BLOCK_K=128,num_warps=8,num_stages=5")
    values: dict[str, Any] = {}
    for item in rest.split(","):
        name, eq, value = item.partition("=")
        if not eq:
            raise MoEError(f"--config {spec!r}: {item!r} is not NAME=VALUE")
        values[name.strip()] = int(value)
    return kernel, values


def expand(launches: Sequence[_Launch], extra: Sequence[tuple[str, dict[str, Any]]] = ()
           ) -> dict[Case, list[str]]:
    """Distinct cases (each autotune config of each launch, plus ``extra`` configs) and the sites using them."""
    cases: dict[Case, list[str]] = {}
    for launch in launches:
        configs = list(launch.configs)
        for kernel, values in extra:
            if kernel == launch.kernel:
                base = dict(configs[0][0])
                base.update({k: v for k, v in values.items() if k not in ("num_warps", "num_stages")})
                configs.append((base, values.get("num_warps", configs[0][1]), values.get("num_stages", configs[0][2])))
        for consts, warps, stages in configs:
            merged = dict(launch.case.constexprs) | consts
            case = Case(launch.kernel, launch.case.signature, tuple(sorted(merged.items())), launch.case.divisible,
                        warps, stages)
            sites = cases.setdefault(case, [])
            if launch.site not in sites:
                sites.append(launch.site)
    return cases


# ----------------------------------------------------------------------------------------------- compiling

_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_usage(ptx: str, arch: int) -> str:
    """``ptxas -v`` on the PTX, with the ptxas and flags Triton itself uses for ``arch``."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as fh:
            fh.write(ptx)
        cmd = [get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(arch)}",
               src, "-o", os.path.join(tmp, "k.cubin")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return done.stdout + done.stderr


def compile_case(case: Case, target: str) -> tuple[int | None, int | None, int | None, str | None]:
    """Compile ``case`` for ``target``: ``(registers, spilled bytes, shared bytes, error)``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    arch = TARGETS[target][0]
    jit_fn = _jit(getattr(_kernel_module(), case.kernel))
    src = ASTSource(fn=jit_fn, signature=dict(case.signature), constexprs=dict(case.constexprs),
                    attrs={(i,): [["tt.divisibility", 16]] for i in case.divisible})
    log = io.StringIO()
    try:
        # Triton prints ptxas' -v log when asked; captured here so a fresh compile needs no second ptxas run.
        with contextlib.redirect_stdout(log):
            triton.knobs.nvidia.dump_ptxas_log = True
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": case.num_warps, "num_stages": case.num_stages})
    except Exception as exc:  # noqa: BLE001 - any compiler failure is a verdict, not a crash
        first = str(exc).strip().splitlines()
        return None, None, None, f"compile error: {type(exc).__name__}: {first[-1] if first else ''}"[:200]
    usage = log.getvalue()
    if not _REGS.search(usage):  # served from Triton's cache: no ptxas ran
        usage = _ptxas_usage(compiled.asm["ptx"], arch)
    regs = _REGS.search(usage)
    spill = _SPILL.search(usage)
    return (int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else 0, int(compiled.metadata.shared),
            None)


def _judge(row: Row, result: tuple[int | None, int | None, int | None, str | None]) -> Row:
    row.regs, row.spill, row.shared, error = result
    limit = TARGETS[row.target][1]
    if error:
        row.problems.append(error)
    else:
        if row.shared is not None and row.shared > limit:
            row.problems.append(f"shared memory {row.shared} > {limit} B")
        if row.spill:
            row.problems.append(f"spills {row.spill} B (DBRX-like launch)")
        if row.regs is None:
            row.problems.append("no register count in the ptxas log")
    return row


def _compile_job(job: tuple[Case, str]):
    case, target = job
    return compile_case(case, target)


def run(targets: Sequence[str], dtypes: Sequence[str], kernel_names: Sequence[str] = (), sample: bool = False,
        extra: Sequence[tuple[str, dict[str, Any]]] = (), jobs: int = 1) -> list[Row]:
    """Record, expand and compile; one :class:`Row` per case and target."""
    for t in targets:
        if t not in TARGETS:
            raise MoEError(f"--target {t!r}: supported targets are {', '.join(TARGETS)}")
    for d in dtypes:
        if d not in DTYPES:
            raise MoEError(f"--dtype {d!r}: supported dtypes are {', '.join(DTYPES)}")
    available = kernels()
    for name in kernel_names:
        if name not in available:
            raise MoEError(f"--kernel {name!r} is not a kernel of smalti-moe; kernels: {', '.join(sorted(available))}")
    for name, _ in extra:
        if name not in available:
            raise MoEError(f"--config names {name!r}, not a kernel of smalti-moe; kernels: {', '.join(sorted(available))}")
    launches = [launch for d in dtypes for launch in record(DTYPES[d])]
    cases = expand(launches, extra)
    wanted = set(kernel_names) or set(available)
    rows: list[Row] = []
    for name in sorted(wanted - {launch.kernel for launch in launches}):
        for target in targets:
            rows.append(Row(target, Case(name, (), (), (), 0, 0), (), problems=["never launched by the aot scenarios"]))
    selected = [(case, sites) for case, sites in cases.items() if case.kernel in wanted]
    if sample:  # the heaviest case per kernel and dtype
        best: dict[tuple[str, str], tuple[Case, list[str]]] = {}
        for case, sites in selected:
            key = (case.kernel, case.dtype)
            if key not in best or case.weight() > best[key][0].weight():
                best[key] = (case, sites)
        selected = list(best.values())
    jobs_list = [(case, target) for target in targets for case, _ in selected]
    sites_of = {case: tuple(sites) for case, sites in selected}
    if jobs > 1 and len(jobs_list) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(_compile_job, jobs_list))
    else:
        results = [_compile_job(job) for job in jobs_list]
    rows += [_judge(Row(target, case, sites_of[case]), result) for (case, target), result in zip(jobs_list, results)]
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """A Markdown table, one line per row."""
    head = "| target | dtype | kernel | launched by | config | regs | spill B | shared B | verdict |"
    lines = [head, "|" + "---|" * 9]
    for r in sorted(rows, key=lambda r: (r.target, r.case.dtype, r.case.kernel, r.case.describe())):
        cells = [r.target, r.case.dtype, r.case.kernel, ", ".join(r.sites), r.case.describe(),
                 _num(r.regs), _num(r.spill), _num(r.shared), r.verdict()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _num(v: int | None) -> str:
    return "-" if v is None else str(v)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status (0 when every configuration passes)."""
    parser = argparse.ArgumentParser(prog="python -m smalti.moe.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="sm_80,sm_90", help=f"comma list of {', '.join(TARGETS)}")
    parser.add_argument("--dtype", default="bf16,fp16,fp32", help=f"comma list of {', '.join(DTYPES)}")
    parser.add_argument("--kernel", default="", help="comma list of kernel names (default: all)")
    parser.add_argument("--sample", action="store_true",
                        help="only the heaviest configuration (tile volume x stages) of each kernel and dtype")
    parser.add_argument("--config", action="append", default=[], metavar="KERNEL:NAME=VALUE,...",
                        help="also compile this configuration of KERNEL at each of its launches (repeatable)")
    parser.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)),
                        help="compiler processes (default: up to 4)")
    args = parser.parse_args(argv)
    split = lambda s: [p.strip() for p in s.split(",") if p.strip()]  # noqa: E731
    try:
        rows = run(split(args.target), split(args.dtype), split(args.kernel), args.sample,
                   [_parse_config(c) for c in args.config], args.jobs)
    except MoEError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows)} configurations compiled, {len(failed)} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
