"""count_host_syncs counts every call that would wait for a GPU, and nothing that would not."""

import torch

from smalti.testing.host_sync import count_host_syncs


def test_counts_each_host_read_copy_and_data_dependent_shape_once():
    x = torch.randn(6, requires_grad=True)
    y = (x * 2).sum()
    calls = [
        ("item", lambda: y.item()), ("float", lambda: float(y)), ("int", lambda: int(y.detach())),
        ("bool", lambda: bool(y > 0)), ("tolist", lambda: x.detach().tolist()), ("cpu", lambda: x.cpu()),
        ("to(cpu)", lambda: x.to("cpu")), ("to(cpu)", lambda: x.to(torch.device("cpu"))),
        ("numpy", lambda: x.detach().numpy()), ("repr", lambda: repr(y)), ("format", lambda: f"{y:.3f}"),
        ("nonzero", lambda: torch.nonzero(x)), ("index", lambda: x[x > 0]),
        ("bincount", lambda: torch.bincount(torch.tensor([0, 2]), minlength=3)),
        ("repeat_interleave", lambda: torch.repeat_interleave(torch.tensor([1, 2]))),
        ("equal", lambda: torch.equal(x, x)),
    ]
    for op, call in calls:
        with count_host_syncs() as syncs:
            call()
        assert [s.op for s in syncs.syncs] == [op], (op, syncs.report())
        assert "test_host_sync.py" in syncs.syncs[0].where  # the caller's line, not torch's


def test_device_side_work_is_not_counted():
    x = torch.randn(4, 8, requires_grad=True)
    with count_host_syncs() as syncs:
        loss = torch.nn.functional.linear(x, torch.randn(3, 8)).relu().mean()
        loss.backward()
        x.grad[torch.arange(2), torch.tensor([0, 1])] -= 1.0  # integer indices: a known shape
        torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([1, 2]), output_size=3)
        x.detach().to(torch.float64).sum()
        torch.zeros(3).scatter_add_(0, torch.tensor([0, 0, 2]), torch.ones(3))
    assert syncs.count == 0, syncs.report()
