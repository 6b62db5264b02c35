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
from gac_torch.kernels.wgmma_conv import gather
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
