"""The numpy lockstep twin of the mma.sync GEMM template (cuda_mma.py): `MmaNumpy` runs
`cuda_mma.kernel` on the CPU, all threads of a block in lockstep, emulating mma.sync from the
fragment tables and checking shared-memory races at the barriers; `emulate` runs a whole grid."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gac_torch.kernels.builder import Numpy, Smem, round_to
from gac_torch.kernels.cuda_mma import (
    FRAG_A8, FRAG_A16, FRAG_B8, FRAG_B16, FRAG_C, Plan, Spec, elem_of, kernel,
)



def fragments_to_tiles(T: int, k8: bool, a: list[np.ndarray], bregs: list[np.ndarray]):
    """Per warp of a T-thread block, the A (16xK) and B (Kx8) tiles of one mma.sync rebuilt from
    the lanes' fragment registers (K = 8: tf32, else 16: f16/bf16 pairs), checked to cover the
    tiles; with each thread's (warp, g, t) for scattering C/D back through FRAG_C."""
    lane, warp = np.arange(T) % 32, np.arange(T) // 32
    g, t = lane // 4, lane % 4
    K, nw = (8 if k8 else 16), T // 32
    At = np.full((nw, 16, K), np.nan)
    Bt = np.full((nw, K, 8), np.nan)
    if k8:
        for e, (r, cc) in enumerate(FRAG_A8):
            At[warp, g + r, t + cc] = a[e]
        for e, kk in enumerate(FRAG_B8):
            Bt[warp, t + kk, g] = bregs[e]
    else:
        for e, (r, cc) in enumerate(FRAG_A16):
            for h in range(2):
                At[warp, g + r, 2 * t + cc + h] = a[e][:, h]
        for e, kk in enumerate(FRAG_B16):
            for h in range(2):
                Bt[warp, 2 * t + kk + h, g] = bregs[e][:, h]
    assert not np.isnan(At).any() and not np.isnan(Bt).any(), "fragments do not cover the tile"
    return At, Bt, (warp, g, t)


class MmaNumpy(Numpy):
    def __init__(self, spec: Spec, p: Plan, A: np.ndarray, B: np.ndarray, C: np.ndarray,
                 init: float, block: tuple[int, int, int]):
        super().__init__(p.threads, block)
        self.spec, self.p = spec, p
        self.A, self.B, self.C, self.initv = A, B, C, init
        self.e = elem_of(spec)
        self.S = {w: Smem(w, (2, s.rows, s.cols + s.pad)) for w, s in (("A", p.a), ("B", p.b))}

    def load_global(self, which: str, idx: list[np.ndarray], vec: int, ok: np.ndarray) -> np.ndarray:
        buf = self.A if which == "A" else self.B
        out = np.zeros((self.T, vec), dtype=np.float32)
        for i in range(vec):
            at = [np.where(ok, x, 0) for x in idx[:-1]] + [np.where(ok, idx[-1] + i, 0)]
            if ok.any():
                assert all((a[ok] < s).all() for a, s in zip(at, buf.shape)), "global load out of bounds"
            out[:, i] = np.where(ok, buf[tuple(at)], 0.0)
        return out

    def round_tf32(self, val: np.ndarray, vec: int) -> np.ndarray:
        return round_to(val, "tf32")

    def store_smem(self, which: str, idx: list[np.ndarray], val: np.ndarray, vec: int) -> None:
        for i, at in enumerate(self.touch(self.S[which], idx, vec, True)):
            self.S[which].data[at] = val[:, i]

    def load_smem(self, which: str, idx: list[np.ndarray], vec: int) -> np.ndarray:
        cells = self.touch(self.S[which], idx, vec, False)
        vals = np.stack([self.S[which].data[at] for at in cells], axis=1)
        if np.isnan(vals).any():
            raise AssertionError(f"smem {which}: read of an element never written")
        return vals if vec > 1 else vals[:, 0]

    def pack(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return np.stack([lo, hi], axis=1)

    def mma(self, kind: str, a: list[np.ndarray], bregs: list[np.ndarray], acc: list[np.ndarray]) -> list[np.ndarray]:
        """mma.sync per warp: rebuild the A (16xK) and B (Kx8) tiles from the lanes' registers
        with the fragment tables, multiply in f64, scatter D back the same way."""
        At, Bt, (warp, g, t) = fragments_to_tiles(self.T, kind == "tf32", a, bregs)
        D = At @ Bt
        out = []
        for q, (r, cc) in enumerate(FRAG_C):
            out.append((acc[q] + D[warp, g + r, 2 * t + cc]).astype(np.float32))
        return out

    def init_f32(self) -> np.ndarray:
        return np.full(self.T, self.initv, dtype=np.float32)

    def load_c(self, idx: list[np.ndarray], ok: np.ndarray) -> np.ndarray:
        at = tuple(np.where(ok, x, 0) for x in idx)
        return np.where(ok, self.C[at], 0.0).astype(np.float32)

    def store_c(self, idx: list[np.ndarray], val: np.ndarray, ok: np.ndarray) -> None:
        at = tuple(x[ok] for x in idx)
        flat = np.ravel_multi_index(at, self.C.shape)
        assert len(np.unique(flat)) == len(flat), "two threads store one C element"
        self.C[at] = round_to(val[ok], self.spec.c.elem)

    def loop(self, n: int, accs: list[np.ndarray], body: Callable) -> list[np.ndarray]:
        return self.for_(0, n, 1, accs, ["f32"] * len(accs), body)


def emulate(spec: Spec, p: Plan, A: np.ndarray, B: np.ndarray, C: np.ndarray,
            init: float = 0.0) -> np.ndarray:
    """Run the kernel on the CPU; A, B, C are arrays shaped like the memrefs (offset 0, dense).
    Returns the new C (f32 array holding values rounded to C's type). Raises RaceError on a
    shared-memory race, AssertionError on out-of-range or unwritten accesses."""
    assert all(o.offset == 0 for o in (spec.a, spec.b, spec.c))
    A = round_to(A, spec.a.elem if spec.kind != "tf32" else "f32")
    B = round_to(B, spec.b.elem if spec.kind != "tf32" else "f32")
    C = np.array(C, dtype=np.float32)
    for bz in range(p.grid[2]):
        for by in range(p.grid[1]):
            for bx in range(p.grid[0]):
                kernel(MmaNumpy(spec, p, A, B, C, init, (bx, by, bz)), spec, p)
    return C
