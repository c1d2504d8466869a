"""Where the ``hf_export`` callback lived before :mod:`smalti.llm.hf`: run configs saved with
``_target_: smalti.llm.hf_export.HFExport`` still resolve."""

from smalti.llm.hf.callback import HFExport

__all__ = ["HFExport"]
