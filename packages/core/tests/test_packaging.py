"""The built wheel keeps the ``smalti`` namespace open and ships configs, the corpus and the Hydra plugin."""

import subprocess
import sys
import zipfile
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent


def test_wheel_contents(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(CORE)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("smalti_core-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "smalti/__init__.py" not in names  # a PEP 420 namespace: other smalti packages must stay importable
    assert "hydra_plugins/__init__.py" not in names  # Hydra's own namespace, same rule
    for needed in ("smalti/core/__init__.py", "smalti/core/py.typed", "smalti/core/conf/__init__.py",
                   "smalti/core/conf/train.yaml", "smalti/core/conf/parallelism/fsdp.yaml",
                   "smalti/core/examples/corpus/corpus.txt", "hydra_plugins/smalti_core/__init__.py",
                   "hydra_plugins/smalti_core/searchpath.py"):
        assert needed in names, needed
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "smalti-train = smalti.core.cli.train:main" in text and "[smalti]" in text
