"""Checks on every value smalti writes into a launcher script or manifest.

A Slurm batch script is read by bash: a value holding a newline becomes a shell line of its own, run on the
job's first node as the submitting user. Some values come from files that other jobs can write (the cordon
list is shared by every job that runs ``smalti-health preflight``), so each value is checked against the
narrowest pattern its kind allows, on read and again on write, and refused naming where it came from.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from smalti.core.launch.errors import LaunchError

#: One host name: RFC 1123 labels (letters, digits, '-', and '_' as some clusters use) joined by dots.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"
HOST_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")
#: A Slurm host list as a user writes it in ``exclude``/``nodelist``: names, brackets, ranges, commas.
SLURM_HOST_LIST = re.compile(r"^[A-Za-z0-9_.\-\[\],]{1,4096}$")
#: Job names, partitions, accounts, QOS, GRES and constraints: no space, quote, '$', '`', ';' or control.
SLURM_WORD = re.compile(r"^[A-Za-z0-9_.\-+=@%:,/\[\]|&*()!]{1,1024}$")
#: An OCI image reference: [registry[:port]/]path[:tag][@digest].
IMAGE_REFERENCE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/:@+]{0,4095}$")
#: An environment variable name.
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")
#: Control characters: newline, carriage return, NUL, escape, ... None belongs in any value of a script.
_CONTROL = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")
_CONTROL_RUN = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]+")
#: The Slurm options whose values are host lists.
_HOST_LIST_KEYS = frozenset({"exclude", "nodelist", "w", "x"})
#: The Slurm options whose values are single words (see :data:`SLURM_WORD`).
_WORD_KEYS = frozenset({"name", "job_name", "partition", "qos", "account", "constraint", "gres", "reservation",
                        "mem", "time", "dependency", "array", "wckey", "licenses", "cluster", "clusters"})


def check_host_name(host: str, where: str) -> str:
    """``host`` when it is one valid host name; else a :class:`LaunchError` naming ``where`` and the value."""
    if not isinstance(host, str) or not HOST_NAME.match(host):
        raise LaunchError(
            f"{where}: {host!r} is not a host name (letters, digits, '-', '_' and '.', at most 253 characters); "
            "the entry is refused, since launchers write host names into job scripts"
        )
    return host


def check_no_control(value: str, where: str) -> str:
    """``value`` when it holds no control character (newline, CR, NUL, ...); else a :class:`LaunchError`."""
    if _CONTROL.search(value):
        raise LaunchError(
            f"{where}: {value!r} holds a control character (newline, carriage return, NUL, ...), which would "
            "start a line of its own in the job script; refused"
        )
    return value


def one_line(text: str) -> str:
    """``text`` with every run of control characters folded into one space (for free text such as reasons)."""
    return _CONTROL_RUN.sub(" ", text).strip()


def check_pattern(value: str, pattern: re.Pattern[str], where: str, what: str) -> str:
    """``value`` when it matches ``pattern``; else a :class:`LaunchError` naming ``where`` and ``what`` it must be."""
    if not isinstance(value, str) or not pattern.match(value):
        raise LaunchError(f"{where}: {value!r} is not {what}; refused, since it is written into a job script")
    return value


def check_slurm_params(params: Mapping[str, Any], where: str = "hydra.launcher") -> None:
    """Refuse any Slurm parameter whose value could escape its ``#SBATCH`` line or the setup lines.

    Host lists and single-word options are held to their patterns; every other string (``comment``, ``setup``
    lines, ``additional_parameters``) may hold anything but a control character.
    """
    for key, value in params.items():
        _check_slurm_value(str(key), value, f"{where}.{key}")


def _check_slurm_value(key: str, value: Any, where: str) -> None:
    if value is None or isinstance(value, bool | int | float):
        return
    if isinstance(value, Mapping):
        for sub_key, sub_value in value.items():
            check_pattern(str(sub_key), SLURM_WORD, f"{where} key", "a Slurm option name")
            _check_slurm_value(str(sub_key), sub_value, f"{where}.{sub_key}")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_slurm_value(key, item, f"{where}[{i}]")
        return
    text = check_no_control(str(value), where)
    if key in _HOST_LIST_KEYS:
        check_pattern(text, SLURM_HOST_LIST, where, "a Slurm host list (names, brackets, ranges and commas)")
    elif key in _WORD_KEYS:
        check_pattern(text, SLURM_WORD, where, "one word without spaces, quotes, '$', '`' or ';'")


def check_env(env: Mapping[str, str], where: str) -> None:
    """Refuse environment names that are not identifiers and values holding control characters."""
    for name, value in env.items():
        check_pattern(name, ENV_NAME, f"{where} {name!r}", "an environment variable name")
        check_no_control(str(value), f"{where} {name}")


def check_all_no_control(values: Iterable[str], where: str) -> None:
    """:func:`check_no_control` on each of ``values``."""
    for i, value in enumerate(values):
        check_no_control(str(value), f"{where}[{i}]")
