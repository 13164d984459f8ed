"""nvg.adam.OnePassAdam: torch's Adam, every group at once."""

from __future__ import annotations

import pytest
import torch

from nvg.adam import OnePassAdam


def _tensors(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(2, 48), (2, 8), (2, 32), (32,), (40, 32)]]


def _steps(opt, params, steps: range, seed: int = 1) -> None:
    """Steps with gradients of every size and an lr schedule, one tensor without a gradient at step 3."""
    g = torch.Generator().manual_seed(seed)
    for step in steps:
        for i, p in enumerate(params):
            p.grad = None if (step == 3 and i == 1) else torch.randn(p.shape, generator=g) * 10.0 ** (i - 2)
        for k, group in enumerate(opt.param_groups):
            group["lr"] = 1e-2 * (k + 1) * (0.5 + 0.1 * step)
        opt.step()


def _groups(params):
    return [{"params": [p]} for p in params]


def test_it_steps_bit_for_bit_as_torchs_adam_with_the_same_groups():
    ours, theirs = _tensors(), _tensors()
    _steps(OnePassAdam(_groups(ours), lr=1e-3), ours, range(1, 7))
    _steps(torch.optim.Adam(_groups(theirs), lr=1e-3, foreach=True), theirs, range(1, 7))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], _tensors()[0])


def test_a_state_saved_by_torchs_adam_resumes_in_it_and_back():
    """A run state written before this optimizer (train_student's RunState keeps torch's state_dict) resumes."""
    first = _tensors()
    theirs = torch.optim.Adam(_groups(first), lr=1e-3)
    _steps(theirs, first, range(1, 4))
    ours = OnePassAdam(_groups(first), lr=1e-3)
    ours.load_state_dict(theirs.state_dict())
    _steps(ours, first, range(4, 7), seed=2)
    back = torch.optim.Adam(_groups(first), lr=1e-3)
    back.load_state_dict(ours.state_dict())
    assert back.state_dict()["state"][0]["step"].item() == 6.0
    # the same gradients as the reference run from step 4 on: the moments carried over
    again = _tensors()
    ref = torch.optim.Adam(_groups(again), lr=1e-3)
    _steps(ref, again, range(1, 4))
    _steps(ref, again, range(4, 7), seed=2)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_an_update_dispatches_as_many_ops_for_a_hundred_groups_as_for_ten():
    """What it is for: the host work of an update does not grow with the groups (torch's Adam: two ops a group)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for n in (10, 100):
        params = [torch.nn.Parameter(torch.randn(5)) for _ in range(n)]
        for p in params:
            p.grad = torch.randn(5)
        opt = OnePassAdam([{"params": [p], "lr": 1e-3 * (1 + i % 3)} for i, p in enumerate(params)], lr=1e-3)
        opt.step()  # the first update creates the state
        with Count() as count:
            opt.step()
        counts[n] = count.ops
    assert counts[10] == counts[100] and sum(counts[100].values()) < 20


def test_groups_with_their_own_betas_are_refused():
    params = _tensors()
    with pytest.raises(ValueError, match="betas and eps are shared"):
        OnePassAdam([{"params": params[:2]}, {"params": params[2:], "betas": (0.8, 0.99)}], lr=1e-3)
