"""The numpy twin of the Hopper implicit-GEMM conv's producers (wgmma_conv.gather): the same
gather code runs on numpy, the 128 producer threads of a CTA in lockstep, its 16-byte copies
written into a byte model of shared memory (each chunk of a stage exactly once per slice); the
tiles are then read back the way wgmma reads them, through the kernel's own descriptors
(wgmma_plan.desc_layout and the 128-byte swizzle), and multiplied. `emulate` returns C as an
M x N matrix (tests/test_wgmma_conv.py compares it with the convolution)."""

from __future__ import annotations

import numpy as np

from gac_torch.kernels.builder import Numpy
from gac_torch.kernels.conv_gemm import Spec
from gac_torch.kernels.wgmma_conv import WindowHooks, gather
from gac_torch.kernels.wgmma_gemm import m_tile_count, tile_origin
from gac_torch.kernels.wgmma_plan import BM, ESIZE, SWIZZLE, WG, Plan, Side, desc_layout, swizzle128


class _Producers(Numpy):
    """builder.Numpy's verbs plus the producers' own (i32 math, cp16)."""

    def __init__(self, spec: Spec, flats: dict[str, np.ndarray], smem_bytes: int):
        super().__init__(WG, (0, 0, 0))
        self.spec, self.flats = spec, flats
        self.es = ESIZE[spec.a.elem]
        self.smem = np.zeros(smem_bytes // self.es, dtype=np.float64)
        self.written = np.zeros(smem_bytes // 16, dtype=np.int64)  # per 16-byte chunk

    def xor(self, x, y):
        return np.bitwise_xor(x, y)

    def to_i32(self, x):
        return x

    def i32_add(self, x, y):
        return x + y

    def inb(self, x, upper):
        return (x >= 0) & (x < upper)

    def cp16(self, which: str, dst: np.ndarray, addr: np.ndarray, ok: np.ndarray) -> None:
        vec = 16 // self.es
        flat = self.flats[which]
        dst, addr, ok = (np.broadcast_to(v, (WG,)) for v in (dst, addr, ok))
        assert (dst % 16 == 0).all() and (dst >= 0).all() and (dst + 16 <= self.smem.size * self.es).all()
        for t in range(WG):
            if ok[t]:
                assert 0 <= addr[t] and addr[t] + vec <= flat.size, f"{which}: copy outside the operand"
                assert addr[t] % vec == 0, f"{which}: a 16-byte source not 16-byte aligned"
                vals = flat[addr[t]:addr[t] + vec]
            else:
                vals = np.zeros(vec)
            self.smem[dst[t] // self.es:dst[t] // self.es + vec] = vals
            self.written[dst[t] // 16] += 1


def _read(smem: np.ndarray, base: int, side: Side, es: int, ks: int, bk: int) -> np.ndarray:
    """The rows x bk K-major tile at byte `base` as wgmma reads it: per 64-row part and K step,
    the descriptor's start, 8-row groups SBO apart, rows 128 bytes apart, swizzled."""
    out = np.zeros((side.rows, bk))
    for r0 in range(0, side.rows, 64):
        for kstep in range(bk // ks):
            off, _, sbo = desc_layout(side, es, r0, kstep)
            for r in range(min(64, side.rows - r0)):
                for kk in range(ks):
                    addr = swizzle128(base + off + (r // 8) * sbo + (r % 8) * SWIZZLE + kk * es)
                    out[r0 + r, kstep * ks + kk] = smem[addr // es]
    return out


def emulate(spec: Spec, p: Plan, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C = A @ B^T (M x N, float64 sums of the operands' values) computed from the tiles the
    producers stage; `a`, `b`: the operands' flat views."""
    nk = -(-spec.K // p.bk)
    C = np.zeros((spec.M, spec.N))
    flats = {"A": np.asarray(a, np.float64), "B": np.asarray(b, np.float64)}
    for m0 in range(0, spec.M, BM):
        for n0 in range(0, spec.N, p.bn):
            acc = np.zeros((BM, p.bn))
            for kt in range(nk):
                bld = _Producers(spec, flats, p.a.stage_bytes + p.b.stage_bytes)
                fn = gather(bld, spec, p)
                c = bld.const
                fn(bld.tid(), c(0), c(p.a.stage_bytes), c(m0), c(n0), c(kt))
                assert (bld.written == 1).all(), "a chunk of the stage copied twice or never"
                ta = _read(bld.smem, 0, p.a, bld.es, p.ks, p.bk)
                tb = _read(bld.smem, p.a.stage_bytes, p.b, bld.es, p.ks, p.bk)
                acc += ta @ tb.T
            rows, cols = min(BM, spec.M - m0), min(p.bn, spec.N - n0)
            C[m0:m0 + rows, n0:n0 + cols] = acc[:rows, :cols]
    return C


def _box(x: np.ndarray, at: list[int], box: list[int]) -> np.ndarray:
    """A TMA tiled box of `x` at `at` (both outermost first): zeros where it lies outside x."""
    out = np.zeros(box)
    src = tuple(slice(max(a, 0), min(a + n, s)) for a, n, s in zip(at, box, x.shape))
    dst = tuple(slice(s.start - a, s.stop - a) for s, a in zip(src, at))
    if all(s.stop > s.start for s in src):
        out[dst] = x[src]
    return out


def _tma_write(smem: np.ndarray, base: int, tile: np.ndarray, es: int) -> None:
    """TMA's swizzled write of a [rows][128 bytes] box at byte `base` (1024-byte aligned)."""
    for r in range(tile.shape[0]):
        for k in range(tile.shape[1]):
            smem[swizzle128(base + r * SWIZZLE + k * es) // es] = tile[r, k]


def emulate_window(spec: Spec, p: Plan, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C = A @ B^T (M x N) as the Window kernel computes it (wgmma_conv.Window): per tile and
    K slice, the boxes at the coordinates WindowHooks gives (on numpy), cut from the tensor
    maps' views with TMA's zero fill, written swizzled and read back through the kernel's
    descriptors; each tile row stored to the C row WindowHooks.rows names (>= M: dropped)."""
    win = p.window
    es = ESIZE[spec.a.elem]
    views = []
    for flat, (off, sizes, strides) in ((np.asarray(a, np.float64), win.a_view), (np.asarray(b, np.float64), win.b_view)):
        assert off + sum((n - 1) * s for n, s in zip(sizes, strides)) < flat.size, "a view past its buffer"
        views.append(np.lib.stride_tricks.as_strided(flat[off:], sizes, [s * 8 for s in strides]))
    x, w = views
    bld = Numpy(1, (0, 0, 0))
    c = bld.const
    hooks = WindowHooks(bld, win, p.bk)
    C = np.zeros((spec.M + 1, spec.N))
    tn, cl = -(-spec.N // p.bn), p.cluster
    half = p.bn // cl
    done = set()
    for u, rank in ((u, r) for u in range(p.tiles) for r in range(cl)):  # the kernel's work
        # units (cluster 2: a pair of CTAs, rank r's B half multicast to both), as _kernel does
        m0, n0, bz = (int(v[0]) for v in tile_origin(bld, c(u), tn, -(-m_tile_count(spec, hooks) // cl), cl,
                                                     c(rank), p.bn))
        assert bz == 0 and (m0, n0) not in done, "a tile twice, or past the rectangles"
        done.add((m0, n0))
        rows = [int(hooks.rows(c(m0), c(r))[0]) for r in range(BM)]
        acc = np.zeros((BM, p.bn))
        for kt in range(spec.K // p.bk):
            smem = np.zeros((p.a.stage_bytes + p.b.stage_bytes) // es)
            at_a = [int(v[0]) for v in hooks.a_coords(c(m0), c(kt))][::-1]
            _tma_write(smem, 0, _box(x, at_a, win.box(p.bk)).reshape(BM, p.bk), es)
            for r in range(cl):
                at_b = [int(v[0]) for v in hooks.b_coords(c(n0 + r * half), c(kt))][::-1]
                _tma_write(smem, p.a.stage_bytes + r * half * SWIZZLE, _box(w, at_b, [half, p.bk]), es)
            acc += _read(smem, 0, p.a, es, p.ks, p.bk) @ _read(smem, p.a.stage_bytes, p.b, es, p.ks, p.bk).T
        cols = min(p.bn, spec.N - n0)
        for r, row in enumerate(rows):  # (>= M: dropped by the store's bounds check)
            C[min(row, spec.M), n0:n0 + cols] = acc[r, :cols]
    return C[:spec.M]
