"""Vortex tensor-core GEMM: C[b, m, n] = init + sum_k A[b, m, k] * B[b, k, n], A and B f16 or
bf16, C f32, through the TCU's WMMA (an 8x4 f32 tile += 8x8 @ 8x4 per instruction on a 4-thread
warp; the ISA facts come in as `isa`, backends/vortex/target.Wmma).

A CTA of WM x WN warps computes an (8 WM) x (4 WN) tile of C, one 8x4 tile per warp:

  1. locate   block (bx, by, bz) -> tile origin and batch index; warp -> its 8x4 tile; lane l ->
              the rows / columns its fragment registers hold (Wmma's lane map). Rows and columns
              past the matrix are clamped: they only feed outputs that are not stored
  2. init     the 8 accumulators = init (a fused fill) or C
  3. K steps  k0 = 0, 8, ...: each lane loads its 8 A and 4 B words (pairs of consecutive k,
              the lower k in the low half): one 32-bit load where the pair is contiguous and
              4-byte aligned (k innermost with stride 1, even offset and strides), else two
              16-bit loads; one WMMA. A K that is not a multiple of 8 ends with a step whose
              elements past K read 0 (clamped address + select: no branch)
  4. store    C = the accumulators, guarded where the tile overhangs the matrix; with an
              epilogue (gemm_epilogue: the rounding to f16/bf16, bias, ReLU, ...) C's elementwise
              consumers run on them and store their output instead

A contiguous pair is two 16-bit loads, the first marked 4-byte aligned, which LLVM combines
into one 32-bit load; alignment is decided from the memref's strides and offset (`Layout`).
Every WMMA runs with the whole warp active (uniform control flow up to the store guards), as
the unit requires. Subscripts as in vortex_gemm (GemmShape), with one plain K dim. The
functional simulator models the unit bit-exactly (backends/vortex/sim_tcu), so the kernel is
tested there as on SimX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from gac_torch.kernels import gemm_epilogue
from gac_torch.kernels.builder import Text
from gac_torch.kernels.conv_gemm import _addr
from gac_torch.kernels.conv_gemm import _split as _split_flat
from gac_torch.kernels.vortex_gemm import Fused, GemmShape, _split, _subscripts, template_head


@dataclass(frozen=True)
class Layout:
    """Element strides (one per subscript) and offset of an operand's memref."""

    strides: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class TcuGemm:
    shape: GemmShape
    a: Layout
    b: Layout
    elem: str          # "f16" | "bf16": A's and B's element type
    wm: int            # warps along M and N of a CTA
    wn: int

    @property
    def bm(self) -> int:
        return 8 * self.wm

    @property
    def bn(self) -> int:
        return 4 * self.wn

    def grid(self) -> tuple[int, int, int]:
        s = self.shape
        return (-(-s.N // self.bn), -(-s.M // self.bm), math.prod(s.batch))

    def pairs(self, which: str) -> bool:
        """Whether every k-pair of the operand is one aligned 32-bit word."""
        s, lay = self.shape, (self.a if which == "A" else self.b)
        dims = s.a_dims if which == "A" else s.b_dims
        kpos = dims.index(s.k_dims[0])
        return (lay.strides[kpos] == 1 and lay.offset % 2 == 0
                and all(st % 2 == 0 for p, st in enumerate(lay.strides) if p != kpos))


def supported(s: GemmShape) -> bool:
    """One plain K dim and plain subscripts (matmuls, batched matmuls; not convolutions)."""
    plain = all(not isinstance(d, tuple) for d in (*s.a_dims, *s.b_dims, *s.c_dims))
    return plain and len(s.k_dims) == 1 and s.k_dims[0] in s.a_dims and s.k_dims[0] in s.b_dims


def choose(shape: GemmShape, a: Layout, b: Layout, elem: str, warps: int) -> TcuGemm:
    """The warp grid of the CTA wasting the fewest tile elements (then the squarer one)."""
    best = None
    for wm in (w for w in range(1, warps + 1) if warps % w == 0):
        wn = warps // wm
        waste = (-(-shape.M // (8 * wm)) * 8 * wm) * (-(-shape.N // (4 * wn)) * 4 * wn)
        key = (waste, abs(8 * wm - 4 * wn))
        if best is None or key < best[0]:
            best = (key, wm, wn)
    return TcuGemm(shape, a, b, elem, best[1], best[2])


class _Text(gemm_epilogue.TextMixin, Text):
    def __init__(self, g: TcuGemm, ep: Fused | None):
        super().__init__(hoist=True)
        s = g.shape
        self.spec = ep
        self.types = {"A": s.a_type, "B": s.b_type, "C": s.c_type}

    def pair(self, which: str, idx: list[Any], elem: str, lay: Layout) -> Any:
        """Elements k, k + 1 (contiguous, the first 4-byte aligned) as one 32-bit word: two
        16-bit loads from a 2-element view at the pair (one base pointer, offsets 0 and 2
        bytes), the first marked aligned: LLVM's load combining makes them one 32-bit load."""
        e: Any = self.const(lay.offset)
        for x, st in zip(idx, lay.strides):
            if st:
                e = e + (x * st if st != 1 else x)
        view, lo, hi = self.fresh(), self.fresh(), self.fresh()
        vt = f"memref<2x{elem}, strided<[1], offset: ?>>"
        self.w(f"{view} = memref.reinterpret_cast %{which} to offset: [{e}], sizes: [2], strides: [1] "
               f": {self.types[which]} to {vt}")
        self.w(f"{lo} = memref.load {view}[{self.const(0)}] {{alignment = 4}} : {vt}")
        self.w(f"{hi} = memref.load {view}[{self.const(1)}] : {vt}")
        words = [self.cast("arith.extui", self.cast("arith.bitcast", h, elem, "i16"), "i16", "i32") for h in (lo, hi)]
        return self.bits("arith.ori", words[0], self.bits("arith.shli", words[1], self.const(16, "i32")))

    def single(self, which: str, idx: list[Any], elem: str) -> Any:
        """One element's bits, zero-extended to 32."""
        h = self.cast("arith.bitcast", self.get(which, idx), elem, "i16")
        return self.cast("arith.extui", h, "i16", "i32")

    def bits(self, op: str, x: Any, y: Any) -> Any:
        return self.binop(op, x, y, "i32")

    def wmma(self, asm: tuple[str, str], a: list[Any], b: list[Any], acc: list[Any]) -> list[Any]:
        """One WMMA: A's 8 and B's 4 words, the 8 accumulators (physical order) -> new ones."""
        ins = [self.cast("arith.bitcast", x, "i32", "f32") for x in a + b]
        r, st = self.fresh(), "!llvm.struct<(" + ", ".join(["f32"] * 8) + ")>"
        self.w(f'{r} = llvm.inline_asm has_side_effects "{asm[0]}", "{asm[1]}" '
               f'{", ".join(ins + list(acc))} : ({", ".join(["f32"] * 20)}) -> {st}')
        out = []
        for i in range(8):
            x = self.fresh()
            self.w(f"{x} = llvm.extractvalue {r}[{i}] : {st}")
            out.append(x)
        return out


def _kernel(b: _Text, g: TcuGemm, isa: Any, fused_fill: bool, ep: Fused | None) -> None:
    s, c = g.shape, b.const
    kdim = s.k_dims[0]
    tid, bx, by, bz = b.tid(), b.bid(0), b.bid(1), b.bid(2)
    lane, warp = tid % 4, tid // 4
    half, par = lane // 2, lane % 2
    m0, n0 = by * g.bm + (warp // g.wn) * 8, bx * g.bn + (warp % g.wn) * 4
    batch: dict[int, Any] = {}
    rest = bz
    for j in range(len(s.batch) - 1, 0, -1):          # the batch index, last fastest
        batch[s.batch_dims[j]] = rest % s.batch[j]
        rest = rest // s.batch[j]
    if s.batch:
        batch[s.batch_dims[0]] = rest
    m_over, n_over = s.M % g.bm != 0, s.N % g.bn != 0

    def clamp(x: Any, over: bool, extent: int) -> tuple[Any, Any]:
        return (b.min_(x, c(extent - 1)), x < extent) if over else (x, None)

    # 1. locate: A / C rows 2m + l/2, B columns 2n + l/2, C columns 2n + l%2
    rows = [clamp(m0 + (2 * m) + half, m_over, s.M) for m in range(4)]
    bcols = [clamp(n0 + (2 * n) + half, n_over, s.N)[0] for n in range(2)]
    ccols = [clamp(n0 + (2 * n) + par, n_over, s.N) for n in range(2)]
    row_names = [_split(b, s.m_dims, s.m_ext, r) for r, _ in rows]

    def at(which: str, names: dict[int, Any]) -> tuple[str, list[Any], int]:
        """The operand's subscripts at `names` (k's position left to fill in)."""
        dims = s.a_dims if which == "A" else s.b_dims
        return which, _subscripts(b, dims, {**batch, **names, kdim: c(0)}), dims.index(kdim)

    a_at = [at("A", row_names[m]) for m in range(4)]
    b_at = [at("B", _split(b, s.n_dims, s.n_ext, col)) for col in bcols]
    klane = par * 2

    def word(where: tuple[str, list[Any], int], kk: Any, tail: bool) -> Any:
        """The k-pair (kk, kk + 1) at one operand row / column as a 32-bit word."""
        which, subs, kpos = where
        if g.pairs(which) and not tail:
            return b.pair(which, subs[:kpos] + [kk] + subs[kpos + 1:], g.elem, g.a if which == "A" else g.b)
        halves = []
        for q in range(2):
            k = kk + q if q else kk
            ok = None
            if tail:
                ok, k = k < s.K, b.min_(k, c(s.K - 1))
            h = b.single(which, subs[:kpos] + [k] + subs[kpos + 1:], g.elem)
            halves.append(b.select(ok, h, b.const(0, "i32"), "i32") if ok is not None else h)
        return b.bits("arith.ori", halves[0], b.bits("arith.shli", halves[1], b.const(16, "i32")))

    def step(k0: Any, acc: list[Any], tail: bool) -> list[Any]:
        a_regs, b_regs = [None] * 8, [None] * 4
        for k in range(2):
            kk = k0 + (4 * k) + klane
            for m in range(4):
                a_regs[isa.a_reg(m, k)] = word(a_at[m], kk, tail)
            for n in range(2):
                b_regs[isa.b_reg(n, k)] = word(b_at[n], kk, tail)
        return b.wmma(isa.asm(g.elem), a_regs, b_regs, acc)

    # 2. init (physical register order: acc[c_reg(m, n)])
    acc: list[Any] = [None] * 8
    for m in range(4):
        for n in range(2):
            if fused_fill:
                v = b.val("%init")
            else:
                names = {**batch, **row_names[m], **_split(b, s.n_dims, s.n_ext, ccols[n][0])}
                v = b.get("C", _subscripts(b, s.c_dims, names))
            acc[isa.c_reg(m, n)] = v
    # 3. K steps: full ones in a loop, then the tail
    full = s.K // 8 * 8
    if full:
        acc = b.for_(c(0), c(full), c(8), acc, ["f32"] * 8, lambda k0, part: step(k0, part, False))
    if s.K % 8:
        acc = step(c(full), acc, True)
    # 4. store (with an epilogue: C's elementwise consumers run on the value, gemm_epilogue)
    for m in range(4):
        for n in range(2):
            col, cok = ccols[n]
            names = {**batch, **row_names[m], **_split(b, s.n_dims, s.n_ext, col)}
            oks = [x for x in (rows[m][1], cok) if x is not None]
            ok = (oks[0] & oks[1] if len(oks) == 2 else oks[0]) if oks else None
            val = acc[isa.c_reg(m, n)]
            if ep is not None:
                dims = tuple(names)
                addr = _addr(b, ep.c, names, dims, c(ep.c.const))
                gemm_epilogue.store(b, ep, addr, val, ok if ok is not None else b.true(), _split_flat, _addr,
                                    lambda op, names=names, dims=dims: _addr(b, op, names, dims, c(op.const)))
                continue

            def store(names: dict = names, val: Any = val) -> None:
                b.put("C", _subscripts(b, s.c_dims, names), val)
            if ok is not None:
                b.when(ok, store)
            else:
                store()


def template(g: TcuGemm, isa: Any, fused_fill: bool, ep: Fused | None = None) -> str:
    """MLIR text: `func.func @tmpl(%A, %B, %C, [E<k>..., Z,] %init)` holding one gpu.launch (the
    form gac_torch.backends.gpu.strategy.splice_template wires into a graph). `ep`: C's
    consumers run in the store step (their buffers follow %C, as in vortex_gemm)."""
    b = _Text(g, ep)
    _kernel(b, g, isa, fused_fill, ep)
    head = template_head(g.shape, g.grid(), 4 * g.wm * g.wn, ep)
    return "\n".join(head + b.const_lines + b.lines + ["gpu.terminator", "}", "return", "}"])


def reference(a: np.ndarray, b: np.ndarray, init: np.ndarray | float = 0.0) -> np.ndarray:
    """The math in float64: init + A @ B (f16/bf16 products are exact; the unit's f32 sums
    differ from it by f32 rounding only)."""
    return np.asarray(init, np.float64) + np.matmul(a.astype(np.float64), b.astype(np.float64))
