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
