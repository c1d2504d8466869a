"""Chat templates rendered the way Hugging Face renders them, in a sandbox.

A model folder's ``chat_template`` is Jinja code from whoever published the model, so it runs in Jinja's
``ImmutableSandboxedEnvironment`` with the settings and helpers ``transformers`` gives templates (so the same
template gives the same string): ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension
(``break``/``continue``), a ``tojson`` filter that keeps non-ASCII text and does not HTML-escape,
``raise_exception(message)``, ``strftime_now(format)``, ``dict`` and a ``namespace`` that refuses
underscore-prefixed names, and ``{% generation %}...{% endgeneration %}`` blocks that mark assistant text.

:meth:`ChatTemplate.assistant_spans` says which characters of a rendered conversation are assistant output
(the text a model is trained to produce). The rule:

1. If the template has ``{% generation %}`` blocks, the spans are the text those blocks render (as
   ``transformers``' ``return_assistant_tokens_mask`` uses them).
2. Otherwise, for every assistant message ``i``: the span starts where the render of ``messages[:i]`` with
   ``add_generation_prompt=True`` ends, and ends where the render of ``messages[:i + 1]`` ends, without the
   whitespace it ends with (the separator before the next turn). So it holds the assistant's text and the
   end-of-turn token the template writes after it (``<|eot_id|>``, ``</s>``, ``<|im_end|>``), and not the role
   header. This needs each of these renders to be a prefix of the whole conversation's render.
3. A template that rewrites earlier turns when later ones are added (one that moves the system message into the
   last user turn, say) fails rule 2's check. Then each assistant ``content`` is wrapped in two private-use
   characters (U+E000, U+E001) and the conversation rendered again; with the markers removed this must equal
   the plain render (else an error asks for ``{% generation %}`` blocks), and each span is the text between
   two markers, followed by the ``eos_token`` when the render continues with it.

A token is an assistant token when its character range overlaps a span (see :func:`overlap_mask`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

from smalti.llm import template_limits as limits
from smalti.llm.errors import TokenizerError

Message = Mapping[str, Any]
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use markers around assistant text (rule 3)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

_tracking: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("chat_generation_spans",
                                                                                   default=None)


def _build_environment() -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(jinja2.ext.Extension):
        """``{% generation %}``: render the body and, while spans are tracked, record where it lands."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            text = caller()
            state = _tracking.get()
            if state is not None:
                emitted, spans = state
                start = sum(map(len, emitted))
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        limits.check_tojson_indent(indent)
        return limits.check_result("tojson", json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                                                        separators=separators, sort_keys=sort_keys))

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class SafeDict:
        """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without handing them the ``dict`` type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not store the underscore-prefixed name {name!r} on a namespace")

    class SafeNamespace(jinja2.utils.Namespace):
        """Jinja's ``namespace`` without underscore-prefixed attributes (no way into Python internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as Jinja: allows self=...
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                _check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        """The sandbox with :mod:`smalti.llm.template_limits` checked at every operator, call, filter and loop step."""

        intercepted_binops = frozenset({"*", "+", "**", "%"})
        smalti_loop_guard = staticmethod(limits.guard_loop)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            limits.check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            limits.check_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(jinja2.nodes.For):  # every loop step passes the guard
                loop.iter = jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("smalti_loop_guard"), [loop.iter],
                                              [], None, None, lineno=loop.lineno)
            return tree

    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters.update({name: _limited_filter(name, f) for name, f in env.filters.items()})
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=SafeDict(),
                       namespace=SafeNamespace)
    return env


def _limited_filter(name: str, func: Any) -> Any:
    """``func`` (a Jinja filter) checked against the limits before it runs and on what it returns."""
    from functools import wraps

    skip = 0 if getattr(func, "jinja_pass_arg", None) is None else 1  # a context/environment comes first

    @wraps(func)
    def limited(*args: Any, **kwargs: Any) -> Any:
        value = args[skip] if len(args) > skip else None
        limits.check_filter(name, value, args[skip + 1 :], kwargs)
        return limits.check_result(f"filter {name}", func(*args, **kwargs))

    return limited


@lru_cache(maxsize=1)
def _environment() -> Any:
    return _build_environment()


@lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    return _environment().from_string(source)


def normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as plain dicts without ``None`` values (a template tests for a missing key, not for None)."""
    out = []
    for n, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(f"message {n} is {message!r}; each message must be a dict with 'role' and 'content'")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


class ChatTemplate:
    """A Jinja chat template compiled in the sandbox; ``origin`` names where it came from in errors."""

    def __init__(self, source: str, origin: str = "chat_template") -> None:
        import jinja2

        self.source = source
        self.origin = origin
        try:
            self._template = _compile(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise TokenizerError(f"{origin}: the chat template is not valid Jinja (line {exc.lineno}: {exc.message})"
                                 ) from exc
        self.has_generation_blocks = _GENERATION_TAG.search(source) is not None

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False,
               variables: Mapping[str, Any] | None = None) -> str:
        """The conversation as text; ``variables`` holds the special tokens (``bos_token``, ...) and extras."""
        emitted: list[str] = []
        self._generate(messages, add_generation_prompt, variables, emitted)
        return "".join(emitted)

    def _generate(self, messages: Sequence[Message], add_generation_prompt: bool,
                  variables: Mapping[str, Any] | None, emitted: list[str]) -> None:
        """Render into ``emitted``, a piece at a time, within the limits of :mod:`smalti.llm.template_limits`.

        Any failure of the template (a limit, a sandbox refusal, or any exception its code raises, such as
        the ``IndexError`` of ``'{0}'.format_map({})``) becomes a :class:`TokenizerError` naming the template.
        """
        context = {"tools": None, "documents": None, **(variables or {}),
                   "messages": normalize_messages(messages), "add_generation_prompt": add_generation_prompt}

        def produce(emit: Any) -> None:
            for piece in self._template.generate(**context):
                emit(piece)
                emitted.append(piece)

        try:
            limits.run(produce)
        except limits.TemplateLimitError as exc:
            raise TokenizerError(f"{self.origin}: rendering the chat template failed: it hit a limit: {exc}; "
                                 "the template asks for more than any chat needs (fix or replace it)") from None
        except RecursionError:
            raise TokenizerError(f"{self.origin}: rendering the chat template failed: it recursed deeper than "
                                 "Python allows") from None
        except Exception as exc:  # the template's own code failed: its error, named as the template's
            raise TokenizerError(f"{self.origin}: rendering the chat template failed: "
                                 f"{type(exc).__name__}: {exc}") from exc

    def _render_tracked(self, messages: Sequence[Message], add_generation_prompt: bool,
                        variables: Mapping[str, Any] | None) -> tuple[str, list[tuple[int, int]]]:
        emitted: list[str] = []
        spans: list[tuple[int, int]] = []
        with _tracked(emitted, spans):
            self._generate(messages, add_generation_prompt, variables, emitted)
        return "".join(emitted), spans

    def assistant_spans(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                        variables: Mapping[str, Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the ``[start, end)`` character spans of assistant output (module doc)."""
        if self.has_generation_blocks:
            return self._render_tracked(messages, add_generation_prompt, variables)
        full = self.render(messages, add_generation_prompt, variables)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:i], True, variables)
            through = self.render(messages[: i + 1], False, variables)
            if not (through.startswith(before) and full.startswith(through)):
                return full, self._marked_spans(messages, add_generation_prompt, variables, full, i)
            end = len(through.rstrip())
            spans.append((len(before), max(end, len(before))))
        return full, spans

    def _marked_spans(self, messages: Sequence[Message], add_generation_prompt: bool,
                      variables: Mapping[str, Any] | None, full: str, unstable: int) -> list[tuple[int, int]]:
        """Rule 3 (module doc): assistant contents wrapped in private-use markers, found in the render."""
        failure = (f"{self.origin}: the chat template renders the first {unstable + 1} messages differently from "
                   "the start of the whole conversation, and assistant texts cannot be found in it either, so "
                   "assistant turns cannot be located; wrap the assistant text in "
                   "{% generation %}...{% endgeneration %} in the template")
        marked = []
        for message in normalize_messages(messages):
            if message.get("role") == "assistant" and isinstance(message.get("content"), str):
                if _OPEN in message["content"] or _CLOSE in message["content"]:
                    raise TokenizerError(f"{self.origin}: an assistant message holds U+E000/U+E001: {failure}")
                message = {**message, "content": _OPEN + message["content"] + _CLOSE}
            marked.append(message)
        rendered = self.render(marked, add_generation_prompt, variables)
        if rendered.replace(_OPEN, "").replace(_CLOSE, "") != full:
            raise TokenizerError(failure)
        spans, removed, start = [], 0, None
        eos = (variables or {}).get("eos_token") or ""
        for pos, char in enumerate(rendered):
            if char == _OPEN and start is None:
                start = pos - removed
            elif char == _CLOSE and start is not None:
                end = pos - removed
                end += len(eos) if eos and full.startswith(eos, end) else 0
                spans.append((start, end))
                start = None
            elif char in (_OPEN, _CLOSE):
                raise TokenizerError(failure)
            removed += char in (_OPEN, _CLOSE)
        return spans


@contextmanager
def _tracked(emitted: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
    token = _tracking.set((emitted, spans))
    try:
        yield
    finally:
        _tracking.reset(token)


def overlap_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """For each token's ``(start, end)`` character range: does it overlap one of ``spans``? (Both sorted.)"""
    mask = [False] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = True
    return mask
