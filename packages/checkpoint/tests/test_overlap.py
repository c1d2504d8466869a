"""Work taken off a save's and a load's critical path: the rank file is written beside the DCP save, and a load
maps the new optimizer state's pages on a helper thread."""

import ctypes
import functools
import sys
import threading
import warnings

import pytest
import torch

from smalti.checkpoint import Checkpointer, state_io
from smalti.checkpoint.prefault import PAGE_BYTES, Prefaulter, populate, whole_pages
from smalti.core import Trainer
from smalti.core.data import build_dataloader
from smalti.core.examples import MLPRegressor, SyntheticRegression


def make_trainer(duration, checkpointer):
    torch.manual_seed(0)
    return Trainer(
        MLPRegressor(),
        build_dataloader(SyntheticRegression(96), 16, seed=5),
        duration,
        optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
        callbacks={"checkpoint": checkpointer},
    )


def test_the_rank_file_is_written_beside_the_dcp_save_and_its_failure_fails_the_save(tmp_path, monkeypatch):
    seen = []

    def failing(*args, **kwargs):
        seen.append(threading.current_thread().name)
        raise OSError(28, "No space left on device (rank file)")

    monkeypatch.setattr(state_io, "write_rank_local_file", failing)
    with pytest.raises(OSError, match="rank file"):
        make_trainer("2ba", Checkpointer(str(tmp_path), save_interval="2ba")).fit()
    assert seen == ["smalti-ckpt-rank-file"]
    assert not list(tmp_path.rglob("manifest.json")), "a save whose rank file failed was committed"


def resident_pages(address, length):
    """How many of the pages in ``[address, address + length)`` are mapped (``mincore``)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    vec = (ctypes.c_ubyte * (length // PAGE_BYTES))()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore/MADV_POPULATE_WRITE are Linux's")
def test_populate_maps_every_whole_page_of_a_fresh_tensor_and_keeps_its_bytes():
    tensor = torch.empty(64 << 20, dtype=torch.uint8)  # above malloc's mmap threshold: fresh, unmapped pages
    address, length = whole_pages(tensor)
    assert address % PAGE_BYTES == 0 and length >= (64 << 20) - 2 * PAGE_BYTES
    if resident_pages(address, length) == length // PAGE_BYTES:
        pytest.skip("the allocator handed out pages that were already mapped")
    if not populate(tensor):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert resident_pages(address, length) == length // PAGE_BYTES
    tensor[:8] = 7
    small = torch.arange(10, dtype=torch.uint8)
    assert populate(small) and whole_pages(small)[1] == 0 and small.tolist() == list(range(10))


def test_a_load_maps_the_pages_of_the_optimizer_state_it_creates(tmp_path, monkeypatch):
    make_trainer("2ba", Checkpointer(str(tmp_path), save_interval="2ba")).fit()
    given = []

    class Recording(Prefaulter):
        MIN_BYTES = 0

        def __init__(self, tensors):
            tensors = list(tensors)
            given.append(tensors)
            super().__init__(tensors)

    monkeypatch.setattr(state_io, "Prefaulter", Recording)
    resumed = make_trainer(
        "4ba", Checkpointer(load_path=str(tmp_path), save_interval=None, save_on_fit_end=False)
    )
    state = resumed.state.optimizers[0].state
    made = {id(t) for per_param in state.values() for key, t in per_param.items() if key != "step"}
    assert len(given) == 1 and made and made <= {id(t) for t in given[0]}


@pytest.mark.parametrize("async_save", [False, True])
def test_single_process_saves_and_loads_do_not_warn_about_torch_distributed(tmp_path, async_save):
    """DCP warns "assuming the intent is to save (load) in a single process" on each save and load without a
    process group; an async save's warning comes from DCP's background thread, outside the save call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpointer = Checkpointer(str(tmp_path), save_interval="2ba", async_save=async_save)
        trainer = make_trainer("4ba", checkpointer)
        trainer.fit()
        checkpointer.wait()
        trainer.close()
    with warnings.catch_warnings(record=True) as caught_loading:  # the filters as they were before the saves
        warnings.simplefilter("always")
        make_trainer("4ba", Checkpointer(load_path=str(tmp_path), save_interval=None, save_on_fit_end=False)).close()
    caught += caught_loading
    assert len(checkpointer.committed) == 2
    assert not [w for w in caught if "single process" in str(w.message)], [str(w.message) for w in caught]
