"""The export path keeps eager semantics (issue 12 item 2): in-place updates of inputs and buffers
reach the caller / the program's buffers, view outputs alias, and outputs carry autograd."""

from __future__ import annotations

import copy

import pytest
import torch

import gac_torch
from conftest import TARGETS
from parity import device_of

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _pair(model: torch.nn.Module, inputs: tuple, target: str):
    """(eager copy, compiled program) of the model; the program updates `model`'s own buffers."""
    dev = device_of(target)
    model = model.to(dev)
    eager = copy.deepcopy(model)
    ep = torch.export.export(model, tuple(t.to(dev) if isinstance(t, torch.Tensor) else t for t in inputs))
    return eager, gac_torch.compile(ep, target=target), model


def _randn(*shape, seed=0, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


class InputMutation(torch.nn.Module):
    def forward(self, x, y):
        x.add_(y)  # the caller's x changes
        y.mul_(2.0)
        return (x * y).sum(1)


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        self.count.add_(1)
        return self.lin(x) * self.count


class KVCache(torch.nn.Module):
    """Writes this step's keys into a cache buffer; attends over everything written so far."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, k, pos, q):
        self.cache.index_copy_(0, pos, k)
        return torch.softmax(q @ self.cache.t(), dim=-1) @ self.cache


@pytest.mark.parametrize("target", TARGETS)
def test_input_mutation_reaches_the_caller(target):
    dev = device_of(target)
    x, y = _randn(3, 4, seed=1, device=dev), _randn(3, 4, seed=2, device=dev)
    eager, compiled, _ = _pair(InputMutation(), (x.clone(), y.clone()), target)
    ex, ey, gx, gy = x.clone(), y.clone(), x.clone(), y.clone()
    with torch.no_grad():
        expected = eager(ex, ey)
        got = compiled(gx, gy)
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(gx, ex, **TOL)
    torch.testing.assert_close(gy, ey, **TOL)
    assert not torch.equal(gx, x)


@pytest.mark.parametrize("target", TARGETS)
def test_buffer_counter_advances_over_calls(target):
    dev = device_of(target)
    torch.manual_seed(0)
    eager, compiled, model = _pair(Counter(), (_randn(2, 4, device=dev),), target)
    for step in range(3):
        x = _randn(2, 4, seed=10 + step, device=dev)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), eager(x), **TOL)
        assert float(model.count) == step + 1  # the program updates the exported module's buffer


@pytest.mark.parametrize("target", TARGETS)
def test_batchnorm_train_mode_running_stats(target):
    dev = device_of(target)
    torch.manual_seed(0)
    bn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).train()
    eager, compiled, model = _pair(bn, (_randn(2, 3, 6, 6, device=dev),), target)
    for step in range(3):
        x = _randn(2, 3, 6, 6, seed=20 + step, device=dev)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), eager(x), **TOL)
    for name, buf in eager.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buf, **TOL)
    assert int(model[1].num_batches_tracked) == 3


@pytest.mark.parametrize("target", TARGETS)
def test_kv_cache_buffer_written_by_index_copy(target):
    dev = device_of(target)
    pos0 = torch.tensor([0, 1], device=dev)
    example = (_randn(2, 4, device=dev), pos0, _randn(1, 4, device=dev))
    eager, compiled, model = _pair(KVCache(), example, target)
    for step in range(3):
        k, q = _randn(2, 4, seed=30 + step, device=dev), _randn(1, 4, seed=40 + step, device=dev)
        pos = torch.tensor([2 * step, 2 * step + 1], device=dev)
        with torch.no_grad():
            torch.testing.assert_close(compiled(k, pos, q), eager(k, pos, q), **TOL)
    torch.testing.assert_close(model.cache, eager.cache, **TOL)
    assert model.cache[:6].abs().min() > 0 and not model.cache[6:].any()


class Views(torch.nn.Module):
    def forward(self, x, y):
        x.mul_(3.0)
        return x, x.view(-1), x.t(), y[1], y + 1


@pytest.mark.parametrize("target", TARGETS)
def test_view_outputs_alias_their_inputs(target):
    dev = device_of(target)
    x, y = _randn(3, 4, seed=3, device=dev), _randn(3, 4, seed=4, device=dev)
    eager, compiled, _ = _pair(Views(), (x.clone(), y.clone()), target)
    ex, gx = x.clone(), x.clone()
    expected, got = eager(ex, y), compiled(gx, y)
    torch.testing.assert_close(got, expected, **TOL)
    assert got[0] is gx  # x.mul_ returns x itself
    assert got[1]._base is gx and got[2]._base is gx and got[3]._base is y
    assert got[4]._base is None
    gx.add_(1.0)  # writes through the views, as eager's
    torch.testing.assert_close(got[1], gx.view(-1))
    torch.testing.assert_close(got[3], y[1])


@pytest.mark.parametrize("target", TARGETS)
def test_outputs_require_grad_and_gradients_match_eager(target):
    dev = device_of(target)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    eager, compiled, model = _pair(mlp, (_randn(5, 4, device=dev),), target)
    x = _randn(5, 4, seed=5, device=dev)
    ex, gx = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = eager(ex), compiled(gx)
    assert got.requires_grad and got.grad_fn is not None
    torch.testing.assert_close(got, expected, **TOL)
    w = _randn(5, 2, seed=6, device=dev)
    (expected * w).sum().backward()
    (got * w).sum().backward()
    torch.testing.assert_close(gx.grad, ex.grad, **TOL)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    with torch.no_grad():
        assert not compiled(x).requires_grad


@pytest.mark.parametrize("target", TARGETS)
def test_training_dropout_backward_sees_the_forward_mask(target):
    """The backward recomputes with the forward's RNG state: the same dropout mask as eager's."""
    dev = device_of(target)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)).train()
    eager, compiled, model = _pair(net, (_randn(5, 6, device=dev),), target)
    x = _randn(5, 6, seed=7, device=dev)
    torch.manual_seed(1)
    expected = eager(x)
    torch.manual_seed(1)
    got = compiled(x)
    torch.testing.assert_close(got, expected, **TOL)
    expected.square().sum().backward()
    got.square().sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


class MutateFirst(torch.nn.Module):
    def forward(self, a, b):
        a.mul_(2)
        return a + b.sum()


ALIASED = {  # two views of one storage as two inputs, the first mutated
    "same": lambda base: (base, base),
    "transposed": lambda base: (base, base.t()),
    "overlapping_rows": lambda base: (base[:3], base[1:]),
}


@pytest.mark.parametrize("name", sorted(ALIASED))
def test_mutated_input_aliasing_another_input(name):
    """The functional graph reads every input before the write; eager's a.mul_(2) changes what
    b (a view of the same storage) reads: the compiled program returned b's old sum. It now
    notices and runs the exported program eagerly, with a warning."""
    def run(fn):
        base = _randn(4, 4)
        a, b = ALIASED[name](base)
        return fn(a, b), base

    base = _randn(4, 4)
    ep = torch.export.export(MutateFirst(), tuple(t.clone() for t in ALIASED[name](base)))
    prog = gac_torch.compile(ep)
    with pytest.warns(UserWarning, match="shares memory with another input"):
        out, after = run(prog)
    ref, ref_after = run(MutateFirst())
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(after, ref_after)


def test_disjoint_views_of_one_storage_stay_compiled():
    """Views of one storage that do not overlap (rows 0-1 and 2-3) run compiled, no warning."""
    import warnings

    base = _randn(4, 4)
    ep = torch.export.export(MutateFirst(), (base[:2].clone(), base[2:].clone()))
    prog = gac_torch.compile(ep, options={"fallback": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        out = prog(base[:2], base[2:])
    ref_base = _randn(4, 4)
    ref = MutateFirst()(ref_base[:2], ref_base[2:])
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(base, ref_base)


class SumOfViews(torch.nn.Module):
    def forward(self, a, b):
        return a * 2 + b.sum(0)


def test_views_of_one_storage_with_dynamic_dims():
    """Two column views of one tensor (non-contiguous) exported with Dim.AUTO on every dim:
    torch's run_decompositions re-traced the program's guard function on fake inputs and failed
    ("'NoneType' object has no attribute 'size'"). Now compiled, right at the example's sizes and
    at others."""
    from torch.export import Dim

    base = _randn(6, 6)
    a, b = base[:, :3], base[:, 3:]
    dims = tuple({i: Dim.AUTO for i in range(t.dim())} for t in (a, b))
    prog = gac_torch.compile(torch.export.export(SumOfViews(), (a, b), dynamic_shapes=dims))
    torch.testing.assert_close(prog(a, b), SumOfViews()(a, b))
    other = _randn(5, 8, seed=1)
    torch.testing.assert_close(prog(other[:, :4], other[:, 4:]), SumOfViews()(other[:, :4], other[:, 4:]))
