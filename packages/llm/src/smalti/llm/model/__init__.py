"""The decoder-only transformer and its layers."""

from smalti.llm.model.transformer import LLM

__all__ = ["LLM"]
