"""The shard cache's hold on disk: a shard another process evicts is not kept mapped here."""

import time
from pathlib import Path

import pytest

from smalti.streaming import StreamingDataset
from smalti.streaming.cache import STALE_CHECK_S
from smalti.streaming.mds import remove_copy


def mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the mappings from /proc")
def test_a_shard_another_process_evicts_is_unmapped_here_on_the_next_read(make_dataset, tmp_path):
    remote = make_dataset(tmp_path / "remote", n=200, size_limit=1000)

    def make():
        return StreamingDataset(remote=str(remote), local=str(tmp_path / "cache"), batch_size=8, predownload=0)

    here = make()
    first = here.cache.reader(0)[0]
    path = here.cache.raw_path(0)
    assert mapped(path)
    remove_copy(path)  # what another process's eviction does (its own ShardCache._evict)
    time.sleep(STALE_CHECK_S * 2)
    here.cache.reader(1)  # the next read here lets go of the evicted copy
    assert not mapped(path)  # its disk space is free now, not when this process ends
    assert here.cache.reader(0)[0]["id"] == first["id"]  # fetched again when needed
    assert mapped(path)
