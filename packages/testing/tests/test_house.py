"""The source checks every package's tests share: import circles and private names outside ``_compat``."""

from __future__ import annotations

from smalti.testing.house import import_circles, private_imports


def test_import_circles_finds_each_circle_and_nothing_else():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert import_circles(edges) == [["a", "b", "c"], ["d", "e"]]
    assert import_circles({"x": {"y"}, "y": set()}) == []


def test_private_imports_names_file_line_and_name(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "_compat.py").write_text("from torch._C import PyTorchFileReader\n")
    (tmp_path / "pkg" / "mod.py").write_text(
        "import torch\nfrom torch.distributed._shard._utils import narrow_tensor_by_index\n"
        "x = torch._foreach_copy_\ny = torch.nn.functional.relu\nfrom pluggy import HookimplMarker\n")
    assert private_imports(tmp_path) == [
        "pkg/mod.py:2: torch.distributed._shard._utils.narrow_tensor_by_index",
        "pkg/mod.py:3: torch._foreach_copy_",
    ]
