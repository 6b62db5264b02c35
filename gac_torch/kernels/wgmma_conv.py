"""Hopper implicit-GEMM convolution for the cuda target (sm_90a): the wgmma GEMM
(wgmma_gemm.py) with A the im2col rows of an NHWC activation, never materialised: loaded by TMA
as one box per tap (`Window`, below: stride 1 or 2, whole 128-byte channel slices per tap), else
gathered by the producer warpgroup's cp.async.

    C[m, n] = init + sum_k A[m, k] * B[n, k],   m = (n, oh, ow), n = (f), k = (kh, kw, c)

with conv_gemm.Spec's affine addressing (each operand's address linear in the iteration dims,
a fused zero padding as guards). Requirements (else None: the mma.sync implicit GEMM takes it):
f16/bf16 or tf32, no groups, the innermost K dim (c) unit-stride in A and B with an extent
that is a multiple of the 16-byte vector (VEC_BYTES), every other address coefficient a multiple of
it (16-byte aligned sources), no guard along it (a vector never straddles the padding).

Per K slice (BK = 128 bytes of K: 32 tf32, 64 f16/bf16) the 128 producer threads stage a
BM x BK tile of A and a BN x BK tile of B, K-major, in the 128-byte-swizzled layout TMA would
write (so the consumers' wgmma descriptors are the GEMM's):

  g1. thread t owns 16-byte chunk j = t % 8 of rows r0 = t / 8, r0 + 16, ... of both tiles;
      its chunk lands at row * 128 + (j ^ (row % 8)) * 16, and row % 8 = r0 % 8 for all of them
  g2. its k = kt*BK + j*VEC, delinearised once per slice into (kh, kw, c): each operand's K
      part of the address and of every padding guard
  g3. per row: the row's M (N) part, the bound checks (row inside M / N, k inside K, every
      guard inside [0, upper)); outside, cp.async's source size 0 zero-fills the chunk
  g4. the thread's copies arrive on the stage's full barrier when they land (wgmma_gemm 3b')

The consumers (wgmma_gemm 4-5) are unchanged; C and the fused epilogue's operands are addressed
through the conv's dims (wgmma_conv_text.ConvText). GAC_CONV_WGMMA_STAGES forces the depth;
GAC_CONV_WGMMA_BN the tile width (64 | 128; 256 would need setmaxnreg's registers).

Why TMA (H200 profile, main 94f1c50): the gather's 3x3 convs moved ~24 bytes per SM cycle in
both precisions (~5 TB/s of L2 -> SM over 132 SMs; 112 TFLOP/s TF32, 183 bf16), the per-thread
16-byte copies, their address math and guards on 128 threads per slice; a Window's slice is
two TMA instructions from one thread, the padding TMA's zero fill. GAC_CONV_WGMMA_TMA=0: the
gather for every conv (A/B; a code-picking switch, so part of the compile cache's key).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from gac_torch.kernels import wgmma_plan as W
from gac_torch.kernels.conv_gemm import Operand, Spec, _addr, _split
from gac_torch.kernels.wgmma_plan import BM, ESIZE, SMEM_LIMIT, ALIGN, Plan, Side

VEC_BYTES = 16
MIN_VEC = VEC_BYTES // 4  # elements in a 16-byte vector, at least (tf32)
STAGES = 6  # (cp.async: the producers wait for their copies; deeper than the TMA GEMM)
# setmaxnreg (producer, consumers) of the gather, (0, 0): none, 168 registers each. The producers'
# hoisted per-row addresses and guards (64-bit) spilled at 96 and 112 (ResNet's 3x3 convs);
# without it nothing spills with the epilogue's loads 4 accumulators at a time (ConvText). A
# Window's producer (one thread, two TMA loads per slice) takes the GEMM's 40 and gives the
# consumers 232: room for the epilogue's loads 16 accumulators at a time. (GAC_CONV_WGMMA_REGS=p,c)
REGS = (0, 0)
ROW_THREADS = 8  # producer threads per 128-byte tile row (one 16-byte chunk each)
PASS_ROWS = W.WG // ROW_THREADS  # rows the producer warpgroup stages at once


def _elem(kind: str) -> str:
    return "f32" if kind == "tf32" else kind


def _aligned(op: Operand, vec: int, skip: int, ranges: tuple[int, ...]) -> bool:
    """Every address term but dim `skip`'s (coefficient 1; unit dims move nothing), the constant
    and the view's offset are multiples of `vec`: each chunk's source is 16-byte aligned."""
    return (all(k % vec == 0 for d, k in enumerate(op.coef) if d != skip and ranges[d] > 1)
            and op.const % vec == 0 and op.offset % vec == 0)


def applies(spec: Spec) -> str | None:
    """Why the template does not take `spec` (None: it does)."""
    if spec.kind not in ("tf32", "f16", "bf16"):
        return f"kind {spec.kind}"
    e = _elem(spec.kind)
    if spec.a.elem != e or spec.b.elem != e:
        return "operand types"
    if spec.ext(spec.batch) != 1:
        return "groups"
    if 0 in (spec.M, spec.N, spec.K):
        return "empty"
    vec = VEC_BYTES // ESIZE[e]
    kc = spec.ks[-1]
    if spec.ranges[kc] % vec or spec.a.coef[kc] != 1 or spec.b.coef[kc] != 1:
        return "the innermost K dim is not a whole number of 16-byte vectors in A and B"
    if any(gc[kc] for gc, _, _ in spec.a.guards) or spec.b.guards:
        return "padding along the vector"
    if not (_aligned(spec.a, vec, kc, spec.ranges) and _aligned(spec.b, vec, kc, spec.ranges)):
        return "16-byte alignment"
    return None


def narrow(spec: Spec) -> bool:
    """Every index and address the producers form (operand spans, rows and columns past the
    last tile, k past K) fits 31 bits: their math can be i32."""
    return max(spec.a.span, spec.b.span, spec.M + BM, spec.N + 256, spec.K + 64) < 2**31


NARROW_COST = 1.15  # a 64-wide tile's time per output vs a 128-wide one's (more A per MAC: a guess)


def heuristic_bn(spec: Spec, win: Window | None = None) -> int:
    """64 or 128: the fewer rounds of persistent tiles over the SMs, times the tile's cost (a
    ResNet-50 layer-3 3x3 conv, M = 9000, N = 256: 142 wide tiles take two rounds on 132 SMs,
    284 narrow ones three of half the work). With a Window, 128 once N > 64: every N tile
    reads the tile's A again, 9 taps of it for a 3x3, and the boxes' L2 traffic, not the
    rounds, bounds those convs (H200 profile 94f1c50: ~5 TB/s of L2 -> SM at 128 x 64 in both
    precisions; an estimate, GAC_CONV_WGMMA_BN=64 to compare)."""
    if spec.N <= 64:
        return 64
    if win is not None:
        return 128
    m_tiles = -(-spec.M // BM)

    def cost(bn: int) -> float:
        rounds = -(-(m_tiles * -(-spec.N // bn)) // W.SM_COUNT_HINT)
        return rounds * bn * (NARROW_COST if bn == 64 else 1.0)

    return min((128, 64), key=cost)


@dataclass(frozen=True)
class Window:
    """A conv whose im2col rows TMA loads as tiled boxes (GAC_CONV_WGMMA_TMA). A is read as a
    5-D view x[n, h, ph, w, pc] (`a_view`: element offset of the pixel (0, 0), sizes, strides;
    4-D without ph when P = 1):
    per spatial dim, the input index r = P*v + phase (P = 1: v = r, or a strided conv's own
    rows; P = 2: a stride-2 conv's input split into row pairs, h's phase its own dim of 2, w's
    folded into the channels: pc = phase * C + c, the pixel pair's 2C channels). Output pixel o
    and tap k read r = S*o + D*k + G (S = P, or the stride already in the view's step), so
    v = o + floor((D*k + G) / P) and phase = (D*k + G) mod P. A tile's BM rows are a th x tw
    rectangle of output pixels of one image: the rows of tap (kh, kw) and channels
    [c0, c0 + BK) are one box [1, th, 1, tw, BK]; TMA fills what lies outside x (the padding,
    the rectangle past the image) with zeros and writes the box swizzled, row = pixel, the
    K-major tile wgmma reads. One box per K slice, issued by one thread. B is the 2-D
    [f, (kh, kw, c)] view `b_view`."""

    th: int
    tw: int
    tiles_h: int
    tiles_w: int
    oh: int
    ow: int
    kw: int
    c: int
    dil: tuple[int, int]  # D per spatial dim
    g0: tuple[int, int]  # G
    phases: tuple[int, int]  # P
    a_view: tuple[int, tuple[int, ...], tuple[int, ...]]  # offset, [n, h, ph, w, pc], strides
    b_view: tuple[int, tuple[int, int], tuple[int, int]]  # offset, [f, K], strides

    @property
    def m_tiles(self) -> int:
        return self.a_view[1][0] * self.tiles_h * self.tiles_w

    def box(self, bk: int) -> list[int]:
        """A's box, outermost first ([1, th, 1, tw, BK]; without the phase dim of stride 1)."""
        return [1, self.th, *([1] if self.phases[0] > 1 else []), self.tw, bk]


def _tile_shape(oh: int, ow: int) -> tuple[int, int]:
    """(th, tw), th * tw = BM: the fewest tiles (pixels past the image are computed and
    dropped), then the widest rows (longer runs of contiguous pixels per box row)."""
    shapes = [(BM // tw, tw) for tw in (128, 64, 32, 16, 8, 4, 2, 1)]
    return min(shapes, key=lambda s: -(-oh // s[0]) * -(-ow // s[1]))


def _axis(spec: Spec, do: int, dk: int) -> tuple[int, int, int, int, int] | None:
    """One spatial dim of A's view: (P, D, G, extent in v, the input's stride per r) from the
    output dim `do`, the tap dim `dk` and their padding guard, or None."""
    a, R = spec.a, spec.ranges
    guard = [(gc, g0, up) for gc, g0, up in a.guards if gc[do] or gc[dk]]
    if not guard:  # unpadded: a view stepping the output dim's own stride (a strided 1x1)
        step = a.coef[do]
        if step <= 0 or R[dk] > 1 and a.coef[dk] % step:
            return None
        d = a.coef[dk] // step if R[dk] > 1 else 0
        return 1, d, 0, R[do] + (R[dk] - 1) * d, step
    (gc, g0, upper), = guard if len(guard) == 1 else [(None, 0, 0)]
    if gc is None or sum(map(bool, gc)) > 2 or gc[do] <= 0 or a.coef[do] % gc[do]:
        return None
    s, rs = gc[do], a.coef[do] // gc[do]  # the stride, the input's step per index r
    d = gc[dk] if R[dk] > 1 else 0
    if R[dk] > 1 and a.coef[dk] != d * rs:
        return None
    if g0 % s == 0 and d % s == 0:  # every tap on the stride's grid: a view of every s-th r
        return 1, d // s, g0 // s, -(-upper // s), s * rs
    if s == 2 and upper % 2 == 0:  # row pairs (ResNet's 3x3 stride-2 convs, padding 1)
        return 2, d, g0, upper // 2, rs
    return None


def _with_taps(spec: Spec) -> Spec:
    """A 1x1 conv's spec (K = (c) alone) with two tap dims of range 1 added, so `window` reads
    it as (kh, kw, c) (the spec is only read there)."""
    if len(spec.ks) != 1:
        return spec
    nd = len(spec.ranges)

    def ext(op: Operand) -> Operand:
        return replace(op, coef=op.coef + (0, 0), guards=tuple((gc + (0, 0), g0, up) for gc, g0, up in op.guards))

    return replace(spec, ks=(nd, nd + 1, spec.ks[0]), ranges=spec.ranges + (1, 1), a=ext(spec.a), b=ext(spec.b))


def window(spec: Spec, bk: int) -> Window | None:
    """The Window of `spec` (dims (n, oh, ow) x (f) x (kh, kw, c), as implicit_gemm._match gives
    an NHWC conv), or None (the gather takes it): whole BK-channel slices per tap, strides 1 or
    2 (2 with a padding off its grid: even input sizes, dense pixels), B dense
    [f][kh][kw][c], every view 16-byte aligned (TMA)."""
    spec = _with_taps(spec)
    if len(spec.ms) != 3 or len(spec.ks) != 3 or len(spec.ns) != 1 or spec.ext(spec.batch) != 1:
        return None
    R, a, b = spec.ranges, spec.a, spec.b
    (dn, doh, dow), (dkh, dkw, dc), (df,) = spec.ms, spec.ks, spec.ns
    es = ESIZE[_elem(spec.kind)]
    C, KH, KW = R[dc], R[dkh], R[dkw]
    if C % bk or a.coef[df] or any(b.coef[d] for d in spec.ms):
        return None
    if b.coef[dc] != 1 or KW > 1 and b.coef[dkw] != C or KH > 1 and b.coef[dkh] != KW * C or b.coef[df] < spec.K:
        return None  # (B's rows: k = (kh, kw, c) flat)
    h, w = _axis(spec, doh, dkh), _axis(spec, dow, dkw)
    if h is None or w is None or w[0] == 2 and w[4] != C:
        return None  # (a w pair's channels must be one run of 2C)
    (ph, dh, gh, eh, rh), (pw, dw, gw, ew, rw) = h, w
    a_off = a.offset + a.const - gh * rh - gw * rw
    b_off = b.offset + b.const
    sizes, strides = (R[dn], eh, ph, ew, pw * C), (a.coef[dn], ph * rh, rh, pw * rw, 1)
    if ph == 1:  # (no phase dim of 1: a plain 4-D view)
        sizes, strides = sizes[:2] + sizes[3:], strides[:2] + strides[3:]
    if a_off < 0 or any(x * es % 16 for x in (a_off, b_off, b.coef[df], *strides[:-1])):
        return None
    th, tw = _tile_shape(R[doh], R[dow])
    return Window(th, tw, -(-R[doh] // th), -(-R[dow] // tw), R[doh], R[dow], KW, C, (dh, dw), (gh, gw),
                  (ph, pw), (a_off, sizes, strides), (b_off, (R[df], spec.K), (b.coef[df], 1)))


@dataclass(frozen=True)
class ConvPlan(Plan):
    window: Window | None = None  # TMA boxes instead of the gather


class WindowHooks:
    """wgmma_gemm._kernel's `conv` hook for a Window: the TMA coordinates of slice kt of the
    tile at m0 (m0 / BM: the tile's image and rectangle) and where its rows go in C. Against
    builder `b` (the text builder, or numpy's in the twin)."""

    def __init__(self, b: Any, win: Window, bk: int):
        self.b, self.w, self.bk = b, win, bk
        self.m_tiles = win.m_tiles  # (the kernel's M tiles: rectangles, not M / BM)

    def _origin(self, m0: Any) -> tuple[Any, Any, Any]:
        b, w, c = self.b, self.w, self.b.const
        per = w.tiles_h * w.tiles_w
        mt = b.div(m0, c(BM))
        rest = b.rem(mt, c(per))
        return b.div(mt, c(per)), b.mul(b.div(rest, c(w.tiles_w)), c(w.th)), b.mul(b.rem(rest, c(w.tiles_w)), c(w.tw))

    def _tap(self, o0: Any, k: Any, j: int) -> tuple[Any, Any]:
        """(v, phase) of tap index k along spatial dim j at the rectangle's origin o0: the
        floor division of D*k + G by P on a non-negative t (t + E, E a multiple of P >= -G)."""
        b, c, w = self.b, self.b.const, self.w
        p, e = w.phases[j], w.phases[j] * max(0, -(-(-w.g0[j]) // w.phases[j]))
        t = b.add(b.mul(k, c(w.dil[j])), c(w.g0[j] + e))
        if p == 1:
            return b.add(o0, b.sub(t, c(e))), c(0)
        return b.sub(b.add(o0, b.div(t, c(p))), c(e // p)), b.rem(t, c(p))

    def a_coords(self, m0: Any, kt: Any) -> list[Any]:
        """[pc, w, (ph,) h, n] (innermost first) of A's box for slice kt = (kh, kw, channel chunk)."""
        b, w, c = self.b, self.w, self.b.const
        n, oh0, ow0 = self._origin(m0)
        chunks = w.c // self.bk
        tap = b.div(kt, c(chunks))
        (h, ph), (x, pw) = self._tap(oh0, b.div(tap, c(w.kw)), 0), self._tap(ow0, b.rem(tap, c(w.kw)), 1)
        c0 = b.mul(b.rem(kt, c(chunks)), c(self.bk))
        return [c0 if w.phases[1] == 1 else b.add(b.mul(pw, c(w.c)), c0), x, *([ph] if w.phases[0] > 1 else []), h, n]

    def b_coords(self, n0: Any, kt: Any) -> list[Any]:
        return [self.b.mul(kt, self.b.const(self.bk)), n0]

    def rows(self, m0: Any, local: Any) -> Any:
        """The flat output row (n, oh, ow) of tile row `local` (a pixel past the image: M; of a
        rectangle past the last image, a cluster pair's spare: >= M; the store's bounds check
        drops both)."""
        b, w, c = self.b, self.w, self.b.const
        n, oh0, ow0 = self._origin(m0)
        oh, ow = b.add(oh0, b.div(local, c(w.tw))), b.add(ow0, b.rem(local, c(w.tw)))
        m = b.add(b.mul(b.add(b.mul(n, c(w.oh)), oh), c(w.ow)), ow)
        inside = b.and_(b.lt(oh, c(w.oh)), b.lt(ow, c(w.ow)))
        return b.select(inside, m, c(self.w.a_view[1][0] * w.oh * w.ow), "index")


def plan(spec: Spec, bn: int | None = None, stages: int | None = None,
         tma: bool | None = None) -> Plan | None:
    """The tiling (wgmma_plan.Plan: K-major A and B sides, BK = 128 bytes), or None; a ConvPlan
    with a Window (TMA boxes, see there) where `window` finds one and `tma` (default:
    GAC_CONV_WGMMA_TMA, on unless "0") allows it."""
    if applies(spec) is not None:
        return None
    es = ESIZE[_elem(spec.kind)]
    bk = W.SWIZZLE // es
    tma = os.environ.get("GAC_CONV_WGMMA_TMA") != "0" if tma is None else tma
    win = window(spec, bk) if tma else None
    bn = bn or int(os.environ.get("GAC_CONV_WGMMA_BN") or 0) or heuristic_bn(spec, win)
    if bn not in (64, 128):
        return None
    sa = Side(True, BM, (bk, BM), 1, BM * W.SWIZZLE)
    sb = Side(True, bn, (bk, bn), 1, bn * W.SWIZZLE)
    per_stage = sa.stage_bytes + sb.stage_bytes + 16
    want = stages or int(os.environ.get("GAC_CONV_WGMMA_STAGES") or 0) or STAGES
    stages = min(want, (SMEM_LIMIT - ALIGN) // per_stage)
    if stages < 2:
        return None
    # GAC_CONV_WGMMA_CLUSTER=2 (a Window; compiled and ptxas-checked, not yet run on a GPU):
    # CTA pairs on M-adjacent rectangles, each loading half of their B tile for both (TMA
    # multicast: B's L2 traffic halves; an odd rectangle count's last pair has one past the
    # image: zeros, not stored)
    cl = 2 if win and os.environ.get("GAC_CONV_WGMMA_CLUSTER") == "2" else 1
    if cl == 2:
        sb = Side(True, bn, (bk, bn // 2), 2, sb.stage_bytes)
    tiles = -(-spec.N // bn) * (-(-win.m_tiles // cl) if win else -(-spec.M // BM))
    c, n_in = spec.c, [d for d in spec.ns if spec.ranges[d] > 1]
    pair = (len(n_in) == 1 and c.coef[n_in[0]] == 1 and spec.N % 2 == 0 and c.const % 2 == 0
            and c.offset % 2 == 0 and all(k % 2 == 0 for d, k in enumerate(c.coef) if d != n_in[0]))
    regs = (tuple(int(x) for x in os.environ.get("GAC_CONV_WGMMA_REGS", "").split(",") if x)
            or ((W.PRODUCER_REGS, W.CONSUMER_REGS) if win else REGS))
    return ConvPlan(bn, bk, 8 if spec.kind == "tf32" else 16, stages, sa, sb,
                    (cl * min(tiles, W.SM_COUNT_HINT // cl), 1, 1), pair, tiles, cluster=cl, maxnreg=regs[0] > 0,
                    regs=regs, window=win)  # type: ignore[arg-type]


def gather(b: Any, spec: Spec, p: Plan) -> Any:
    """The producer threads' part of a K slice (g1-g3) as wgmma_gemm._kernel's `gather` hook,
    against builder `b` (the text builder, or the twin's numpy one): b.cp16(which, dst, addr,
    ok) copies 16 bytes from flat element `addr` of operand `which` to shared byte `dst`."""
    c, R = b.const, spec.ranges
    es = ESIZE[_elem(spec.kind)]
    vec = VEC_BYTES // es

    def fn(t: Any, a_stage: Any, b_stage: Any, m0: Any, n0: Any, kt: Any) -> None:
        j, r0 = b.rem(t, c(ROW_THREADS)), b.div(t, c(ROW_THREADS))  # g1
        chunk = b.to_i32(b.mul(b.xor(j, b.rem(r0, c(8))), c(16)))
        k = b.add(b.mul(kt, c(p.bk)), b.mul(j, c(vec)))  # g2
        ik = _split(b, k, spec.ks, R)
        ok_k = b.lt(k, c(spec.K))
        for which, op, dims, o0, ext, side, stage in (
                ("A", spec.a, spec.ms, m0, spec.M, p.a, a_stage), ("B", spec.b, spec.ns, n0, spec.N, p.b, b_stage)):
            addr_k = _addr(b, op, ik, spec.ks, c(op.const))
            guards = [(gc, _addr(b, _coef(gc), ik, spec.ks, c(g0)), upper) for gc, g0, upper in op.guards]
            for i in range(side.rows // PASS_ROWS):
                row = b.add(r0, c(i * PASS_ROWS))
                o = b.add(o0, row)  # g3
                io = _split(b, o, dims, R)
                ok = b.and_(ok_k, b.lt(o, c(ext)))
                for gc, gk, upper in guards:
                    ok = b.and_(ok, b.inb(_addr(b, _coef(gc), io, dims, gk), c(upper)))
                dst = b.i32_add(stage, b.i32_add(b.to_i32(b.mul(row, c(W.SWIZZLE))), chunk))
                b.cp16(which, dst, _addr(b, op, io, dims, addr_k), ok)

    return fn


def _coef(gc: tuple[int, ...]) -> Operand:
    return Operand("", "", gc, 0, 0, 0)
