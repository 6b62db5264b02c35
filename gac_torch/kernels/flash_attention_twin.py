"""The numpy lockstep twin of kernels/flash_attention.py: the same `kernel` body run on the CPU,
one block at a time, all its threads in lockstep (every value is an array over the threads).
mma.sync is emulated from the fragment tables with the tensor cores' truncating sums (`tc_dot`),
shfl.xor by lane permutation, and every shared-memory access is checked against the barriers:
a read or write of an element another thread wrote or read since the last barrier raises
RaceError; reading an element never written or indexing outside a buffer raises AssertionError."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from gac_torch.kernels.cuda_mma import FRAG_C
from gac_torch.kernels.cuda_mma_twin import fragments_to_tiles
from gac_torch.kernels.builder import RaceError, round_to
from gac_torch.kernels.flash_attention import Plan, Spec, kernel


GUARD_BITS = 3


def tc_dot(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """C + A·B per warp ((w, 16, K) x (w, K, 8) + (w, 16, 8)) as the tensor cores add: products
    exact, each term (C too) truncated toward zero onto the grid of the largest term's 24-bit
    significand plus GUARD_BITS, the sum truncated to f32 (Fasi et al., "Numerical behavior of
    NVIDIA tensor cores", 2021). Three guard bits reproduce the drift the H200 showed on one
    mma chain over 2500 / 4096 keys (2.1e-5 / 3.2e-5 modelled, 1.8e-5 / 2.9e-5 measured)."""
    prods = a[:, :, :, None].astype(np.float64) * b[:, None, :, :]  # (w, 16, K, 8), exact
    terms = np.concatenate([c[:, :, None, :], prods], axis=2)
    big = np.abs(terms).max(axis=2, keepdims=True)
    grid = np.exp2(np.floor(np.log2(np.where(big > 0, big, 1.0))) - 23 - GUARD_BITS)
    total = (np.trunc(terms / grid) * grid).sum(axis=2)  # exact in f64
    f = total.astype(np.float32)
    return np.where(np.abs(f) > np.abs(total), np.nextafter(f, np.float32(0)), f)


class _Smem:
    def __init__(self, shape: tuple[int, ...]):
        self.data = np.full(shape, np.nan, dtype=np.float32)
        self.w_epoch = np.full(shape, -1)
        self.w_tid = np.full(shape, -1)
        self.r_epoch = np.full(shape, -1)
        self.r_tid = np.full(shape, -1)


class FlashNumpy:
    def __init__(self, spec: Spec, p: Plan, arrays: dict[str, np.ndarray], block: tuple[int, int, int]):
        self.spec, self.p, self.arr, self.block = spec, p, arrays, block
        self.T = p.threads
        self.epoch = 0
        self.S = {"K": _Smem((p.stages * p.bn, p.dp + p.pad)), "V": _Smem((p.stages * p.bn, p.dvc + p.pad))}
        if p.stages == 1:  # (two stages: Q's fragments come from global memory)
            self.S["Q"] = _Smem((p.bm, p.dp + p.pad))
        self.pending: list[tuple[str, list, np.ndarray]] = []  # cp.async copies in flight

    # scalars: arrays over the threads
    def const(self, x: int) -> np.ndarray:
        return np.full(self.T, x, dtype=np.int64)

    def fconst(self, x: float) -> np.ndarray:
        return np.full(self.T, x, dtype=np.float32)

    def tid(self) -> np.ndarray:
        return np.arange(self.T, dtype=np.int64)

    def bid(self, axis: int) -> np.ndarray:
        return self.const(self.block[axis])

    add = staticmethod(lambda x, y: x + y)
    sub = staticmethod(lambda x, y: x - y)
    mul = staticmethod(lambda x, y: x * y)
    div = staticmethod(lambda x, y: x // y)
    rem = staticmethod(lambda x, y: x % y)
    min = staticmethod(np.minimum)
    lt = staticmethod(lambda x, y: x < y)
    ge = staticmethod(lambda x, y: x >= y)
    gt = staticmethod(lambda x, y: x > y)
    and_ = staticmethod(lambda x, y: x & y)
    or_ = staticmethod(lambda x, y: x | y)
    fadd = staticmethod(lambda x, y: (x + y).astype(np.float32))

    @staticmethod
    def fsub(x, y):
        with np.errstate(invalid="ignore"):  # (-inf - -inf: NaN, as on the GPU)
            return (x - y).astype(np.float32)

    fmul = staticmethod(lambda x, y: (x * y).astype(np.float32))
    feq = staticmethod(lambda x, y: x == y)
    fgt = staticmethod(lambda x, y: x > y)

    def warp_any(self, pred: np.ndarray) -> np.ndarray:
        return np.repeat(pred.reshape(-1, 32).any(axis=1), 32)

    @staticmethod
    def cond(pred: np.ndarray, then: Callable, other: list[np.ndarray]) -> list[np.ndarray]:
        """Both sides computed (then() touches no memory), each lane taking its warp's."""
        with np.errstate(invalid="ignore"):
            vals = then()
        return [np.where(pred, v, o).astype(np.float32) for v, o in zip(vals, other)]
    fsel = staticmethod(lambda c, x, y: np.where(c, x, y).astype(np.float32))

    @staticmethod
    def fmax(x, y):
        return np.maximum(x, y).astype(np.float32)

    @staticmethod
    def fdiv(x, y):
        with np.errstate(divide="ignore", invalid="ignore"):
            return (x / y).astype(np.float32)

    @staticmethod
    def fexp2(x):
        with np.errstate(over="ignore"):
            return np.exp2(x.astype(np.float64)).astype(np.float32)

    def shfl_xor(self, x: np.ndarray, m: int) -> np.ndarray:
        return x[np.arange(self.T) ^ m]

    def _load_global(self, which: str, idx: list[np.ndarray], vec: int, ok: np.ndarray) -> np.ndarray:
        buf = self.arr[which]
        out = np.zeros((self.T, vec), dtype=np.float32)
        for i in range(vec):
            at = [np.where(ok, x, 0) for x in idx[:-1]] + [np.where(ok, idx[-1] + i, 0)]
            if ok.any():
                assert all((a[ok] < s).all() for a, s in zip(at, buf.shape)), f"{which}: load out of bounds"
            out[:, i] = np.where(ok, buf[tuple(at)], 0.0)
        return out

    def load_pair(self, which: str, idx: list[np.ndarray], ok: np.ndarray) -> np.ndarray:
        return self._load_global(which, idx, 2, ok)

    def copy_async(self, which: str, sidx: list[np.ndarray], gidx: list[np.ndarray], vec: int,
                   ok: np.ndarray) -> None:
        """cp.async: the write counts (for races) when issued; until wait_async the cells hold
        NaN, so a read of them before the copy lands fails as a read of unwritten memory."""
        val = self._load_global(which, gidx, vec, ok)
        cells = self._touch(which, sidx, vec, True)
        for at in cells:
            self.S[which].data[at] = np.nan
        self.pending.append((which, cells, val))

    def wait_async(self) -> None:
        for which, cells, val in self.pending:
            for i, at in enumerate(cells):
                self.S[which].data[at] = val[:, i]
        self.pending = []

    def _touch(self, which: str, idx: list[np.ndarray], n: int, write: bool) -> list[tuple]:
        s = self.S[which]
        tids = np.arange(self.T)
        cells = []
        for i in range(n):
            at = tuple(idx[:-1]) + (idx[-1] + i,)
            for d, (a, ext) in enumerate(zip(at, s.data.shape)):
                if ((a < 0) | (a >= ext)).any():
                    raise AssertionError(f"smem {which} index {d} out of range")
            cells.append(at)
            e = self.epoch
            if write:
                flat = np.ravel_multi_index(at, s.data.shape)
                if len(np.unique(flat)) != len(flat):
                    raise RaceError(f"smem {which}: two threads write one element in one store")
                bad = (s.r_epoch[at] == e) & (s.r_tid[at] != tids)
                bad |= (s.w_epoch[at] == e) & (s.w_tid[at] != tids)
                if bad.any():
                    raise RaceError(f"smem {which}: write races with another thread since the barrier")
                s.w_epoch[at], s.w_tid[at] = e, tids
            else:
                if ((s.w_epoch[at] == e) & (s.w_tid[at] != tids)).any():
                    raise RaceError(f"smem {which}: read of an element another thread wrote since the barrier")
                same = (s.r_epoch[at] == e) & (s.r_tid[at] != tids)
                s.r_tid[at] = np.where(same, -2, tids)
                s.r_epoch[at] = e
        return cells

    def load_smem(self, which: str, idx: list[np.ndarray], n: int) -> np.ndarray:
        cells = self._touch(which, idx, n, False)
        vals = np.stack([self.S[which].data[at] for at in cells], axis=1)
        if np.isnan(vals).any():
            raise AssertionError(f"smem {which}: read of an element never written")
        return vals if n > 1 else vals[:, 0]

    def ldmatrix(self, which: str, row: np.ndarray, col: np.ndarray, num: int, trans: bool,
                 srow: np.ndarray | None = None, roff: int = 0, coff: int = 0) -> list[np.ndarray]:
        """Lane l of each warp supplies row l % 8 of matrix l / 8 (16-byte aligned rows of 8);
        register i of lane l: matrix i's (row l/4, cols 2(l%4), +1), or transposed (rows
        2(l%4), +1; col l/4)."""
        row, col = row + roff + (0 if srow is None else srow), col + coff
        assert (col % 8 == 0).all(), "ldmatrix rows must be 16-byte aligned"
        cells = self._touch(which, [row, col], 8, False)
        rows = np.stack([self.S[which].data[at] for at in cells], axis=1)  # (T, 8)
        if np.isnan(rows).any():
            raise AssertionError(f"smem {which}: ldmatrix of an element never written")
        lane, warp = np.arange(self.T) % 32, np.arange(self.T) // 32
        out = []
        for i in range(num):
            mats = rows[warp[:, None] * 32 + 8 * i + np.arange(8)[None, :]]  # (T, 8 rows, 8 cols)
            r, cc = (2 * (lane % 4), lane // 4) if trans else (lane // 4, 2 * (lane % 4))
            if trans:
                pair = np.stack([mats[np.arange(self.T), r, cc], mats[np.arange(self.T), r + 1, cc]], axis=1)
            else:
                pair = np.stack([mats[np.arange(self.T), r, cc], mats[np.arange(self.T), r, cc + 1]], axis=1)
            out.append(pair)
        return out

    def pack_f32(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return np.stack([round_to(lo, self.spec.elem), round_to(hi, self.spec.elem)], axis=1)

    def barrier(self) -> None:
        self.epoch += 1

    def mma(self, kind: str, a: list[np.ndarray], bregs: list[np.ndarray], acc: list[np.ndarray]) -> list[np.ndarray]:
        """Per warp: rebuild the A (16xK) and B (Kx8) tiles from the lanes' registers, multiply
        in f64 (tf32: operands rounded; f32x3: big·big + big·small + small·big), scatter D."""
        At, Bt, (warp, g, t) = fragments_to_tiles(self.T, kind not in ("f16", "bf16"), a, bregs)
        nw = self.T // 32
        C = np.zeros((nw, 16, 8))
        for q, (r, cc) in enumerate(FRAG_C):
            C[warp, g + r, 2 * t + cc] = acc[q]
        if kind == "tf32":
            D = tc_dot(round_to(At, "tf32"), round_to(Bt, "tf32"), C)
        elif kind == "f32x3":  # small terms first (as the text builder issues them)
            ab, bb = round_to(At, "tf32"), round_to(Bt, "tf32")
            asm, bsm = round_to(At - ab, "tf32"), round_to(Bt - bb, "tf32")
            D = tc_dot(ab, bb, tc_dot(ab, bsm, tc_dot(asm, bb, C)))
        else:
            D = tc_dot(At, Bt, C)
        return [D[warp, g + r, 2 * t + cc].astype(np.float32) for q, (r, cc) in enumerate(FRAG_C)]

    def load_mask(self, idx: list[np.ndarray], ok: np.ndarray) -> np.ndarray:
        m = self.arr["M"]
        at = tuple(np.where(ok, x, 0) for x in idx)
        if self.spec.mask_kind == "bool":
            return np.where(ok, m[at] == 0, True)
        return np.where(ok, m[at], 0.0).astype(np.float32)

    def store_out(self, idx: list[np.ndarray], val: np.ndarray, ok: np.ndarray) -> None:
        o = self.arr["O"]
        at = tuple(x[ok] for x in idx)
        flat = np.ravel_multi_index(at, o.shape)
        assert len(np.unique(flat)) == len(flat), "two threads store one O element"
        o[at] = round_to(val[ok], self.spec.o.elem)

    def loop(self, n: np.ndarray, init: list[np.ndarray], body: Callable) -> list[np.ndarray]:
        assert (n == n[0]).all()
        state = init
        for kt in range(int(n[0])):
            state = body(self.const(kt), state)
        return state


def emulate(spec: Spec, p: Plan, q: np.ndarray, k: np.ndarray, v: np.ndarray,
            mask: np.ndarray | None = None) -> np.ndarray:
    """Run the kernel on the CPU (arrays shaped like the memrefs, dense). Returns O as f32
    holding values rounded to O's type; NaN marks an element the kernel did not write."""
    e = spec.elem
    arrays = {"Q": round_to(q, e), "K": round_to(k, e), "V": round_to(v, e),
              "O": np.full(spec.o.shape, np.nan, dtype=np.float32)}
    if mask is not None:
        arrays["M"] = mask if spec.mask_kind == "bool" else round_to(mask, spec.mask.elem)  # type: ignore[union-attr]
    for bz in range(p.grid[2]):
        for by in range(p.grid[1]):
            for bx in range(p.grid[0]):
                kernel(FlashNumpy(spec, p, arrays, (bx, by, bz)), spec, p)
    return arrays["O"]


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, mask_kind: str,
              scale: float, causal: bool) -> np.ndarray:
    """The maths in float64 (gac.attention's definition)."""
    s = np.einsum("...id,...jd->...ij", q.astype(np.float64), k.astype(np.float64)) * scale
    if mask is not None:
        s = np.where(mask != 0, s, -math.inf) if mask_kind == "bool" else s + mask
    if causal:
        L, S = s.shape[-2:]
        s = np.where(np.arange(S)[None, :] > np.arange(L)[:, None], -math.inf, s)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(m == -math.inf, 0.0, m))
    lsum = e.sum(-1, keepdims=True)
    o = np.einsum("...ij,...jc->...ic", e, v.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(lsum == 0, 0.0, o / lsum)
