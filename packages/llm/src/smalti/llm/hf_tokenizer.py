"""The tokenizer of a Hugging Face model folder, read without ``transformers``.

:meth:`HFTokenizer.from_folder` reads ``tokenizer.json`` with ``tokenizers``, the named special tokens
(``bos_token``, ``eos_token``, ``pad_token``, ...) from ``tokenizer_config.json`` (or ``special_tokens_map.json``),
and the chat template from ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template`` (the
``default`` one when it lists several), which is the order ``transformers`` uses. The chat template is rendered in
a sandbox as ``transformers`` renders it (see :mod:`smalti.llm.chat_template`), so
``apply_chat_template`` gives the same string and, tokenized, the same ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from smalti.llm.chat_template import ChatTemplate, Message, overlap_mask
from smalti.llm.errors import TokenizerError
from smalti.llm.tokenizer_api import Tokenizer

NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatEncoding(NamedTuple):
    """Token ids of a rendered conversation and, per token, whether it is assistant output."""

    ids: list[int]
    assistant_mask: list[bool]


def _token_text(value: Any) -> str | None:
    """A named token from a config: a string, or an ``AddedToken`` written as a dict with ``content``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path} cannot be read as JSON ({exc}); write it again with save_pretrained") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} holds {type(data).__name__}, expected a JSON object")
    return data


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json`` with its named special tokens and chat template (see the module doc).

    ``encode`` adds no special tokens unless ``add_special_tokens=True`` (then the ``tokenizer.json``
    post-processor adds them, e.g. a BOS); ``pad_id`` is the EOS id when the folder names no pad token;
    ``bos_id`` is ``None`` when it names no BOS token.
    """

    def __init__(self, tokenizer_file: str | os.PathLike, special_tokens: Mapping[str, str] | None = None,
                 chat_template: str | None = None, name: str | None = None,
                 template_origin: str | None = None) -> None:
        from tokenizers import Tokenizer as _Backend

        self.path = Path(tokenizer_file)
        try:
            self._tok = _Backend.from_file(str(self.path))
        except Exception as exc:
            raise TokenizerError(f"{self.path} is not a valid tokenizer.json ({exc})") from exc
        self.name = name or str(self.path.parent)
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = {key: self._token_id(key) for key in self.special_tokens}
        if ids.get("eos_token") is None:
            raise TokenizerError(
                f"{self.name}: no eos_token is named (tokenizer_config.json key 'eos_token'); smalti needs it to end "
                "sequences and assistant turns: add it to tokenizer_config.json"
            )
        self.eos_id: int = ids["eos_token"]
        self.bos_id: int | None = ids.get("bos_token")
        self.unk_id: int | None = ids.get("unk_token")
        pad = ids.get("pad_token")
        self.pad_id: int = pad if pad is not None else self.eos_id
        self.chat_template = (ChatTemplate(chat_template, template_origin or f"{self.name} chat_template")
                              if chat_template else None)

    def _token_id(self, key: str) -> int | None:
        text = self.special_tokens[key]
        token_id = self._tok.token_to_id(text)
        if token_id is None:
            raise TokenizerError(f"{self.name}: {key} {text!r} is not in the vocabulary of {self.path}")
        return token_id

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> HFTokenizer:
        """Load the tokenizer of a model folder written by ``save_pretrained`` (never a Hub name)."""
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise TokenizerError(
                f"{str(path)!r} is not a local folder; smalti never downloads from the Hugging Face Hub: save the "
                "model and tokenizer with save_pretrained (or huggingface-cli download) and give that folder"
            )
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"tokenizer folder {folder} has no tokenizer.json (expected {tokenizer_file}); smalti reads fast "
                "tokenizers only: convert a SentencePiece tokenizer.model with transformers' "
                "AutoTokenizer.from_pretrained(folder).save_pretrained(folder)"
            )
        config_file = folder / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        map_file = folder / "special_tokens_map.json"
        fallback = _read_json(map_file) if map_file.is_file() else {}
        special = {}
        for key in NAMED_TOKENS:
            text = _token_text(config.get(key)) if key in config else _token_text(fallback.get(key))
            if text is not None:
                special[key] = text
        template, origin = _chat_template(folder, config)
        return cls(tokenizer_file, special, template, name=str(folder), template_origin=origin)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (BOS etc.) as HF's default does."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Token ids of each text."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (special tokens dropped unless ``skip_special_tokens=False``)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, or ``None``."""
        return self._tok.token_to_id(token)

    def _template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.name} has no chat template (neither chat_template.jinja nor tokenizer_config.json's "
                "'chat_template'); add one, or use prompt/response data with this tokenizer"
            )
        return self.chat_template

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                            tokenize: bool = False, **variables: Any) -> str | list[int]:
        """Render ``messages`` with the chat template (the string ``transformers`` renders); with
        ``tokenize=True`` its ids, encoded without added special tokens as ``transformers`` does."""
        text = self._template().render(messages, add_generation_prompt, {**self.special_tokens, **variables})
        return self.encode(text) if tokenize else text

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                    **variables: Any) -> ChatEncoding:
        """Ids of the rendered conversation and its assistant mask: a token is assistant output when its
        characters overlap an assistant span of :meth:`ChatTemplate.assistant_spans` (that module's doc
        states the rule)."""
        text, spans = self._template().assistant_spans(messages, add_generation_prompt,
                                                       {**self.special_tokens, **variables})
        enc = self._tok.encode(text, add_special_tokens=False)
        return ChatEncoding(enc.ids, overlap_mask(enc.offsets, spans))


def _chat_template(folder: Path, config: Mapping[str, Any]) -> tuple[str | None, str]:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    origin = f"{folder / 'tokenizer_config.json'} chat_template"
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if "default" not in named:
            raise TokenizerError(f"{origin} lists templates {sorted(map(str, named))} but none named 'default'")
        return named["default"], f"{origin} (default)"
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{origin} is {type(template).__name__}, expected a Jinja string")
    return template, origin

