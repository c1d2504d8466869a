"""Data loading draws its random numbers from its own generator, never from torch's global one (the model's).

A model with dropout resumed from a state dict continues with the random numbers of the uninterrupted run
only if nothing else drew from the global generator between the restore and the next step; ``iter(DataLoader)``
did (its workers' base seed, and a ``RandomSampler``'s permutation).
"""

import copy
import functools

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from smalti.core import Callback, Trainer
from smalti.core.data import build_dataloader, seed_data_loading
from smalti.core.examples import MLPRegressor, SyntheticRegression


def drain(loader, epochs=2):
    out = []
    for epoch in range(epochs):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        out.extend(batch if isinstance(batch, torch.Tensor) else batch[0] for batch in loader)
    return out


class Counting(IterableDataset):
    def __iter__(self):
        return iter(range(12))


def test_iterating_a_smalti_loader_leaves_the_global_generator_alone():
    torch.manual_seed(7)
    before = torch.get_rng_state()
    drain(build_dataloader(SyntheticRegression(64), 8, shuffle=True, seed=3))
    drain(build_dataloader(SyntheticRegression(64), 8, shuffle=False))
    drain(build_dataloader(Counting(), 4))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_user_loader_gets_its_own_generator_seeded_by_run_and_epoch():
    dataset = torch.arange(40)

    def order(seed, epoch):
        loader = DataLoader(dataset, batch_size=40, shuffle=True)
        seed_data_loading(loader, seed, epoch)
        before = torch.get_rng_state()
        (batch,) = list(loader)
        assert torch.equal(torch.get_rng_state(), before)
        return batch.tolist()

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1) and order(1, 0) != order(2, 0)
    mine = torch.Generator().manual_seed(5)  # a generator the user passed stays theirs, unseeded by smalti
    loader = DataLoader(dataset, batch_size=4, shuffle=True, generator=mine)
    seed_data_loading(loader, 1, 0)
    assert loader.generator is mine and torch.equal(mine.get_state(), torch.Generator().manual_seed(5).get_state())


class WorkerSeed(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.tensor(get_worker_info().seed)


def test_worker_seeds_follow_run_seed_and_epoch():
    loader = build_dataloader(WorkerSeed(), 2, shuffle=False, num_workers=1)

    def worker_seed(seed, epoch):
        seed_data_loading(loader, seed, epoch)
        return next(iter(loader))[0].item()

    assert worker_seed(3, 1) == worker_seed(3, 1)  # a resumed epoch gives its workers the same seeds
    assert len({worker_seed(3, 1), worker_seed(3, 2), worker_seed(4, 1)}) == 3


class StopAt(Callback):
    def __init__(self, batch):
        self.batch = batch

    def should_stop(self, state):
        return state.timestamp.batch >= self.batch or None


def make_trainer(loader_kind, load_state=None, stop=None):
    torch.manual_seed(0)
    dataset = SyntheticRegression(128)
    if loader_kind == "user":
        loader = DataLoader(dataset, batch_size=16, shuffle=True, drop_last=True)
    else:
        loader = build_dataloader(dataset, 16, seed=3)
    return Trainer(MLPRegressor(dropout=0.3), loader, "20ba", seed=5, load_state=load_state,
                   optimizers=functools.partial(torch.optim.AdamW, lr=1e-2),
                   callbacks={"stop": StopAt(stop)} if stop else None)


def test_dropout_model_resumes_bit_identical_with_smalti_and_user_loaders():
    for kind in ("smalti", "user"):
        full = make_trainer(kind)
        full.fit()
        first = make_trainer(kind, stop=11)  # 8 batches an epoch: the resume is mid-epoch 1
        first.fit()
        saved = copy.deepcopy(first.state.state_dict())
        torch.manual_seed(1234)  # a fresh process would have other RNG state: the state dict restores it
        second = make_trainer(kind, load_state=saved)
        second.fit()
        for a, b in zip(second.state.raw_model.parameters(), full.state.raw_model.parameters()):
            assert torch.equal(a, b), kind


def test_evaluation_leaves_the_global_generator_alone():
    trainer = Trainer(MLPRegressor(dropout=0.3), DataLoader(SyntheticRegression(32), batch_size=8), "1ba",
                      eval_dataloader=DataLoader(SyntheticRegression(32), batch_size=8, shuffle=True))
    before = torch.get_rng_state()
    first = trainer.eval()
    assert torch.equal(torch.get_rng_state(), before)
    assert trainer.eval() == first  # and every evaluation reads the same batches
    trainer.close()
