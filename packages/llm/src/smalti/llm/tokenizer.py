"""Tokenizers without a model hub: a byte-level BPE trained offline with ``tokenizers`` (one ships in the
package), a pure byte-level fallback, or any local ``tokenizer.json``.

:func:`load_tokenizer` resolves a name or path: ``"smalti-bpe-2k"`` (the shipped file, also ``"default"``),
``"byte"``, a ``tokenizer.json`` path, or a folder holding one; a Hugging Face model folder (one with
``tokenizer_config.json``) gives an :class:`~smalti.llm.hf_tokenizer.HFTokenizer` with its special tokens and
chat template.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path

from smalti.llm.errors import TokenizerError
from smalti.llm.tokenizer_api import Tokenizer

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)
SHIPPED = {"smalti-bpe-2k": "smalti-bpe-2k.json"}
DEFAULT_TOKENIZER = "smalti-bpe-2k"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens 0..255, then ``<|endoftext|>`` (256) and ``<|pad|>`` (257). Needs no file."""

    name = "byte"
    vocab_size = 258
    eos_id = 256
    pad_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class BPETokenizer(Tokenizer):
    """A ``tokenizers`` JSON file (byte-level BPE or any other model it describes)."""

    def __init__(self, path: str | os.PathLike, name: str | None = None) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        self.path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as exc:
            raise TokenizerError(f"{self.path} is not a valid tokenizer.json ({exc}); train one with "
                                 "`smalti-llm tokenizer train`") from exc
        self.name = name or str(self.path)
        self.vocab_size = self._tok.get_vocab_size()
        eos = self._tok.token_to_id(EOS_TOKEN)
        if eos is None:
            raise TokenizerError(f"{self.path} has no {EOS_TOKEN!r} token; add it as a special token")
        self.eos_id = eos
        pad = self._tok.token_to_id(PAD_TOKEN)
        self.pad_id = pad if pad is not None else eos

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def shipped_tokenizer_path(name: str = DEFAULT_TOKENIZER) -> Path:
    """Path of a tokenizer shipped in ``smalti/llm/assets``."""
    return Path(str(resources.files("smalti.llm") / "assets" / SHIPPED[name]))


def load_tokenizer(name_or_path: str | os.PathLike | Tokenizer | None = None) -> Tokenizer:
    """Resolve a tokenizer: ``default``/``smalti-bpe-2k``, ``byte``, a ``tokenizer.json`` or a folder with one
    (a Hugging Face folder, with ``tokenizer_config.json``, loads as :class:`~smalti.llm.hf_tokenizer.HFTokenizer`).

    Hub names are never looked up: anything else is an error that says what is accepted.
    """
    if isinstance(name_or_path, Tokenizer):
        return name_or_path
    name = str(name_or_path) if name_or_path is not None else DEFAULT_TOKENIZER
    if name == "default":
        name = DEFAULT_TOKENIZER
    if name == "byte":
        return ByteTokenizer()
    if name in SHIPPED:
        return BPETokenizer(shipped_tokenizer_path(name), name=name)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "tokenizer_config.json").is_file():
        from smalti.llm.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_folder(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        return BPETokenizer(path)
    if looks_like_hub_name(name):
        raise TokenizerError(
            f"tokenizer {name!r} looks like a Hugging Face Hub name: smalti only reads local folders written by "
            f"save_pretrained and never downloads. Download it once, e.g. `huggingface-cli download {name} "
            f"--local-dir ./models/{Path(name).name}`, and pass that folder (model.pretrained for model=hf)"
        )
    raise TokenizerError(
        f"tokenizer {name!r} is neither a shipped tokenizer ({', '.join(SHIPPED)}), 'byte', nor a local "
        "tokenizer.json file or folder; smalti never downloads tokenizers: train one with "
        "`smalti-llm tokenizer train --input corpus.txt --output tokenizer.json`"
    )


def looks_like_hub_name(text: str) -> bool:
    """Whether ``text`` reads as ``<org>/<name>`` on the Hub rather than as a local path."""
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and not Path(text).parent.is_dir()


def _iter_text(files: Iterable[str | os.PathLike], chunk_chars: int = 1 << 16) -> Iterator[str]:
    from smalti.llm.data.sources import iter_documents

    for doc in iter_documents(files):
        for start in range(0, len(doc), chunk_chars):
            yield doc[start : start + chunk_chars]


def train_bpe(
    files: Iterable[str | os.PathLike],
    output: str | os.PathLike,
    vocab_size: int = 2048,
    min_frequency: int = 2,
    special_tokens: Iterable[str] = SPECIAL_TOKENS,
) -> BPETokenizer:
    """Train a byte-level BPE on text/JSONL/Parquet ``files`` and write it to ``output`` (atomically)."""
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    files = [str(f) for f in files]
    if not files:
        raise TokenizerError("tokenizer training needs at least one input file (--input)")
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_iter_text(files), trainer=trainer)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    os.close(fd)
    try:
        tok.save(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("trained a %d-token byte-level BPE on %d file(s) -> %s", tok.get_vocab_size(), len(files), output)
    return BPETokenizer(output)
