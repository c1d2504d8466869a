"""FP8 training (``precision=fp8``): the model's linear layers compute in float8 through torchao's Float8Linear.

torchao (``pip install 'smalti-core[fp8]'``) casts each converted layer's input and weight to ``float8_e4m3fn``
and its output gradient to ``float8_e5m2`` with dynamic scales, and multiplies them with ``torch._scaled_mm``
(cuBLASLt on H100; a reference kernel on CPU, which is what the tests here run). Everything else runs under
bf16 autocast, as ``amp_bf16``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence
from typing import Any, Literal

import torch

from smalti.core.errors import ConfigError
from smalti.core.plugins import Algorithm

#: Scaling recipes: ``tensorwise`` (one scale per tensor; FSDP2 can all-gather the weights in float8) and
#: ``rowwise`` (one scale per row, more accurate for outliers; weights are all-gathered in bf16).
RECIPES = ("tensorwise", "rowwise")

#: Layers left in bf16 by default: the LM head (``lm_head``; ``head`` and ``output`` in other models), whose
#: logits feed the loss, and MoE routers (a few columns that decide which experts run).
DEFAULT_SKIP = ("lm_head", "head", "output", "*router*")


def _torchao_float8() -> Any:
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise ConfigError(
            "precision=amp_fp8 needs torchao's float8 training: pip install 'smalti-core[fp8]' "
            f"(import failed: {exc})"
        ) from None
    return float8


class Float8Training(Algorithm):
    """Converts every ``nn.Linear`` of the model to torchao's ``Float8Linear`` before it is wrapped for parallelism.

    ``recipe`` is one of :data:`RECIPES`. ``skip`` holds ``fnmatch`` patterns of module names kept in bf16
    (default :data:`DEFAULT_SKIP`); layers whose input or output width is not a multiple of 16 (what the FP8
    GEMM needs) stay too. ``fsdp_float8_all_gather`` (``tensorwise`` only) makes FSDP2 all-gather the weights
    in float8, half the bytes of bf16, with the scales computed for all layers at once after each optimizer
    step. The trainer adds this algorithm with its defaults when ``precision="amp_fp8"`` and none is given;
    the names of the converted layers are in :attr:`converted` and logged as ``fp8/layers``.
    """

    def __init__(self, recipe: Literal["tensorwise", "rowwise"] = "tensorwise", skip: Sequence[str] = DEFAULT_SKIP,
                 fsdp_float8_all_gather: bool = True) -> None:
        if recipe not in RECIPES:
            raise ConfigError(f"algorithms.float8.recipe={recipe!r} must be one of {', '.join(RECIPES)}")
        self.recipe = recipe
        self.skip = tuple(skip)
        self.fsdp_float8_all_gather = bool(fsdp_float8_all_gather) and recipe == "tensorwise"
        self.converted: list[str] = []
        self._precompute = False

    def keeps(self, name: str, module: torch.nn.Module) -> bool:
        """Whether ``module`` (named ``name`` in the model) stays in bf16."""
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.skip):
            return True
        return bool(module.in_features % 16 or module.out_features % 16)

    def layers_to_convert(self, model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
        """The linear layers of ``model`` this algorithm runs in float8, by name (the plan counts them too)."""
        return {name: m for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and not self.keeps(name, m)}

    def on_init(self, state: Any, logger: Any) -> None:
        if state.precision != "amp_fp8":
            raise ConfigError(
                f"algorithms.float8 needs trainer.precision=amp_fp8 (precision=fp8), not {state.precision!r}"
            )
        float8 = _torchao_float8()
        config = float8.Float8LinearConfig.from_recipe_name(self.recipe)
        if self.fsdp_float8_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        linears = sum(isinstance(m, torch.nn.Linear) for m in state.raw_model.modules())
        candidates = set(self.layers_to_convert(state.raw_model))

        def convert(module: torch.nn.Module, name: str) -> bool:
            return not isinstance(module, torch.nn.Linear) or name in candidates

        float8.convert_to_float8_training(state.raw_model, module_filter_fn=convert, config=config)
        self.converted = sorted(candidates)
        if not self.converted:
            raise ConfigError(
                f"precision=amp_fp8 found no linear layer to run in float8 (of {linears}, all matched "
                f"algorithms.float8.skip={list(self.skip)} or have a width that is not a multiple of 16)"
            )
        self._precompute = self.fsdp_float8_all_gather
        logger.log_hyperparameters({"fp8/recipe": self.recipe, "fp8/layers": len(self.converted),
                                    "fp8/bf16_linear_layers": linears - len(self.converted)})

    def on_after_optimizer_step(self, state: Any, logger: Any) -> None:
        # FSDP2's float8 all-gather casts each shard with one amax over the whole weight: torchao computes
        # those for all layers in one reduction, after the weights changed and before the next all-gather.
        if self._precompute and not state.skip_optimizer_step:
            from torch.distributed.fsdp import FSDPModule

            if isinstance(state.model, FSDPModule):
                _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(state.model)
