"""smalti-llm's exceptions; each names the file, key or value at fault and how to fix it."""

from __future__ import annotations

from smalti.core.errors import ConfigError, SmaltiError


class LLMError(SmaltiError):
    """Base of every error smalti-llm raises on purpose."""


class ModelConfigError(LLMError, ConfigError):
    """A model option is invalid (head counts that do not divide, an unknown norm or FFN type, ...)."""


class TokenizerError(LLMError, ConfigError):
    """A tokenizer name or path cannot be resolved, or a tokenizer file is invalid."""


class DataError(LLMError, ConfigError):
    """Input data is missing, malformed or too short for the requested sequence length."""


class ICLError(LLMError, ConfigError):
    """An in-context-learning task file or task definition is malformed."""


class ConversionError(LLMError):
    """A model cannot be converted to or from the Hugging Face layout."""


class LoRAError(LLMError, ConfigError):
    """A LoRA/QLoRA setting, adapter folder or checkpoint does not fit the model it is applied to."""
