"""Sizes as users write them (``cache_limit: 50gb``, ``size_limit="64mb"``), and clear errors for the rest."""

import pytest

from smalti.streaming import MDSWriter, StreamingDataset, StreamingError
from smalti.streaming.mds import parse_size

GIB = 1 << 30


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("50gb", 50 * GIB),
        ("50GB", 50 * GIB),
        ("50GiB", 50 * GIB),
        ("50 g", 50 * GIB),
        ("1.5TiB", int(1.5 * (1 << 40))),
        ("2tb", 2 << 40),
        ("3pb", 3 << 50),
        ("64mb", 64 << 20),
        ("512 KiB", 512 << 10),
        ("4096", 4096),
        ("4096b", 4096),
        (" 1e3 ", 1000),
        (".5kb", 512),
        (5 * GIB, 5 * GIB),
        (7, 7),
        (2.0e12, 2_000_000_000_000),
    ],
)
def test_parse_size_reads_any_size_a_user_writes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "bad", ["", "gb", "50 gigs", "-1gb", "0", "0.1b", "1.2.3mb", 0, -5, True, [1], "nan"]
)
def test_parse_size_names_the_key_and_the_value(bad):
    with pytest.raises(StreamingError, match=r"cache_limit=") as info:
        parse_size(bad, "cache_limit")
    assert repr(bad) in str(info.value)


def test_cache_limit_above_4gib_builds(tmp_path, make_dataset):
    data = make_dataset(tmp_path / "d", n=50)
    ds = StreamingDataset(remote=str(data), local=str(tmp_path / "cache"), batch_size=4, cache_limit="50gb")
    assert ds.cache_limit == 50 * GIB
    assert len(list(ds)) == 52  # padded to whole batches of 4


def test_shard_size_limit_must_fit_32_bit_offsets(tmp_path):
    with pytest.raises(StreamingError, match=r"size_limit='8gb' .* at most 4294967295 bytes"):
        MDSWriter(tmp_path / "d", {"id": "int"}, size_limit="8gb")
    with pytest.raises(StreamingError, match=r"size_limit='lots' is not a size"):
        MDSWriter(tmp_path / "e", {"id": "int"}, size_limit="lots")
