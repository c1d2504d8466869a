"""``trainer.cpu_malloc_mmap_threshold``: freed multi-MB tensors go back to the OS on CPU (glibc)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from smalti.core.cpu_malloc import DEFAULT_MMAP_THRESHOLD, ENV_VAR, configure_cpu_malloc
from smalti.core.errors import ConfigError

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting acts on glibc only")

# Mimics a training step: glibc's threshold first rises (a 24 MB block from mmap is freed), then 4-16 MB tensors
# are allocated with small long-lived allocations between them (the heap's top cannot shrink past those), and
# freed. Prints how many MB of the freed tensors the process still holds.
_CHILD = textwrap.dedent("""
    import sys, torch

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    mode = sys.argv[1]
    if mode == "trainer":
        from smalti.core.examples.model import MLPRegressor
        from smalti.core.trainer import Trainer
        threshold = None if sys.argv[2] == "null" else int(sys.argv[2])
        batches = [(torch.zeros(2, 4), torch.zeros(2, 2))]
        Trainer(MLPRegressor(4, 8, 2, 1), batches, "1ba", eval_interval=None, loggers=[],
                progress_bar=False, output_dir=sys.argv[3], cpu_malloc_mmap_threshold=threshold)
    del_me = torch.ones(6 << 20)  # 24 MB, from mmap; freeing it raises glibc's dynamic threshold
    del del_me
    base = rss_mb()
    big, pins = [], []
    for i in range(48):
        big.append(torch.ones((1 + i % 4) << 20))  # 4, 8, 12, 16 MB
        pins.append(torch.ones(16384))  # 64 KB that stays alive after each block (too big for old free chunks)
    allocated = sum(t.numel() * 4 for t in big) / 2**20
    del big
    print(f"{allocated:.0f} {rss_mb() - base:.0f}")
""")


def _start(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-c", _CHILD, *args], env=env, stdout=subprocess.PIPE, text=True)


def _retained_mb(child: subprocess.Popen[str]) -> tuple[float, float]:
    """(MB allocated, MB still held after freeing) printed by the child."""
    try:
        out, _ = child.communicate(timeout=600)
    finally:
        child.kill()
    assert child.returncode == 0
    allocated, kept = out.split()[-2:]
    return float(allocated), float(kept)


@glibc_only
@pytest.mark.timeout(900)  # two fresh interpreters importing torch: seconds, minutes on a loaded machine
def test_trainer_returns_freed_tensors_to_the_os_and_null_keeps_them(tmp_path):
    # Both children run at once; each is its own process, so each starts with glibc's dynamic threshold.
    default = _start("trainer", str(DEFAULT_MMAP_THRESHOLD), str(tmp_path / "a"))
    null = _start("trainer", "null", str(tmp_path / "b"))
    allocated, kept = _retained_mb(default)
    _, kept_null = _retained_mb(null)
    assert allocated == 480
    assert kept < 0.1 * allocated, f"the Trainer's default setting should return the freed blocks, {kept} MB kept"
    assert kept_null > 0.8 * allocated, f"glibc's dynamic threshold should keep the freed blocks, {kept_null} MB"


def test_user_environment_variable_wins(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "65536")
    assert f"{ENV_VAR}=65536 is set" in configure_cpu_malloc(1 << 20, "cpu")


def test_null_and_other_devices_leave_libc_alone():
    assert "left as it is" in configure_cpu_malloc(None, "cpu")
    assert "not cpu" in configure_cpu_malloc(1 << 20, torch.device("meta"))


@pytest.mark.parametrize("bad", [0, -1, 64 << 20, "1MiB", True, 1.5])
def test_bad_threshold_names_the_key(bad):
    with pytest.raises(ConfigError, match=r"trainer\.cpu_malloc_mmap_threshold"):
        configure_cpu_malloc(bad, "cpu")


def test_the_cli_sets_the_threshold_before_it_builds_the_model(tmp_path, monkeypatch):
    """smalti-train applies ``trainer.cpu_malloc_mmap_threshold`` before the model is built, so what the build
    frees (an fp32 checkpoint read and then quantised, say) leaves the process instead of staying in the heap."""
    from hydra import compose, initialize_config_module

    import smalti.core.cli.train  # noqa: F401 - registers the config schema
    from smalti.core.config import build as build_module

    monkeypatch.chdir(tmp_path)
    events = []
    real_build = build_module.build
    monkeypatch.setattr(build_module, "configure_cpu_malloc",
                        lambda threshold, device: events.append(("malloc", threshold)) or "recorded")
    monkeypatch.setattr(build_module, "build", lambda node, what: events.append(("build", what)) or real_build(node, what))
    with initialize_config_module(version_base="1.3", config_module="smalti.core.conf"):
        cfg = compose("train", overrides=["model=tiny_lm", "data=synthetic", "callbacks=[]", "logger=[]",
                                          "trainer.eval_interval=null", "trainer.cpu_malloc_mmap_threshold=2097152"])
    build_module.build_trainer(cfg).close()
    assert events.index(("malloc", 2097152)) < events.index(("build", "model")), events
