"""The core plugin: an import-light entry point (its config option is built through Hydra in tests/)."""

import subprocess
import sys
from importlib import resources
from importlib.metadata import entry_points


def test_entry_point_is_import_light_and_points_at_the_configs():
    (ep,) = [ep for ep in entry_points(group="smalti") if ep.name == "streaming"]
    assert ep.value == "smalti.streaming.plugin"
    code = "import sys, smalti.streaming.plugin as p; print(p.smalti_config_searchpath()); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["pkg://smalti.streaming.conf", "False"]
    assert resources.files("smalti.streaming.conf").joinpath("data", "streaming.yaml").is_file()
