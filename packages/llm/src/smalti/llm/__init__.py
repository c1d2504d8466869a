"""smalti-llm: decoder-only language models (MPT and Llama families), offline tokenizers, data preparation
to MDS, pretraining and finetuning recipes, in-context-learning evaluation and Hugging Face interop.

Names are imported lazily so that loading the entry point (``smalti.llm.plugin``) stays cheap.
"""

from __future__ import annotations

from smalti.core.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "smalti.llm.model.transformer",
    "LLMConfig": "smalti.llm.model.config",
    "load_tokenizer": "smalti.llm.tokenizer",
    "ByteTokenizer": "smalti.llm.tokenizer",
    "TokenizedText": "smalti.llm.data.text",
    "MarkovTokens": "smalti.llm.data.synthetic",
    "FinetuneDataset": "smalti.llm.data.finetune",
    "ICLEval": "smalti.llm.icl.callback",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
