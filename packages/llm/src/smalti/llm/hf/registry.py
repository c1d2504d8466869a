"""Every Hugging Face family smalti knows: its own (one module each under :mod:`smalti.llm.hf.families`) and any
another distribution declares under the ``smalti.llm.hf_families`` entry-point group::

    [project.entry-points."smalti.llm.hf_families"]
    my_family = "my_package.my_module:FAMILY"   # a smalti.llm.hf.family.Family instance

The importer finds a folder's family by ``config.json``'s ``model_type``; the exporter finds a smalti model's
by asking each family in turn whether the model has its shape.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from smalti.llm.errors import ConversionError, ModelConfigError
from smalti.llm.hf.families.dbrx import FAMILY as DBRX
from smalti.llm.hf.families.gemma3 import FAMILY as GEMMA3
from smalti.llm.hf.families.llama import FAMILY as LLAMA
from smalti.llm.hf.families.mistral import FAMILY as MISTRAL
from smalti.llm.hf.families.mixtral import FAMILY as MIXTRAL
from smalti.llm.hf.families.mpt import GPT2_FAMILY, MPT_FAMILY
from smalti.llm.hf.families.olmoe import FAMILY as OLMOE
from smalti.llm.hf.families.qwen2 import FAMILY as QWEN2
from smalti.llm.hf.families.qwen2_moe import FAMILY as QWEN2_MOE
from smalti.llm.hf.families.qwen3 import FAMILY as QWEN3
from smalti.llm.hf.families.qwen3_moe import FAMILY as QWEN3_MOE
from smalti.llm.hf.family import Family
from smalti.llm.model.config import LLMConfig

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "smalti.llm.hf_families"
BUILTIN: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3, MIXTRAL, QWEN3_MOE, OLMOE, QWEN2_MOE, DBRX,
                               MPT_FAMILY, GPT2_FAMILY)

_registered: dict[str, Family] = {}
_loaded = False


def register(family: Family) -> None:
    """Make ``family`` known to the importer and exporter (replacing one of the same ``model_type``)."""
    if not isinstance(family, Family) or not family.model_type or not family.architecture:
        raise ConversionError(f"{family!r} is not a smalti.llm.hf.family.Family with model_type and architecture")
    _load_entry_points()
    _registered[family.model_type] = family


def _load_entry_points() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for family in BUILTIN:
        _registered[family.model_type] = family
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            family = ep.load()
        except Exception as exc:  # a broken plugin names itself and leaves the others working
            raise ConversionError(f"entry point {ep.name}={ep.value!r} ({ENTRY_POINT_GROUP}) failed to load: {exc}") from exc
        register(family)


def families() -> dict[str, Family]:
    """``model_type`` -> family, built-in ones first, then those of entry points."""
    _load_entry_points()
    return dict(_registered)


def family_for_config(cfg: dict[str, Any], path: Path) -> Family:
    """The family of a ``config.json`` (``cfg``, read from ``path``), or an error naming its ``model_type``."""
    known = families()
    model_type = cfg.get("model_type")
    if model_type not in known:
        names = ", ".join(f"{k} ({f.description})" if f.description else k for k, f in known.items())
        raise ConversionError(f"{path}: model_type={model_type!r} is not supported; smalti imports {names}")
    return known[model_type]


def llm_config(cfg: dict[str, Any], path: Path) -> LLMConfig:
    """The :class:`~smalti.llm.model.config.LLMConfig` of the ``config.json`` ``cfg`` at ``path``, by its
    family's mapping (:meth:`Family.llm_kwargs`); a field the family needs and the file lacks is named, and so
    is the file when its values do not make a valid model."""
    family = family_for_config(cfg, path)
    try:
        options = family.llm_kwargs(cfg, path)
    except KeyError as exc:
        raise ConversionError(f"{path}: {family.model_type} needs the field {exc.args[0]!r}, which is missing") from exc
    try:
        return LLMConfig.of(options)
    except ModelConfigError as exc:
        raise ConversionError(f"{path} ({family.model_type}): {exc}") from exc


def family_of(config: dict[str, Any]) -> Family:
    """The family a smalti model with ``config`` (``LLM.config``) exports as; an error says why none fits."""
    why = {}
    for family in families().values():
        problems = family.problems(config)
        if not problems:
            return family
        why[family.model_type] = problems
    details = "; ".join(f"{name}: {', '.join(p)}" for name, p in why.items())
    raise ConversionError(f"this model cannot be exported as a Hugging Face model ({details})")


def exportable(config: dict[str, Any]) -> bool:
    """Whether some family has the shape of a smalti model with ``config``."""
    try:
        family_of(config)
    except ConversionError:
        return False
    return True
