"""Small Hugging Face tokenizer folders for tests, built offline in milliseconds.

:func:`write_chat_tokenizer` trains a byte-level BPE on a seeded built-in corpus with ``tokenizers`` and writes
``tokenizer.json``, ``tokenizer_config.json`` (special tokens and a ``chat_template``) and
``special_tokens_map.json``, the files ``transformers.AutoTokenizer.from_pretrained(folder)`` reads. Three styles
mirror the chat formats of the common model families (the templates are smalti's own, written in the same shape:
role headers, BOS handling, an end-of-turn token after every assistant turn, ``add_generation_prompt``):

* ``llama3``: ``<|begin_of_text|>`` (BOS, also added by the post-processor), ``<|start_header_id|>role
  <|end_header_id|>`` headers, ``<|eot_id|>`` ends every turn and is the EOS; no pad or unk token.
* ``mistral``: ``<s>`` BOS (added by the post-processor), ``[INST] ... [/INST]`` user turns, the system message
  in front of the first user message, assistant turns end with ``</s>`` (EOS); ``<unk>``; no pad token.
* ``chatml`` (Qwen2): ``<|im_start|>role\\n ... <|im_end|>\\n``, a default system message when none is given,
  ``<|im_end|>`` is the EOS and ``<|endoftext|>`` the pad token; no BOS.

Nothing is downloaded; ``transformers`` is not needed to write the files.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

DEFAULT_VOCAB_SIZE = 512

LLAMA3_TEMPLATE = r"""{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
    {%- set turns = messages %}
{%- endif %}
{{- bos_token }}
{%- if system_message %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' + system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in turns %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('llama3 chat template: role ' + message['role'] + ' must be user or assistant') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

MISTRAL_TEMPLATE = r"""{%- if messages and messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set turns = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in turns %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('mistral chat template: after an optional system message, roles must alternate user/assistant/user/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- else %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

CHATML_TEMPLATE = r"""{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# style -> (special tokens in id order, named tokens, BOS added by the post-processor, chat template)
STYLES: dict[str, dict[str, Any]] = {
    "llama3": {
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                     "<|eot_id|>"],
        "named": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "template": LLAMA3_TEMPLATE,
    },
    "mistral": {
        "specials": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        "named": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        "template": MISTRAL_TEMPLATE,
    },
    "chatml": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "named": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "template": CHATML_TEMPLATE,
    },
}

_WORDS = {
    "who": ["The miller", "A young sailor", "The old clockmaker", "My sister", "The weaver", "The ferryman",
            "A travelling painter", "The night watchman", "You", "The assistant", "The user"],
    "verb": ["carried", "painted", "mended", "found", "sold", "counted", "remembered", "asked", "answered",
             "explained", "wrote", "helped with"],
    "what": ["a basket of pears", "seven copper coins", "a letter from the north", "the tiles of the chapel",
             "a silver thimble", "a blue lantern", "the broken wheel", "the smallest boat", "a short question",
             "the right answer", "three numbers", "a helpful reply"],
    "where": ["by the river", "in the market", "under the bridge", "at the harbour", "near the gate",
              "on the hill", "in the conversation", "at the end of the turn"],
}


def _corpus(n: int = 600, seed: int = 5) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(_WORDS[k]) for k in ("who", "verb", "what", "where")]
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ". Thank you.", ", please."]))
        lines.append(f"What is {rng.randint(0, 99)} plus {rng.randint(0, 99)}? It is {rng.randint(0, 198)}.")
    return lines


def write_chat_tokenizer(folder: str | os.PathLike, style: str, vocab_size: int | None = None) -> None:
    """Write a ``style`` chat tokenizer (``llama3``, ``mistral`` or ``chatml``) into ``folder``.

    The vocabulary holds exactly ``vocab_size`` tokens (default 512): the style's special tokens first, then
    the 256 byte-level symbols and BPE merges, then ``<|reserved_special_token_N|>`` padding if the corpus
    gives fewer merges. The same arguments always write the same files.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if style not in STYLES:
        raise ValueError(f"style={style!r}: choose one of {', '.join(STYLES)}")
    spec = STYLES[style]
    size = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
    minimum = len(spec["specials"]) + 256
    if size < minimum:
        raise ValueError(f"vocab_size={size} is below {minimum} (the {style} special tokens and 256 byte symbols)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size, min_frequency=2, special_tokens=[AddedToken(t, special=True, normalized=False)
                                                          for t in spec["specials"]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    missing = size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([AddedToken(f"<|reserved_special_token_{i}|>", special=True, normalized=False)
                                for i in range(missing)])
    bos = spec["named"].get("bos_token")
    if bos is not None:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for t in tok.get_vocab(with_added_tokens=True)
        if t in spec["specials"] or t.startswith("<|reserved_special_token_")
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": dict(sorted(added.items(), key=lambda kv: int(kv[0]))),
        **spec["named"],
        "chat_template": spec["template"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(json.dumps(spec["named"], indent=2) + "\n", encoding="utf-8")
