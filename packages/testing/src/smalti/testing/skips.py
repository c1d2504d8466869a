"""Which skips a test run may have: only those for optional extras, missing hardware or the platform.

A skip on a missing hard dependency hides a broken install, so ``scripts/test.sh`` runs pytest with
``SMALTI_STRICT_SKIPS=1`` and the plugin fails the run on any skip whose reason matches none of
:data:`ALLOWED_SKIPS` (it lists them in an "unexpected skips" section). Add a pattern here, with its reason,
only for something a correct install may lack.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

STRICT_ENV = "SMALTI_STRICT_SKIPS"

#: ``(pattern, why it may be missing)``; a skip reason matching any pattern (re.search) is expected.
ALLOWED_SKIPS: tuple[tuple[str, str], ...] = (
    (r"could not import '(triton|wandb|lm_eval)\b", "optional extras that not every platform can install"),
    (r"could not import 'trl'", "smalti-llm's bench extra (the TRL baseline), which scripts/setup.sh does not install"),
    (r"Azurite is not installed", "an npm tool scripts/setup.sh installs only where npm is present (it warns)"),
    (r"\btriton\b|TRITON_INTERPRET", "the Triton kernels need a GPU or the Triton interpreter"),
    (r"\bCUDA\b|\bGPU\b", "hardware: tests for a machine with (or without) a GPU"),
    (r"\bLinux'?s?\b|/proc\b|O_DIRECT|/dev/full|huge pages|MADV_POPULATE_WRITE|already mapped|needs bash",
     "platform features (Linux syscalls, /proc, direct I/O, transparent huge pages)"),
    (r"pydoc_data\.topics of Python", "another Python's help text: the shipped tokenizer cannot be rebuilt there"),
    (r"a local folder has no (bucket|network)", "by design: a storage parameter that has no such feature"),
    (r"smalti-health is installed here", "core's test of its behaviour without smalti-health"),
    (r"smalti-llm's configs are not in this checkout", "a package checked out alone"),
)
_PATTERNS = [re.compile(pattern) for pattern, _ in ALLOWED_SKIPS]


def is_expected(reason: str) -> bool:
    """Whether a skip with this reason is one a correct install may have."""
    return any(p.search(reason) for p in _PATTERNS)


def unexpected(skips: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The ``(where, reason)`` pairs among ``skips`` whose reason is not expected."""
    return [(where, reason) for where, reason in skips if not is_expected(reason)]
