"""Token columns of MDS data written elsewhere: LLM Foundry's legacy ``bytes`` of int64 ids are read exactly."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from smalti.llm.data.mds import TextMDS  # noqa: E402
from smalti.llm.errors import DataError  # noqa: E402

FOUNDRY = Path(__file__).parent / "fixtures" / "foundry_legacy_tokens"


def read_all(ds):
    return [ds[i]["input_ids"].tolist() for i in range(ds.num_samples)]


def test_foundry_legacy_int64_token_bytes_are_read_exactly(tmp_path):
    # Written by the real mosaicml-streaming as Foundry's convert_dataset_hf did (see make_fixture.py).
    shutil.copytree(FOUNDRY / "train", tmp_path / "train")  # reading decompresses beside the shards
    expected = json.loads((FOUNDRY / "expected.json").read_text())
    ds = TextMDS(local=str(tmp_path / "train"), max_seq_len=32, shuffle=False)
    assert read_all(ds) == expected
    assert [s["input_ids"].tolist() for s in ds] == expected  # iteration converts too
    assert read_all(TextMDS(local=str(tmp_path / "train"), max_seq_len=32, shuffle=False,
                            token_dtype="int64")) == expected


def test_token_bytes_of_another_width_fail_naming_the_column_and_the_fix(tmp_path):
    from smalti.streaming import MDSWriter

    rng = np.random.default_rng(0)
    windows = [rng.integers(1, 50000, size=16).astype(np.int32) for _ in range(4)]
    with MDSWriter(tmp_path / "i32", {"tokens": "bytes"}) as writer:
        for w in windows:
            writer.write({"tokens": w.tobytes()})
    ds = TextMDS(local=str(tmp_path / "i32"), max_seq_len=8, shuffle=False)
    with pytest.raises(DataError, match=r"'tokens'.*token_dtype"):
        ds[0]
    ds = TextMDS(local=str(tmp_path / "i32"), max_seq_len=16, shuffle=False, token_dtype="int32")
    assert read_all(ds) == [w.tolist() for w in windows]
    with pytest.raises(DataError, match="token_dtype='int8'"):
        TextMDS(local=str(tmp_path / "i32"), token_dtype="int8")


def write_windows(path, n=40, length=24):
    from smalti.streaming import MDSWriter

    rng = np.random.default_rng(1)
    with MDSWriter(path, {"tokens": f"ndarray:int32:{length}"}, size_limit=1 << 10) as writer:
        for _ in range(n):
            writer.write({"tokens": rng.integers(1, 50000, size=length).astype(np.int32)})
    return path


@pytest.mark.parametrize("workers", [0, 2])
def test_text_mds_batches_take_the_batch_path_and_equal_the_sample_path(tmp_path, monkeypatch, workers):
    import torch
    from torch.utils.data import DataLoader

    from smalti.streaming import StreamingDataLoader

    data = write_windows(tmp_path / "data")
    ds = TextMDS(local=str(data), max_seq_len=16, shuffle=True, batch_size=4)
    cls = type(ds)
    calls = {"batch": 0, "sample": 0}
    def counting(name: str, key: str):
        original = getattr(cls, name)

        def counted(self, value):
            calls[key] += 1
            return original(self, value)

        return counted

    for name, key in (("transform_batch", "batch"), ("transform_sample", "sample")):
        monkeypatch.setattr(cls, name, counting(name, key))
    assert not ds.transforms_samples()
    loader = StreamingDataLoader(ds, batch_size=4, num_workers=workers)
    assert loader.batched
    fast = [b["input_ids"] for b in loader]
    # in this process: every batch (workers hand over ids; this process makes the batches), none per sample
    assert calls == {"batch": 10, "sample": 0}
    ds.set_epoch(0)  # the loader's iteration moved the dataset on to epoch 1
    slow = [b["input_ids"] for b in DataLoader(ds, batch_size=4)]  # torch's own loader, sample by sample
    assert calls["sample"] == 40
    assert len(fast) == len(slow) == 10
    for a, b in zip(fast, slow, strict=True):
        assert a.dtype == b.dtype == torch.int64
        assert a.shape == (4, 16) and a.equal(b)


def test_text_mds_batch_path_refuses_windows_shorter_than_max_seq_len(tmp_path):
    from smalti.streaming import StreamingDataLoader

    ds = TextMDS(local=str(write_windows(tmp_path / "data", n=8)), max_seq_len=32, shuffle=False, batch_size=4)
    with pytest.raises(DataError, match="fewer than max_seq_len=32"):
        next(iter(StreamingDataLoader(ds, batch_size=4)))
