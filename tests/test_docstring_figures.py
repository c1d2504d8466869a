"""scripts/docstring_figures.py: a docstring or ``#:`` comment quoting a measured figure is reported; sizes,
settings and formula ratios are not."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import docstring_figures  # noqa: E402


def test_measured_figures_are_reported_and_sizes_and_settings_are_not(tmp_path):
    src = tmp_path / "packages" / "pkg" / "src" / "smalti" / "pkg"
    src.mkdir(parents=True)
    (src / "mod.py").write_text(
        '"""Reads 16 MiB chunks at 2.8-3.3 GB/s on this machine."""\n\n'
        "#: retries for 120 s, in 4 MiB pieces (1 MiB ones gave 0.54 of a raw write)\n"
        "RETRY_S = 120\n\n\n"
        "def step():\n"
        '    """FLOPs are 3x the forward; the gate is 0.9x the peak; 14x faster than before."""\n\n\n'
        "def order():\n"
        '    """About 0.25 us per sample, ~55,406 samples/s."""\n\n\n'
        "def plain():\n"
        '    """Writes 4096-byte blocks, times out after 30 s, keeps 2 x 16 MiB."""\n'
    )
    found = docstring_figures.figures(tmp_path)
    assert [line.split(": ", 1)[1] for line in found] == [
        "'2.8-3.3 GB/s'",
        "'14x faster'",
        "'0.25 us'",
        "'~55,406 samples/s'",
        "'0.54 of a raw'",
    ]
    assert found[0].startswith("packages/pkg/src/smalti/pkg/mod.py:1:")
