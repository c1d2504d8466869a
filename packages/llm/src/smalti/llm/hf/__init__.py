"""Hugging Face interop: one importer and one exporter that know no family by name, and one small module per
family (:mod:`smalti.llm.hf.families`) found through :mod:`smalti.llm.hf.registry`, which other distributions
extend by the ``smalti.llm.hf_families`` entry-point group.

* :class:`PretrainedLLM` (``model=hf``) and :func:`import_hf` read a local ``save_pretrained`` folder;
* :func:`export_hf`, :func:`export_model` (collective under FSDP2), :func:`export_checkpoint` and the
  :class:`HFExport` callback (``callbacks=hf_export``) write one that ``transformers`` loads offline.

Names are imported lazily, so that importing a family module does not pull in the exporter.
"""

from __future__ import annotations

from smalti.core.lazy import lazy_exports

_EXPORTS = {
    "PretrainedLLM": "smalti.llm.hf.importer",
    "import_hf": "smalti.llm.hf.importer",
    "load_hf_weights": "smalti.llm.hf.importer",
    "export_hf": "smalti.llm.hf.exporter",
    "export_model": "smalti.llm.hf.exporter",
    "export_checkpoint": "smalti.llm.hf.checkpoint_export",
    "hf_config": "smalti.llm.hf.exporter",
    "HFExport": "smalti.llm.hf.callback",
    "find_hf_export": "smalti.llm.hf.callback",
    "Family": "smalti.llm.hf.family",
    "Part": "smalti.llm.hf.family",
    "register": "smalti.llm.hf.registry",
    "families": "smalti.llm.hf.registry",
    "family_of": "smalti.llm.hf.registry",
    "resolve_folder": "smalti.llm.hf.folder",
    "read_config": "smalti.llm.hf.folder",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
