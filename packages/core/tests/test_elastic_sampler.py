"""Map-style data resumed on another data-parallel size: ``ResumableDistributedSampler`` splits one permutation
rank-strided, so the samples consumed after ``k`` global batches are its first ``k * global batch`` entries on any
rank count, and the trainer's skip (``batch_in_epoch`` x per-rank batch) lands every rank right after them."""

from collections import Counter

import pytest

from smalti.core.data import ResumableDistributedSampler

SAMPLES, GLOBAL_BATCH, DONE = 150, 12, 4


def _epoch(world, skip_batches=0):
    out = []
    for rank in range(world):
        sampler = ResumableDistributedSampler(range(SAMPLES), world, rank, shuffle=True, seed=5)
        sampler.set_epoch(1)
        sampler.skip(skip_batches * (GLOBAL_BATCH // world))  # what Trainer._prepare_epoch does
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("resumed_on", [1, 2, 3, 6])
def test_a_map_style_epoch_resumes_on_another_data_parallel_size(resumed_on):
    saved = _epoch(4)
    read = [i for ids in saved for i in ids[: DONE * GLOBAL_BATCH // 4]]
    rest = _epoch(resumed_on, DONE)
    assert len({len(ids) for ids in rest}) == 1  # every rank the same number of batches left
    seen = Counter(read + [i for ids in rest for i in ids])
    assert sorted(seen) == list(range(SAMPLES))  # nothing skipped ...
    assert sum(seen.values()) - SAMPLES == (-SAMPLES) % resumed_on  # ... nothing repeated but the padding
