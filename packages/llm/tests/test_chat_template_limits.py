"""A published chat template cannot exhaust memory or time: every hostile request is refused before the value is
made, as a TokenizerError naming the template and the limit (smalti issue 41, item 7)."""

from __future__ import annotations

import time

import pytest

from smalti.llm import template_limits
from smalti.llm.chat_template import ChatTemplate
from smalti.llm.errors import TokenizerError

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
ORIGIN = "/models/evil/chat_template.jinja"


@pytest.mark.parametrize(("template", "limit"), [
    ("{{ 'a' * 200000000 }}", "MAX_VALUE_LENGTH"),
    ("{{ ['a'] * 200000000 }}", "MAX_VALUE_LENGTH"),
    ("{% set s = 'a' * 10000000 %}{{ s + s }}", "MAX_VALUE_LENGTH"),
    ("{{ messages | tojson(indent=50000000) }}", "MAX_VALUE_LENGTH"),
    ("{{ messages | tojson(indent=5000) }}", "MAX_TOJSON_INDENT"),
    ("{{ '{:>999999999}'.format(1) }}", "MAX_VALUE_LENGTH"),
    ("{{ '{:>{w}}'.format(1, w=999999999) }}", "MAX_VALUE_LENGTH"),
    ("{{ '%999999999d' % 1 }}", "MAX_VALUE_LENGTH"),
    ("{{ 'ab'.center(999999999) }}", "MAX_VALUE_LENGTH"),
    ("{{ 'ab' | center(999999999) }}", "MAX_VALUE_LENGTH"),
    ("{{ ('x' * 10000000) | replace('x', 'xxxxxxxxxx') }}", "MAX_VALUE_LENGTH"),
    ("{{ ('x' * 10000000).replace('x', 'xxxxxxxxxx') }}", "MAX_VALUE_LENGTH"),
    ("{{ 10 ** 100000000 }}", "MAX_VALUE_LENGTH"),
    ("{{ ('a\n' * 5000000) | indent(100) }}", "MAX_VALUE_LENGTH"),
])
def test_oversized_values_are_refused_before_they_are_made(template, limit):
    started = time.monotonic()
    with pytest.raises(TokenizerError, match=f"{ORIGIN}: rendering the chat template failed: it hit a limit:.*{limit}"):
        ChatTemplate(template, ORIGIN).render(CHAT)
    assert time.monotonic() - started < 5


def test_loops_stop_at_the_iteration_budget(monkeypatch):
    monkeypatch.setattr(template_limits, "MAX_LOOP_ITERATIONS", 100_000)
    forever = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(TokenizerError, match=f"{ORIGIN}.*loops ran more than 100000 iterations"):
        ChatTemplate(forever, ORIGIN).render(CHAT)


def test_rendering_stops_at_the_deadline(monkeypatch):
    monkeypatch.setattr(template_limits, "RENDER_DEADLINE_S", 0.3)
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{{ j | string | length }}{% endfor %}{% endfor %}"
    started = time.monotonic()
    with pytest.raises(TokenizerError, match=f"{ORIGIN}.*longer than the 0.3 s deadline"):
        ChatTemplate(slow, ORIGIN).render(CHAT)
    assert time.monotonic() - started < 3


def test_output_stops_at_its_cap(monkeypatch):
    monkeypatch.setattr(template_limits, "MAX_OUTPUT_CHARS", 1000)
    with pytest.raises(TokenizerError, match=f"{ORIGIN}.*output passed 1000 characters"):
        ChatTemplate("{% for i in range(1000) %}0123456789{% endfor %}", ORIGIN).render(CHAT)


@pytest.mark.parametrize(("template", "named"), [
    ("{{ '{0.__class__}'.format_map({}) }}", "IndexError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed deeper"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
])
def test_any_failure_is_the_templates_error(template, named):
    with pytest.raises(TokenizerError, match=f"{ORIGIN}: rendering the chat template failed: .*{named}"):
        ChatTemplate(template, ORIGIN).render(CHAT)


def test_ordinary_templates_render_within_the_limits():
    template = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{{ m['content'] | trim }}"
                "{{ '%s' % '' }}{{ ('-' * 3) }}{% endfor %}{{ messages | tojson(indent=2) | length > 0 }}"
                "{{ '{:>5}'.format('x') }}")
    assert ChatTemplate(template, ORIGIN).render(CHAT) == "<|user|>hi---<|assistant|>hello---True    x"
