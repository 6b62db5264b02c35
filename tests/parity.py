"""Parity helpers: compile a function with gac (strict: nothing may fall back) and compare it
with eager PyTorch on the same fresh random inputs."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

import gac_torch

# Tolerances per dtype (rtol, atol). fp32 is looser than assert_close's default because gac
# reassociates reductions and uses its own transcendental expansions; we compare against an
# fp64 reference for float inputs so the bound measures our error, not eager's. Where eager's
# rounding differs by target, gac rounds once on every target: a Python scalar next to an
# f16/bf16 tensor stays f32 (as CUDA eager; CPU eager rounds it first for add/sub), and an f16
# conv2d with bias is rounded once (CUDA eager rounds the conv, then the bias add): 1 ulp apart
# from CUDA eager there, inside these bounds.
TOL = {
    torch.float32: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-9),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


class Fn(torch.nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def device_of(target: str) -> str:
    return "cuda" if target == "cuda" else "cpu"


def reference(fn: Callable, inputs: Sequence[torch.Tensor]):
    """Eager result; float ops run in fp64 and are rounded to the eager dtype. Ops eager lacks on
    a device (e.g. int64 matmul on CUDA) are computed on the CPU."""
    try:
        eager = fn(*inputs)
    except (NotImplementedError, RuntimeError):
        if all(not isinstance(t, torch.Tensor) or t.device.type == "cpu" for t in inputs):
            raise
        return reference(fn, [t.cpu() if isinstance(t, torch.Tensor) else t for t in inputs])
    if not any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in inputs):
        return eager
    wide = [t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    try:
        ref = fn(*wide)
    except RuntimeError:
        return eager
    return _cast_like(ref, eager)


def _cast_like(ref, eager):
    if isinstance(eager, torch.Tensor):
        return ref.to(eager.dtype) if eager.is_floating_point() else eager
    return type(eager)(_cast_like(r, e) for r, e in zip(ref, eager, strict=True))


def assert_close(out, ref, what: str = ""):
    if isinstance(ref, (tuple, list)):
        assert isinstance(out, (tuple, list)) and len(out) == len(ref), what
        for o, r in zip(out, ref, strict=True):
            assert_close(o, r, what)
        return
    assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype} != {ref.dtype}"
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
    rtol, atol = TOL.get(ref.dtype, (0, 0))
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=rtol, atol=atol, equal_nan=True, msg=what or None)


def check_op(fn: Callable, inputs: Sequence[torch.Tensor], target: str = "cpu", what: str = ""):
    dev = device_of(target)
    inputs = [t.to(dev) if isinstance(t, torch.Tensor) else t for t in inputs]
    compiled = gac_torch.compile(Fn(fn), tuple(inputs), target=target, options={"fallback": False})
    assert compiled.report.compiled == compiled.report.total, compiled.report.summary()
    out = compiled(*inputs)
    assert_close(out, reference(fn, inputs), what)
    return compiled
