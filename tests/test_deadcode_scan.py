"""scripts/deadcode.py: a function nothing calls is reported; uses from tests, configs' ``_target_``s, entry points
and hook names are counted (scripts/test.sh runs the scan over the repository itself)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import deadcode  # noqa: E402


def test_only_what_nothing_reaches_is_reported(tmp_path):
    src = tmp_path / "packages" / "pkg" / "src" / "smalti" / "pkg"
    src.mkdir(parents=True)
    (src / "mod.py").write_text(
        "def never_called():\n    return 1\n\n\n"
        "def called_by_a_test():\n    return 2\n\n\n"
        "class BuiltByHydra:\n    pass\n\n\n"
        "def cli_main():\n    return 0\n\n\n"
        "class Callback:\n    def on_batch_end(self, state):\n        return state\n\n"
        "    def should_stop(self, state):\n        return False\n"
    )
    (src / "hookspecs.py").write_text("from pluggy import HookspecMarker\n\nhookspec = HookspecMarker('x')\n\n\n"
                                      "@hookspec(firstresult=True)\ndef should_stop(state):\n    pass\n")
    (src / "conf").mkdir()
    (src / "conf" / "thing.yaml").write_text("thing:\n  _target_: smalti.pkg.mod.BuiltByHydra\n")
    (tmp_path / "packages" / "pkg" / "pyproject.toml").write_text(
        '[project]\nname = "pkg"\n[project.scripts]\npkg = "smalti.pkg.mod:cli_main"\n'
    )
    tests = tmp_path / "packages" / "pkg" / "tests"
    tests.mkdir()
    (tests / "test_mod.py").write_text(
        "from smalti.pkg.mod import Callback, called_by_a_test\n\n\ncalled_by_a_test()\nCallback()\n"
    )
    lines = deadcode.unused(tmp_path)
    assert [line.split(": ", 1)[1] for line in lines] == ["unused function 'never_called' (60% confidence)"]
    assert lines[0].startswith("packages/pkg/src/smalti/pkg/mod.py:1:")

