"""The tensor-core unit for the functional simulator: WMMA (target.Wmma) on one warp's FP
registers, bit-exact with SimX's TFR model (sim/simx/tcu/tcu_unit.cpp: FEDP<f16|bf16, fp32>):
f16/bf16 -> f32 is exact, their products are exact in f32, and every sum is one f32 rounding
in SimX's order. Only on a configuration with `tcu` (else the instruction is illegal, as on a
SimX build without the unit), and only with every thread of the warp active (the unit reads
all lanes' registers; our kernels issue it in uniform code)."""

from __future__ import annotations

import numpy as np

from .target import WMMA, Wmma

F32 = np.float32


def unpack(words: np.ndarray, elem: str) -> np.ndarray:
    """(..., ) uint32 words -> (..., 2) f32: the low half first."""
    lo, hi = words & 0xFFFF, words >> 16
    halves = np.stack([lo, hi], axis=-1).astype(np.uint32)
    if elem == "f16":
        return halves.astype(np.uint16).view(np.float16).astype(F32)
    return (halves << 16).view(F32)


def wmma(f: np.ndarray, elem: str, isa: Wmma = WMMA) -> None:
    """f: the warp's FP registers as bits, (32, 4) uint32; C in f0-f7 becomes D."""
    a = unpack(f[isa.a_base:isa.a_base + 8], elem)        # (reg, lane, half)
    b = unpack(f[isa.b_base:isa.b_base + 4], elem)
    c = f[isa.c_base:isa.c_base + 8].view(F32).copy()     # (reg, lane)
    with np.errstate(all="ignore"):
        for k in range(2):                                 # SimX's micro-op order: k outermost
            for m in range(4):
                for n in range(2):
                    ra, rb, rc = a[isa.a_reg(m, k)], b[isa.b_reg(n, k)], isa.c_reg(m, n)
                    # lane t = 2i + j of C's register takes A lanes 2i + z and B lanes 2j + z
                    i, j = np.arange(4) // 2, np.arange(4) % 2
                    acc = np.zeros(4, F32)
                    for z in range(2):
                        pa, pb = ra[2 * i + z], rb[2 * j + z]      # (lane, half)
                        p = F32(0) + pa[:, 0] * pb[:, 0]
                        p = (pa[:, 1] * pb[:, 1]).astype(F32) + p
                        acc = (p + acc).astype(F32)
                    c[rc] = (c[rc] + acc).astype(F32)
    nan = c != c
    bits = c.view(np.uint32)
    f[isa.c_base:isa.c_base + 8] = np.where(nan, np.uint32(0x7FC00000), bits)
