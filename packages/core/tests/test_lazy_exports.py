"""The packages' public names load on first use, once, and an unknown name is an AttributeError naming both."""

import subprocess
import sys

import pytest


def test_a_public_name_is_imported_on_first_use_and_kept():
    code = (
        "import sys, smalti.core as c\n"
        "assert 'smalti.core.trainer' not in sys.modules\n"
        "t = c.Trainer\n"
        "assert 'smalti.core.trainer' in sys.modules and vars(c)['Trainer'] is t\n"
        "assert 'Trainer' in dir(c)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_an_unknown_name_names_the_package_and_the_name():
    import smalti.core

    with pytest.raises(AttributeError, match="module 'smalti.core' has no attribute 'Trainr'"):
        smalti.core.Trainr  # noqa: B018
