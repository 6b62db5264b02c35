"""Flat fill for Vortex: P[i] = value over a dense buffer of n elements (a padding's zeros, a
max-pool's -inf), instead of a `loops` kernel that rebuilds every multi-dim index with
divisions. One CTA of T threads writes `per` rounds of T consecutive elements:

  1. locate  i0 = block * per * T + thread
  2. store   for r < per: i = i0 + r * T; P[i] = value where i < n (the last CTA overhangs)

Written against gac_torch.kernels.builder: `fill_template` is MLIR text, a `func.func
@tmpl(%P, %init)` holding one gpu.launch (backends/gpu/strategy.splice_template's form);
`emulate` runs the same body with numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gac_torch.kernels.builder import Numpy, Text


def grid(n: int, per: int, threads: int) -> int:
    return -(-n // (per * threads))


def _kernel(b: Any, n: int, per: int, threads: int) -> None:
    i0 = b.bid(0) * (per * threads) + b.tid()                              # 1
    for r in range(per):                                                   # 2
        i = i0 + r * threads if r else i0
        store = (lambda i=i: b.put("P", [i], b.init()))
        if n % (per * threads):
            b.when(b.lt(i, b.const(n)), store)
        else:
            store()


class _Text(Text):
    def __init__(self, flat: str):
        super().__init__(hoist=True)
        self.types = {"P": flat}

    def init(self) -> str:
        return self.val("%init")


def fill_template(n: int, per: int, threads: int, p_type: str, elem: str) -> str:
    """MLIR text of the kernel over memref `p_type` (dense, n elements of `elem`)."""
    flat = f"memref<{n}x{elem}>"
    b = _Text(flat)
    _kernel(b, n, per, threads)
    head = [f"func.func @tmpl(%PP: {p_type}, %init: {elem}) {{",
            "%one = arith.constant 1 : index", f"%gx = arith.constant {grid(n, per, threads)} : index",
            f"%nt = arith.constant {threads} : index",
            "gpu.launch blocks(%bx, %by, %bz) in (%sgx = %gx, %sgy = %one, %sgz = %one) "
            "threads(%tid, %tyy, %tzz) in (%stx = %nt, %sty = %one, %stz = %one) {",
            f"%P = memref.reinterpret_cast %PP to offset: [0], sizes: [{n}], strides: [1] : {p_type} to {flat}"]
    return "\n".join(head + b.const_lines + b.lines + ["gpu.terminator", "}", "return", "}"])


class _Numpy(Numpy):
    def __init__(self, threads: int, block: int, buf: np.ndarray, value: float):
        super().__init__(threads, (block, 0, 0))
        self.bufs, self.S, self.value = {"P": buf}, {}, value

    def init(self) -> np.ndarray:
        return np.full(self.T, self.value, self.bufs["P"].dtype)


def emulate(n: int, per: int, threads: int, value: float, buf: np.ndarray) -> np.ndarray:
    """The kernel on the CPU over a flat array of n elements; returns it."""
    out = np.array(buf).reshape(-1)
    for block in range(grid(n, per, threads)):
        _kernel(_Numpy(threads, block, out, value), n, per, threads)
    return out
