"""The implicit-GEMM contraction as data (conv_gemm.py): each operand's affine addressing over the
iteration dims, and the M / N / K / batch dim sets with their ranges."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gac_torch.kernels.gemm_epilogue import Epilogue


@dataclass(frozen=True)
class Operand:
    """A buffer as the kernel sees it: its memref type, and the linear address of the element at
    iteration point i: const + sum_d coef[d] * i[d], relative to `offset` in a flat view of
    `span` elements."""

    type: str
    elem: str
    coef: tuple[int, ...]  # per iteration dim (0: not used)
    const: int
    offset: int
    span: int
    # a fused zero padding: elements where some 0 <= const + sum coef[d] * i[d] < upper fails
    # read as 0 (not loaded); each guard is (coef, const, upper)
    guards: tuple[tuple[tuple[int, ...], int, int], ...] = ()

    @property
    def flat(self) -> str:
        return f"memref<{self.span}x{self.elem}, strided<[1], offset: {self.offset}>>"


def operand(type_text: str, elem: str, shape: tuple[int, ...], strides: tuple[int, ...],
            offset: int, terms: list[tuple[dict[int, int], int]], ndims: int,
            guarded: tuple[int, ...] = ()) -> Operand:
    """From a strided memref and its indexing map as linear forms ({dim: coeff}, const) per
    memref dim; `guarded` memref dims may be indexed outside [0, size) (a fused padding)."""
    coef = [0] * ndims
    const = 0
    for st, (lin, c0) in zip(strides, terms):
        for d, k in lin.items():
            coef[d] += k * st
        const += c0 * st
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + 1 if all(shape) else 1
    guards = tuple((tuple(terms[j][0].get(d, 0) for d in range(ndims)), terms[j][1], shape[j])
                   for j in guarded)
    return Operand(type_text, elem, tuple(coef), const, offset, span, guards)


@dataclass(frozen=True)
class Spec:
    kind: str  # f16 | bf16 | tf32 | f32
    ms: tuple[int, ...]  # iteration dims, outermost first
    ns: tuple[int, ...]
    ks: tuple[int, ...]
    batch: tuple[int, ...]
    ranges: tuple[int, ...]
    a: Operand
    b: Operand
    c: Operand
    fill: bool  # accumulators start from %init (a fused fill) instead of C
    epilogue: Epilogue | None = None  # the elementwise consumer of C, run in step 5 (C not stored)

    def ext(self, dims: tuple[int, ...]) -> int:
        return math.prod(self.ranges[d] for d in dims)

    @property
    def M(self) -> int:
        return self.ext(self.ms)

    @property
    def N(self) -> int:
        return self.ext(self.ns)

    @property
    def K(self) -> int:
        return self.ext(self.ks)
