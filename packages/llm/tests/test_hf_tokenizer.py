"""HF tokenizer folders without transformers: chat templates render as transformers renders them, ids match,
the assistant mask covers exactly the assistant turns, and bad folders or templates fail clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from smalti.llm.errors import TokenizerError
from smalti.llm.hf_tokenizer import HFTokenizer
from smalti.llm.tokenizer import load_tokenizer
from smalti.testing.hf_tokenizers import write_chat_tokenizer

STYLES = ("llama3", "mistral", "chatml")
CHAT = [
    {"role": "system", "content": "You are terse. Answer in one line."},
    {"role": "user", "content": "Who carried the pears?"},
    {"role": "assistant", "content": "The miller, by the river."},
    {"role": "user", "content": "  And what did the weaver find?"},
    {"role": "assistant", "content": "A silver thimble — près du pont.  "},
    {"role": "user", "content": "What is 12 plus 30?"},
    {"role": "assistant", "content": "42"},
]
NO_SYSTEM = CHAT[1:5]
# The assistant text each style trains on: the content as the template writes it, and the end-of-turn token.
TURN_TEXT = {
    "llama3": lambda content: content.strip() + "<|eot_id|>",
    "mistral": lambda content: " " + content + "</s>",
    "chatml": lambda content: content + "<|im_end|>",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for style in STYLES:
        out[style] = tmp_path_factory.mktemp(style)
        write_chat_tokenizer(out[style], style)
    return out


def _hf(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _ids(value) -> list[int]:
    return list(value["input_ids"] if hasattr(value, "keys") else value)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("messages", [CHAT, NO_SYSTEM], ids=["system", "no-system"])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_chat_template_string_and_ids_equal_transformers(folders, style, messages, generation_prompt):
    ref, ours = _hf(folders[style]), HFTokenizer.from_folder(folders[style])
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
    expected_ids = _ids(ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt))
    assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True) == expected_ids
    assert ours.encode_chat(messages, add_generation_prompt=generation_prompt).ids == expected_ids


@pytest.mark.parametrize("style", STYLES)
def test_special_ids_encode_decode_equal_transformers(folders, style):
    ref, ours = _hf(folders[style]), load_tokenizer(folders[style])
    assert isinstance(ours, HFTokenizer)
    assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (ref.bos_token_id, ref.eos_token_id, len(ref))
    # no pad token named (llama3, mistral): pad with EOS
    assert ours.pad_id == (ref.pad_token_id if ref.pad_token_id is not None else ref.eos_token_id)
    text = "The ferryman sold a blue lantern at the harbour, près du pont."
    assert ours.encode(text, add_special_tokens=True) == ref(text).input_ids
    assert ours.encode(text) == ref(text, add_special_tokens=False).input_ids
    assert ours.decode(ours.encode(text)) == text


def _expected_mask(style: str, text: str, offsets, messages, turn_text=None) -> list[bool]:
    """Independent of the prefix rule: find each assistant turn's text (content and end-of-turn token, as the
    style writes it) in the rendered chat, in order, and mark the tokens whose characters overlap it."""
    spans, pos = [], 0
    for message in messages:
        if message["role"] != "assistant":
            continue
        turn = (turn_text or TURN_TEXT[style])(message["content"])
        start = text.index(turn, pos)
        spans.append((start, start + len(turn)))
        pos = start + len(turn)
    return [any(s < b and e > a for a, b in spans) for s, e in offsets]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("messages", [CHAT, NO_SYSTEM], ids=["system", "no-system"])
def test_assistant_mask_is_exactly_the_assistant_turns(folders, style, messages):
    ref, ours = _hf(folders[style]), HFTokenizer.from_folder(folders[style])
    text = ref.apply_chat_template(messages, tokenize=False)
    enc = ref(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, mask = ours.encode_chat(messages)
    assert ids == enc.input_ids
    assert mask == _expected_mask(style, text, enc.offset_mapping, messages)
    # token by token: the masked runs decode to the assistant turns, one run per turn
    runs, current = [], []
    for token, masked in zip(ids, mask, strict=True):
        if masked:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    turns = [TURN_TEXT[style](m["content"]) for m in messages if m["role"] == "assistant"]
    assert [ours.decode(r, skip_special_tokens=False) for r in runs] == turns


# The block starts inside the word "The" (one token), so that token straddles the span start (and is masked).
GENERATION_TEMPLATE = r"""{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' }}
    {%- if message['role'] == 'assistant' %}
        {{- 'T' }}{%- generation %}{{- 'he answer: ' + message['content'] + '<|im_end|>' }}{%- endgeneration %}
    {%- else %}
        {{- message['content'] + '<|im_end|>' }}
    {%- endif %}
    {{- '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def test_generation_blocks_give_transformers_assistant_mask(folders, tmp_path):
    folder = tmp_path / "gen"
    shutil.copytree(folders["chatml"], folder)
    (folder / "chat_template.jinja").write_text(GENERATION_TEMPLATE)  # takes precedence over tokenizer_config's
    ref, ours = _hf(folder), HFTokenizer.from_folder(folder)
    out = ref.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = ours.encode_chat(CHAT)
    assert ids == list(out["input_ids"])
    assert [int(m) for m in mask] == list(out["assistant_masks"])
    assert sum(mask) > 0


FEATURES_TEMPLATE = r"""{%- set ns = namespace(turns=0, first_user='') %}
    {% if messages %}
  Conversation of {{ messages | length }} messages:
    {% endif %}
{%- for message in messages %}
    {%- if message['role'] == 'user' and not ns.first_user %}{%- set ns.first_user = message['content'] %}{%- endif %}
    {%- if message['role'] == 'assistant' %}{%- set ns.turns = ns.turns + 1 %}{%- endif %}
    {%- if loop.index > 5 %}{%- break %}{%- endif %}
    {%- if message['role'] == 'system' %}{%- continue %}{%- endif %}
    {{- message['role'] | upper }}: {{ message | tojson }}
{% endfor %}
{{- dict(turns=ns.turns, first=ns.first_user, tools=tools, year=strftime_now('%Y')|int > 2000) | tojson(indent=2) }}
{%- if add_generation_prompt %}{{ eos_token }}{% endif %}
"""


def test_jinja_environment_matches_transformers(folders, tmp_path):
    """namespace, break/continue, tojson (non-ASCII kept, indent), dict, strftime_now, trim/lstrip blocks."""
    folder = tmp_path / "features"
    shutil.copytree(folders["llama3"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = FEATURES_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ref, ours = _hf(folder), HFTokenizer.from_folder(folder)
    for generation_prompt in (False, True):
        expected = ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=generation_prompt)
        assert ours.apply_chat_template(CHAT, add_generation_prompt=generation_prompt) == expected
    assert "près du pont" in expected and '"year": true' in expected


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% set _ = messages.append({'role': 'user'}) %}{{ messages | length }}",
    "{% set ns = namespace() %}{% set ns.__x = 1 %}ok",
])
def test_templates_run_sandboxed(folders, tmp_path, template):
    folder = tmp_path / "evil"
    shutil.copytree(folders["chatml"], folder)
    (folder / "chat_template.jinja").write_text(template)
    with pytest.raises(TokenizerError, match="rendering the chat template failed"):
        HFTokenizer.from_folder(folder).apply_chat_template(CHAT)


def test_template_errors_and_missing_files_name_the_cause(folders, tmp_path):
    mistral = HFTokenizer.from_folder(folders["mistral"])
    with pytest.raises(TokenizerError, match="roles must alternate"):
        mistral.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    (empty / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=f"{empty}.*no tokenizer.json.*{empty / 'tokenizer.json'}"):
        load_tokenizer(empty)
    with pytest.raises(TokenizerError, match="never downloads"):
        HFTokenizer.from_folder("meta-llama/Llama-3.2-1B")
    broken = tmp_path / "broken"
    shutil.copytree(folders["chatml"], broken)
    (broken / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(TokenizerError, match=f"{broken / 'chat_template.jinja'}.*not valid Jinja"):
        HFTokenizer.from_folder(broken)
    no_template = tmp_path / "no-template"
    shutil.copytree(folders["chatml"], no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="no chat template"):
        HFTokenizer.from_folder(no_template).encode_chat(CHAT)


MOVING_TEMPLATE = (  # the system message goes into the last user turn, as some Mistral templates do
    "{{ bos_token }}{% for m in messages[1:] %}{% if m['role'] == 'user' %}[INST] "
    "{% if loop.last %}{{ messages[0]['content'] }} {% endif %}{{ m['content'] }}[/INST]"
    "{% else %} {{ m['content'] CONTENT_FILTER }}{{ eos_token }}{% endif %}{% endfor %}"
)


def test_template_that_rewrites_earlier_turns_is_located_by_markers(folders, tmp_path):
    """Rendering prefixes cannot work here (the first turns change when a user turn is added): the assistant
    texts are found by marking them, and the mask still equals the independent search."""
    folder = tmp_path / "moving"
    shutil.copytree(folders["mistral"], folder)
    (folder / "chat_template.jinja").write_text(MOVING_TEMPLATE.replace("CONTENT_FILTER", ""))
    ref, ours = _hf(folder), HFTokenizer.from_folder(folder)
    text = ref.apply_chat_template(CHAT, tokenize=False)
    assert text.startswith("<s>[INST] Who carried")  # the system message moved to the last user turn
    enc = ref(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, mask = ours.encode_chat(CHAT)
    assert ids == enc.input_ids
    # rule 3 spans the content and the EOS after it (the separating space is the template's, not the content's)
    assert mask == _expected_mask("mistral", text, enc.offset_mapping, CHAT, lambda content: content + "</s>")


def test_template_whose_assistant_text_cannot_be_located_is_refused(folders, tmp_path):
    """Trimming the content moves the markers' whitespace too: the marked render differs, so it is an error."""
    folder = tmp_path / "moving-trim"
    shutil.copytree(folders["mistral"], folder)
    (folder / "chat_template.jinja").write_text(MOVING_TEMPLATE.replace("CONTENT_FILTER", "| trim"))
    tok = HFTokenizer.from_folder(folder)
    with pytest.raises(TokenizerError, match="generation"):
        tok.encode_chat(CHAT)
