"""Flat fill and row copy for Vortex: the two data-movement kernels of a zero padding (fill the
padded buffer, copy the source into its interior), instead of `loops` kernels that rebuild
every multi-dim index with divisions per element.

Fill, P[i] = value over a dense buffer of n elements; one CTA of T threads writes `per` rounds
of T consecutive elements:

  1. locate  i0 = block * per * T + thread
  2. store   for r < per: i = i0 + r * T; P[i] = value where i < n (the last CTA overhangs)

Row copy, Y[o, w] = X[o, w] (o: the outer dims, w: the innermost; any strides); a CTA copies
`rows` rows, its threads walking each row's w:

  1. locate  for q < rows: r = block * rows + q (r < R), o = r delinearised (once per row)
  2. copy    for w = thread, thread + T, ... < W: Y[o, w] = X[o, w]

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


def copy_template(outer: tuple[int, ...], width: int, rows: int, threads: int, x_type: str, y_type: str,
                  elem: str) -> str:
    """MLIR text of the row copy `@tmpl(%X, %Y, %init)` (%init unused) over memrefs of shape
    outer + (width,)."""
    from gac_torch.kernels.builder import delinearize

    R = 1
    for n in outer:
        R *= n
    grid_x = -(-R // rows)
    b = _Text("")
    b.types = {"X": x_type, "Y": y_type}
    q = b.val("%q")
    r = b.bid(0) * rows + q                                                       # 1
    row_ok = b.lt(r, b.const(R)) if R % rows else None
    pre = list(b.lines)
    del b.lines[:]
    mark = 0
    idx = delinearize(b, r, [n if n == 1 else b.const(n) for n in outer]) if outer else []
    for j in range(-(-width // threads)):                                         # 2
        w = b.tid() + j * threads if j else b.tid()

        def move(w=w) -> None:
            b.put("Y", [*idx, w], b.get("X", [*idx, w]))
        if (j + 1) * threads > width:
            b.when(b.lt(w, b.const(width)), move)
        else:
            move()
    body = b.lines[mark:]
    del b.lines[mark:]
    lines = [f"scf.for %q = {b.const(0)} to {b.const(rows)} step {b.const(1)} {{", *pre]
    lines += ([f"scf.if {row_ok} {{", *body, "}"] if row_ok is not None else body) + ["}"]
    head = [f"func.func @tmpl(%X: {x_type}, %Y: {y_type}, %init: {elem}) {{",
            "%one = arith.constant 1 : index", f"%gx = arith.constant {grid_x} : index",
            f"%nt = arith.constant {threads} : index",
            "gpu.launch blocks(%bx, %by, %bz) in (%sgx = %gx, %sgy = %one, %sgz = %one) "
            "threads(%tid, %tyy, %tzz) in (%stx = %nt, %sty = %one, %stz = %one) {"]
    return "\n".join(head + b.const_lines + lines + ["gpu.terminator", "}", "return", "}"])
