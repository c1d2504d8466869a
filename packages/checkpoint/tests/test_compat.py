"""smalti-checkpoint's private torch names live in ``smalti.checkpoint._compat``, resolved at import time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from smalti.checkpoint import _compat
from smalti.testing.house import private_imports

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize("name", sorted(_compat.PRIVATE_NAMES))
def test_each_private_name_resolves(name: str) -> None:
    assert _compat.PRIVATE_NAMES[name] is not None, name


def test_no_private_name_outside_compat() -> None:
    assert private_imports(SRC) == []


def test_narrow_fallback_matches_torch() -> None:
    t = torch.arange(60.0).reshape(3, 4, 5)
    for offsets, sizes in (((0, 0, 0), (3, 4, 5)), ((1, 2, 0), (2, 2, 5)), ((2, 0, 3), (1, 4, 2))):
        assert torch.equal(_compat._narrow(t, offsets, sizes), _compat.narrow_tensor_by_index(t, offsets, sizes))
