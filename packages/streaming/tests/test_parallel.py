"""write_parallel: LitData-style ``optimize`` over a function of inputs, in several processes."""

import numpy as np
import pytest

from smalti.streaming import StreamingDataset, StreamingError, load_index, read_shard_samples, write_parallel

COLUMNS = {"id": "int", "x": "ndarray:float32:3"}


def one_sample(i):
    return {"id": i, "x": np.full(3, i, np.float32)}


def two_samples(i):
    yield {"id": 2 * i, "x": np.full(3, i, np.float32)}
    yield {"id": 2 * i + 1, "x": np.full(3, -i, np.float32)}


def fails_on_57(i):
    if i == 57:
        raise ValueError("bad record")
    return one_sample(i)


@pytest.mark.parametrize("workers", [1, 2])
def test_write_parallel_keeps_input_order_in_one_dataset(tmp_path, workers):
    out = write_parallel(one_sample, range(301), tmp_path / "ds", COLUMNS, num_workers=workers,
                         compression="zstd", hashes=["xxh64"], size_limit=1000)
    got = list(read_shard_samples(out))
    assert [int(s["id"]) for s in got] == list(range(301))
    assert all(np.array_equal(s["x"], np.full(3, s["id"], np.float32)) for s in got)
    assert len(load_index(out / "index.json")) > workers  # several shards per part, listed part by part
    ds = StreamingDataset(local=str(out), batch_size=8)
    assert [int(s["id"]) for s in ds.__getitems__(list(range(0, 301, 50)))] == list(range(0, 301, 50))

    gen = write_parallel(two_samples, range(40), tmp_path / "gen", COLUMNS, num_workers=workers)
    assert [int(s["id"]) for s in read_shard_samples(gen)] == list(range(80))


def test_write_parallel_failure_names_the_input_and_publishes_nothing(tmp_path):
    with pytest.raises(StreamingError, match=r"fn failed on input 57 \(57\): ValueError: bad record"):
        write_parallel(fails_on_57, range(100), tmp_path / "ds", COLUMNS, num_workers=2)
    assert not (tmp_path / "ds" / "index.json").exists()
    with pytest.raises(StreamingError, match="index.json"):
        StreamingDataset(local=str(tmp_path / "ds"), batch_size=4)
    with pytest.raises(StreamingError, match="local folder"):
        write_parallel(one_sample, range(3), "s3://bucket/ds", COLUMNS)
