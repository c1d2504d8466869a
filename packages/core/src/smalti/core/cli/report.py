"""How the command-line tools report a user's config error: a few lines, no traceback, exit code 2.

A bad value (caught by the schemas or by a package's own check while building) is a
:class:`~smalti.core.errors.ConfigError`; Hydra's own composition errors (an unknown key, a value of the
wrong type for a typed key, an option that does not exist) are reported the same way by
:func:`install_hydra_exit_code`. Every other exception keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any

#: The exit code of a config error, as argparse uses for a usage error.
CONFIG_ERROR_EXIT = 2
MAX_LINES = 5

_installed = False


def format_config_error(exc: BaseException | str, prog: str) -> str:
    """``exc``'s message as at most :data:`MAX_LINES` lines, the first prefixed with ``prog: config error:``."""
    from smalti.core.redact import redact_text

    text = redact_text(str(exc))  # a config error may quote the bad value as given
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()] or [type(exc).__name__]
    if len(lines) > MAX_LINES:
        lines = [*lines[: MAX_LINES - 1], "..."]
    lines[0] = f"{prog}: config error: {lines[0]}"
    return "\n".join(lines)


def report_config_error(exc: BaseException, prog: str, stream: IO[str] | None = None) -> int:
    """Print ``exc`` in the short form and return the exit code for it."""
    print(format_config_error(exc, prog), file=stream or sys.stderr, flush=True)
    return CONFIG_ERROR_EXIT


def report_build_error(exc: BaseException, prog: str, stream: IO[str] | None = None) -> int:
    """Print a :class:`~smalti.core.errors.BuildError` as one line (no traceback) and return exit code 1."""
    from smalti.core.redact import redact_text

    line = " ".join(redact_text(str(exc)).split())
    print(f"{prog}: error: {line} (HYDRA_FULL_ERROR=1 shows the traceback)", file=stream or sys.stderr, flush=True)
    return 1


def _compose_error_lines(exc: BaseException) -> str:
    """Hydra's composition error with the OmegaConf cause reduced to its message and ``full_key``."""
    text = str(exc).strip()
    cause = exc.__cause__
    if cause is not None and type(cause).__module__.startswith("omegaconf"):
        detail = [line.strip() for line in str(cause).splitlines() if line.strip()]
        keep = detail[:1] + [line for line in detail[1:] if line.startswith("full_key:")]
        text = "\n".join([text, *keep])
    return text


def _config_error_cause(exc: BaseException) -> BaseException | None:
    """The :class:`~smalti.core.errors.ConfigError` that ``exc`` wraps (a resolver's check, say), if any."""
    from smalti.core.errors import ConfigError

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ConfigError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def install_hydra_exit_code(prog: str) -> None:
    """Make Hydra's composition errors exit with code 2 (instead of 1), in the short form (idempotent).

    Errors listing a group's options keep the full list; ``HYDRA_FULL_ERROR=1`` still gives Hydra's traceback.
    Every message, and every exception Hydra prints a traceback of, is redacted (:mod:`smalti.core.redact`).
    """
    global _installed
    if _installed:
        return
    from hydra.errors import CompactHydraException, MissingConfigException

    from smalti.core._compat import hydra_internal_utils as utils
    from smalti.core.redact import redact_exception, redact_text

    original = utils.run_and_report

    def run_and_report(func: Any) -> Any:
        def guarded() -> Any:
            try:
                return func()
            except CompactHydraException as exc:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                if isinstance(exc, MissingConfigException):
                    print(f"{prog}: config error: {redact_text(str(exc).strip())}", file=sys.stderr, flush=True)
                else:
                    print(format_config_error(_compose_error_lines(exc), prog), file=sys.stderr, flush=True)
                sys.exit(CONFIG_ERROR_EXIT)
            except Exception as exc:  # a smalti check inside a resolver (the run name, say): its message only
                cause = _config_error_cause(exc)
                if cause is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                    redact_exception(exc)  # Hydra prints its traceback: without credentials
                    raise
                sys.exit(report_config_error(cause, prog))

        return original(guarded)

    utils.run_and_report = run_and_report
    _installed = True
