"""What one callback or algorithm costs per step: the time spent inside its own hooks, over the step time.

``bench/trainer_overhead.py --callbacks NAME`` compares whole steps against a bare loop; on a loaded machine its
ratio moves by more than a light monitor costs. This bench times only the plugin's hook methods (each wrapped
with ``perf_counter``) during a run of the same ~10 ms MLP step, and prints per plugin: the mean time in its
hooks per step, the same on the steps where it does its work (its interval) and between them, and that over
the median step time measured in the same run.

    python bench/callback_cost.py [--steps 100] [--width 768] optimizer_monitor loss_spike ...
    python bench/callback_cost.py --set algorithms.sam.interval=2 --set algorithms.swa.swa_start=0ba sam swa

``--set KEY=VALUE`` overrides the composed config (Hydra syntax) for every name. The steps where a plugin does its
work are every ``_every`` batches (its interval, read from the plugin after the run); an algorithm whose work is a
second forward and backward (``sam``) counts it as its own time.

Last line per plugin: ``callback_cost: NAME between_ratio X.XXXX all_ratio X.XXXX``.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_overhead import Net, extra_plugins, make_loader  # noqa: E402

from smalti.core import Callback, Trainer  # noqa: E402


class StepClock(Callback):
    """Wall time of each step, batch end to batch end."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = None

    def on_batch_end(self) -> None:
        now = time.perf_counter()
        if self._t is not None:
            self.times.append(now - self._t)
        self._t = now


#: Hooks that fire after the timestamp counted the step: their time belongs to the step before.
AFTER_STEP = ("on_batch_end", "on_batch_checkpoint", "on_eval", "should_", "on_epoch_end", "on_epoch_checkpoint",
              "on_fit_end")


#: Methods outside the hooks where a plugin does its work, timed as well: forward hooks' bodies, for one.
EXTRA_METHODS = {"activation_monitor": ("_moments",)}


def _hook_specname(method: Any) -> str | None:
    """The hook a method implements: its marker's ``specname``, else its own name when it looks like a hook."""
    opts = getattr(method, "smalti_impl", None)
    if isinstance(opts, dict):
        return opts.get("specname") or method.__name__
    return method.__name__ if method.__name__.startswith(("on_", "should_")) else None


def instrument(plugin: Any, per_step: dict[int, float], clock: Any, extra: tuple[str, ...] = ()) -> None:
    """Wrap every hook method of ``plugin`` (and the ``extra`` methods) so that its time adds to ``per_step[i]``,
    ``i`` the 0-based step. A hook wrapper (a generator around the other plugins' hooks) is timed before and
    after its ``yield`` only."""
    for name in dir(type(plugin)):
        method = getattr(plugin, name, None)
        if not callable(method) or name.startswith("__"):
            continue
        spec = name if name in extra else _hook_specname(method)
        if spec is None:
            continue
        after = spec.startswith(AFTER_STEP)

        def charge(t0: float, __after: bool = after) -> None:
            step = clock() - (1 if __after else 0)
            per_step[step] = per_step.get(step, 0.0) + time.perf_counter() - t0

        if (getattr(method, "smalti_impl", None) or {}).get("wrapper"):

            @functools.wraps(method)
            def timed_wrapper(_self: Any, *args: Any, __m=method, __charge=charge, **kw: Any) -> Any:
                t0 = time.perf_counter()
                gen = __m(*args, **kw)
                next(gen)
                __charge(t0)
                result = yield
                t0 = time.perf_counter()
                try:
                    gen.send(result)
                except StopIteration as stop:
                    return stop.value
                finally:
                    __charge(t0)

            setattr(plugin, name, types.MethodType(timed_wrapper, plugin))
            continue

        @functools.wraps(method)  # pluggy reads the hook's arguments through __wrapped__
        def timed(_self: Any, *args: Any, __m=method, __charge=charge, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return __m(*args, **kw)
            finally:
                __charge(t0)

        setattr(plugin, name, types.MethodType(timed, plugin))


def build_plugins(name: str, overrides: list[str]) -> dict[str, Any]:
    """The option ``name`` of the ``callbacks`` or ``algorithms`` group, built from config with ``overrides``."""
    if not overrides:
        return extra_plugins([name])
    from hydra import compose, initialize_config_module

    from smalti.core.config.build import build_group
    from smalti.core.config.schema import register_configs

    register_configs()
    with initialize_config_module("smalti.core.conf", version_base="1.3"):
        for group in ("callbacks", "algorithms"):
            mine = [o for o in overrides if o.startswith(f"{group}.{name}.")]
            try:
                cfg = compose("train", overrides=[f"{group}=[{name}]", *mine])
            except Exception:  # noqa: BLE001 - not an option of this group: try the next one
                continue
            return build_group(cfg[group], group)
    raise SystemExit(f"{name!r} is neither a callbacks nor an algorithms config option")


def measure(name: str, args: argparse.Namespace) -> None:
    plugins = build_plugins(name, args.set)
    ((plug_name, plugin),) = plugins.items()
    per_step: dict[int, float] = {}
    holder: dict[str, Any] = {}
    if hasattr(plugin, "path") and name == "goodput":  # its records go to a scratch file, not ./outputs
        plugin.path = Path(tempfile.mkdtemp(prefix="callback_cost_")) / "goodput.jsonl"
    instrument(plugin, per_step, lambda: holder["state"].timestamp.batch if "state" in holder else -1,
               EXTRA_METHODS.get(name, ()))
    clock = StepClock()
    torch.manual_seed(0)
    loader = make_loader(args.steps, 32, args.width)
    trainer = Trainer(Net(args.width), loader, f"{args.steps}ba",
                      optimizers=lambda p: torch.optim.AdamW(p, lr=1e-4),
                      callbacks={plug_name: plugin, "clock": clock}, eval_interval=None)
    holder["state"] = trainer.state
    try:
        trainer.fit()
    finally:
        if name == "goodput":
            shutil.rmtree(plugin.path.parent, ignore_errors=True)
    step = statistics.median(clock.times)
    spent = [per_step.get(i, 0.0) for i in range(args.steps)]
    every = getattr(plugin, "_every", None)
    between = [s for i, s in enumerate(spent) if not every or (i + 1) % every]
    at = [s for i, s in enumerate(spent) if every and (i + 1) % every == 0]
    mean_all = sum(spent) / len(spent)
    mean_between = sum(between) / max(1, len(between))
    print(f"{name}: median step {step * 1e3:.2f} ms; in its hooks per step {mean_all * 1e6:.1f} us "
          f"(between intervals {mean_between * 1e6:.1f} us"
          + (f", at its interval {sum(at) / len(at) * 1e6:.1f} us" if at else "")
          + f"; median over those steps {statistics.median(between or spent) * 1e6:.1f} us)")
    print(f"callback_cost: {name} between_ratio {mean_between / step:.4f} all_ratio {mean_all / step:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. algorithms.sam.interval=2 (repeatable)")
    args = parser.parse_args()
    for name in args.names:
        measure(name, args)


if __name__ == "__main__":
    main()
