"""Limits on what a chat template may cost while it renders: sizes of the values it makes, loop iterations,
output length and wall-clock time.

A chat template is code from whoever published the model. Jinja's sandbox keeps it away from Python's
internals, but not from ``'a' * 200000000``, ``tojson(indent=50000000)``, ``'{:>999999999}'.format(1)`` or
nested loops that run for hours. Every such request is refused *before* the value is made (from the sizes of
the operands and arguments), and a render that runs past its deadline or iteration budget stops at the next
loop step, call, operator or filter. Each refusal is a :class:`TemplateLimitError` naming the limit.
"""

from __future__ import annotations

import re
import string
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

MAX_VALUE_LENGTH = 1 << 24  # characters of a string / items of a list one operation may make (16 Mi)
MAX_OUTPUT_CHARS = 1 << 26  # characters a whole render may produce (64 Mi)
MAX_LOOP_ITERATIONS = 10_000_000  # loop steps of one render, over every loop
MAX_TOJSON_INDENT = 64
RENDER_DEADLINE_S = 30.0  # wall-clock seconds one render may take
_CHECK_EVERY = 256  # loop steps between two looks at the clock
_GROWING_STR_METHODS = {"ljust", "rjust", "center", "zfill", "expandtabs"}
_NUMBER = re.compile(r"\d+")


class TemplateLimitError(Exception):
    """A chat template asked for more than a limit of this module allows; the message names the limit."""


@dataclass
class Budget:
    """What one render has spent: started at ``time.monotonic()`` ``started``, with ``steps`` loop steps and
    ``chars`` characters of output so far."""

    deadline_s: float = field(default_factory=lambda: RENDER_DEADLINE_S)
    started: float = field(default_factory=time.monotonic)
    steps: int = 0
    chars: int = 0

    def check_time(self) -> None:
        if time.monotonic() - self.started > self.deadline_s:
            raise TemplateLimitError(f"rendering took longer than the {self.deadline_s:g} s deadline "
                                     "(RENDER_DEADLINE_S)")

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_LOOP_ITERATIONS:
            raise TemplateLimitError(f"loops ran more than {MAX_LOOP_ITERATIONS} iterations (MAX_LOOP_ITERATIONS)")

    def output(self, piece: str) -> None:
        self.chars += len(piece)
        if self.chars > MAX_OUTPUT_CHARS:
            raise TemplateLimitError(f"the output passed {MAX_OUTPUT_CHARS} characters (MAX_OUTPUT_CHARS)")
        self.check_time()


_budget: ContextVar[Budget | None] = ContextVar("chat_template_budget", default=None)


def current() -> Budget | None:
    """The budget of the render running in this context (``None`` outside a render)."""
    return _budget.get()


def tick() -> None:
    """Look at the clock of the running render (called at every call, operator and filter)."""
    budget = _budget.get()
    if budget is not None:
        budget.check_time()


def run(produce: Callable[[Callable[[str], None]], None]) -> Budget:
    """Run ``produce(emit)`` (a render that hands each output piece to ``emit``) within a fresh budget."""
    budget = Budget()
    token = _budget.set(budget)
    try:
        produce(budget.output)
    finally:
        _budget.reset(token)
    return budget


def guard_loop(iterable: Iterable[Any]) -> Iterator[Any]:
    """``iterable``'s items, counting each against the render's loop budget and deadline."""
    budget = _budget.get()
    if budget is None:
        yield from iterable
        return
    for n, item in enumerate(iterable):
        budget.step()
        if n % _CHECK_EVERY == 0:
            budget.check_time()
        yield item


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, str | bytes | list | tuple) else None


def _refuse(what: str, size: int) -> None:
    raise TemplateLimitError(f"{what} would make a value of about {size} characters or items, more than "
                             f"MAX_VALUE_LENGTH={MAX_VALUE_LENGTH}")


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``left <operator> right`` when its result would pass the limits, before it is computed."""
    tick()
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            size = _size(seq)
            if size is not None and isinstance(times, int) and size * times > MAX_VALUE_LENGTH:
                _refuse(f"repeating a value of length {size} {times} times ('*')", size * times)
    elif operator == "+":
        a, b = _size(left), _size(right)
        if a is not None and b is not None and a + b > MAX_VALUE_LENGTH:
            _refuse("joining two values ('+')", a + b)
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            digits = right * max(1, abs(left).bit_length()) // 3
            if digits > MAX_VALUE_LENGTH:
                _refuse(f"{left} ** {right}", digits)
    elif operator == "%" and isinstance(left, str):
        _check_format_widths("'%' formatting", left, right if isinstance(right, tuple) else (right,))


def _check_format_widths(what: str, fmt: str, args: Iterable[Any]) -> None:
    """Refuse a format string whose widths or precisions (in the string, or given as arguments) are too big."""
    for number in _NUMBER.findall(fmt):
        if len(number) > 9 or int(number) > MAX_VALUE_LENGTH:
            _refuse(f"{what} with a width of {number}", int(number))
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and arg > MAX_VALUE_LENGTH:
            _refuse(f"{what} with the number {arg}", arg)


def check_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a call of a growing ``str`` method whose result would pass the limits, before it runs."""
    tick()
    target = getattr(func, "__wrapped__", func)  # the sandbox wraps str.format / format_map
    owner = getattr(target, "__self__", None)
    if not isinstance(owner, str):
        return
    name = getattr(target, "__name__", "")
    values = list(args) + list(kwargs.values())
    if name in ("format", "format_map"):
        specs = [spec or "" for _, _, spec, _ in string.Formatter().parse(owner)]
        _check_format_widths(f"str.{name}", " ".join(specs), [v for v in values if not isinstance(v, dict)])
        mapped = [v for v in values if isinstance(v, dict)]
        for mapping in mapped:
            _check_format_widths(f"str.{name}", "", mapping.values())
    elif name in _GROWING_STR_METHODS:
        width = values[0] if values else 0
        if isinstance(width, int) and len(owner) * (width if name == "expandtabs" else 1) > MAX_VALUE_LENGTH \
                or isinstance(width, int) and width > MAX_VALUE_LENGTH:
            _refuse(f"str.{name}({width})", width if name != "expandtabs" else len(owner) * width)
    elif name == "replace" and len(values) >= 2 and isinstance(values[0], str) and isinstance(values[1], str):
        _check_replace(owner, values[0], values[1])
    elif name == "join" and values and isinstance(values[0], list | tuple):
        total = sum(len(v) for v in values[0] if isinstance(v, str)) + len(owner) * len(values[0])
        if total > MAX_VALUE_LENGTH:
            _refuse("str.join", total)


def _check_replace(text: str, old: str, new: str) -> None:
    grows = len(new) - len(old)
    if grows > 0:
        count = text.count(old) if old else len(text) + 1
        if len(text) + count * grows > MAX_VALUE_LENGTH:
            _refuse("replace", len(text) + count * grows)


def check_filter(name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a filter call whose result would pass the limits (numbers over the limit, growing replaces and
    indents), before it runs."""
    tick()
    for arg in list(args) + list(kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool) and arg > MAX_VALUE_LENGTH:
            _refuse(f"filter {name} with the number {arg}", arg)
    text = value if isinstance(value, str) else None
    if text is None:
        return
    if name == "replace" and len(args) >= 2:
        _check_replace(text, str(args[0]), str(args[1]))
    elif name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else int(width)
        if len(text) + (text.count("\n") + 1) * width > MAX_VALUE_LENGTH:
            _refuse(f"indent({width})", len(text) + (text.count("\n") + 1) * width)


def check_tojson_indent(indent: Any) -> None:
    """Refuse a ``tojson`` indent that is not a small whole number (a huge one makes a huge string)."""
    if indent is None or (isinstance(indent, str) and len(indent) <= MAX_TOJSON_INDENT):
        return
    if not isinstance(indent, int) or isinstance(indent, bool) or not 0 <= indent <= MAX_TOJSON_INDENT:
        shown = indent if isinstance(indent, int) else f"a {type(indent).__name__}"
        raise TemplateLimitError(f"tojson(indent={shown}): indent must be a whole number from 0 to "
                                 f"MAX_TOJSON_INDENT={MAX_TOJSON_INDENT} (or as many spaces)")


def check_result(what: str, value: Any) -> Any:
    """``value`` when its length is within the limits (for filters whose growth cannot be told ahead)."""
    size = _size(value)
    if size is not None and size > MAX_VALUE_LENGTH:
        _refuse(what, size)
    return value
