"""The decoder-only transformer and its layers; :class:`LLMConfig` holds every option of :class:`LLM`.

``LLM`` is imported lazily, so that config checks can read :class:`LLMConfig` without loading torch.
"""

from smalti.core.lazy import lazy_exports
from smalti.llm.model.config import LLMConfig

_EXPORTS = {"LLM": "smalti.llm.model.transformer"}

__all__ = ["LLM", "LLMConfig"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
