"""The OpInfo checker itself (gac_torch/tools/opinfo.py compare()): it must never let a wrong
value pass — non-finite elements match eager exactly, and the fp64 tie-break is bounded."""

from __future__ import annotations

import pytest
import torch

from gac_torch.tools.opinfo import TOL, compare

INF, NAN = float("inf"), float("nan")


def t(*vals, dtype=torch.float32):
    return torch.tensor(vals, dtype=dtype)


@pytest.mark.parametrize("out,eager", [
    (-INF, INF), (INF, -INF), (123.0, -INF), (123.0, INF), (NAN, INF), (NAN, -INF),  # eager infinite
    (INF, NAN), (0.0, NAN),                                                           # eager NaN
    (NAN, 1.0), (INF, 1.0), (-INF, 3e38),                                             # eager finite
])
@pytest.mark.parametrize("with_ref", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_non_finite_must_match_exactly(out, eager, with_ref, dtype):
    # the reference agrees with eager, which makes the tie-break as lenient as it gets
    ref = t(eager, dtype=torch.float64) if with_ref else None
    assert compare(t(out, dtype=dtype), t(eager, dtype=dtype), ref) is not None, (out, eager)


@pytest.mark.parametrize("val", [INF, -INF, NAN])
def test_same_non_finite_passes(val):
    assert compare(t(1.0, val), t(1.0, val), t(1.0, val, dtype=torch.float64)) is None


def test_within_tolerance_passes_and_outside_fails():
    rtol, atol = TOL[torch.float32]
    e = t(1.0, -2.0, 0.0)
    assert compare(e + 0.9 * (atol + rtol * e.abs()), e, None) is None
    assert compare(e + 1.1 * (atol + rtol * e.abs()), e, None) is not None


def test_tie_break_accepts_the_rounded_reference():
    """Eager's own rounding is not gac's error: gac equal to the correctly rounded fp64 result
    passes even when eager is several tolerances away."""
    rtol, atol = TOL[torch.float16]
    ref = t(1000.123, 0.3337, dtype=torch.float64)
    out = ref.half()
    eager = (ref * (1 + 4 * rtol) + 4 * atol).half()
    assert compare(out, eager, None) is not None  # outside the tolerance of eager ...
    assert compare(out, eager, ref) is None       # ... but the correctly rounded value


def test_tie_break_is_bounded():
    """A wrong value is never excused by a worse eager: gac within twice the tolerance of the
    reference at most, however far eager is from it."""
    ref = t(1.0, dtype=torch.float64)
    eager = t(1.01)  # eager 0.01 off (~400 tolerances)
    assert compare(t(0.995), eager, ref) is not None  # gac 0.005 off the other way
    assert compare(t(0.99999), eager, ref) is None   # gac within the tolerance of the reference


def test_dtype_shape_and_integers():
    assert compare(t(1.0), t(1.0, dtype=torch.float16), None) is not None
    assert compare(t(1.0, 2.0), t(1.0), None) is not None
    assert compare(torch.tensor([1, 2]), torch.tensor([1, 3]), None) is not None
    assert compare(torch.tensor([True]), torch.tensor([True]), None) is None
