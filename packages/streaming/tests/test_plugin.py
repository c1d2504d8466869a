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


def test_plugin_discovery_imports_no_numpy_nor_codecs():
    """Every smalti process loads the entry point: the package's names are imported on first use."""
    code = ("import sys, smalti.streaming.plugin, smalti.streaming; "
            "print([m for m in ('numpy', 'zstandard', 'xxhash', 'smalti.storage', 'smalti.streaming.mds') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_package_names_import_on_first_use():
    import smalti.streaming as st
    from smalti.streaming import mds
    from smalti.streaming.loader import StreamingDataLoader

    assert st.MDSWriter is mds.MDSWriter and st.StreamingDataLoader is StreamingDataLoader
    namespace = {}
    exec("from smalti.streaming import *", namespace)
    assert sorted(k for k in namespace if not k.startswith("__")) == sorted(st.__all__)
    assert set(st.__all__) <= set(dir(st))
    try:
        st.NoSuchName  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchName" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
