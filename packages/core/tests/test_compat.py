"""smalti-core's private dependency names live in ``smalti.core._compat``, resolved at import time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from smalti.core import _compat
from smalti.core.errors import UnsupportedVersionError
from smalti.core.versions import private_name
from smalti.testing.house import private_imports

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize("name", sorted(_compat.PRIVATE_NAMES))
def test_each_private_name_resolves(name: str) -> None:
    assert _compat.PRIVATE_NAMES[name] is not None, name


def test_no_private_name_outside_compat() -> None:
    assert private_imports(SRC) == []


def test_missing_name_names_the_installed_version() -> None:
    with pytest.raises(UnsupportedVersionError, match=rf"torch {torch.__version__.split('+')[0]}.*_no_such_name"):
        private_name("torch", "_no_such_name")
    with pytest.raises(ImportError, match="hydra-core .* has no hydra._no_such_module"):
        private_name("hydra._no_such_module", distribution="hydra-core")


def test_fallback_replaces_a_missing_name() -> None:
    def fallback() -> None: ...

    assert private_name("torch", "_no_such_name", fallback=fallback) is fallback


def test_hook_fields_and_raw_values_read_what_they_say() -> None:
    import pluggy
    from omegaconf import OmegaConf

    pm = pluggy.PluginManager("probe")
    assert _compat.hook_executor(pm) is not None
    cfg = OmegaConf.create({"a": 1, "b": "${a}"})
    assert _compat.raw_value(cfg, "b") == "${a}"
    assert _compat.raw_value(cfg, "missing") is None
