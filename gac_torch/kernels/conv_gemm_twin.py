"""The numpy twin of kernels/conv_gemm.py's implicit-GEMM kernel: `_Numpy` runs `conv_gemm.kernel`
on the CPU, all threads of a block in lockstep, shared-memory races checked at the barriers;
`emulate` runs a whole grid (tests/test_conv_gemm.py)."""

from __future__ import annotations

import numpy as np

from gac_torch.kernels import conv_gemm_streamk, gemm_epilogue
from gac_torch.kernels.cuda_mma_twin import MmaNumpy
from gac_torch.kernels.builder import Smem, round_to
from gac_torch.kernels.conv_gemm import Operand, Spec, kernel
from gac_torch.kernels.conv_gemm_plan import Plan, smem_elem


# --------------------------------------------------------------------------------------------
# builder 2: numpy, one block at a time, threads in lockstep


class _Numpy(conv_gemm_streamk.NumpyMixin, gemm_epilogue.NumpyMixin, MmaNumpy):
    def __init__(self, spec: Spec, p: Plan, A: np.ndarray, B: np.ndarray, C: np.ndarray,
                 init: float, block: tuple[int, int, int]):
        super().__init__(spec, p, A, B, C, init, block)  # type: ignore[arg-type]
        self.e = smem_elem(spec.kind)
        self.S = {w: Smem(w, (p.stages, s.rows, s.cols + s.pad)) for w, s in (("A", p.a), ("B", p.b))}
        self.groups: list[list[tuple]] = []  # committed cp.async groups, oldest first
        self.open: list[tuple] = []  # issued since the last commit

    def cp_async(self, which: str, idx: list[np.ndarray], addr: np.ndarray, vec: int, ok: np.ndarray) -> None:
        """Read now, land at a later cp_wait: the cells count as written (race check) from
        the issue on, but hold their new values only once the group completes."""
        vals = self.load_flat(which, addr, vec, ok)
        cells = self.touch(self.S[which], idx, vec, True)
        self.open.append((which, cells, vals))

    def cp_commit(self) -> None:
        self.groups.append(self.open)
        self.open = []

    def cp_wait(self, n: int) -> None:
        while len(self.groups) > n:
            for which, cells, vals in self.groups.pop(0):
                for i, at in enumerate(cells):
                    self.S[which].data[at] = vals[:, i]

    def ldmatrix(self, which: str, idx: list[np.ndarray], num: int, trans: bool) -> list[np.ndarray]:
        """Per warp, lanes 8j..8j+7 give the rows (8 elements, 16-byte aligned) of matrix j;
        lane l gets (row l // 4, cols 2 (l % 4), +1) of each, .trans: that of the transpose."""
        lane = np.arange(self.T) % 32
        assert (np.asarray(idx[-1])[lane < 8 * num] % 8 == 0).all(), "ldmatrix rows must be 16-byte aligned"
        cells = self.touch(self.S[which], idx, 8, False, lanes=lane < 8 * num)
        rows = np.stack([self.S[which].data[at] for at in cells], axis=1)  # (warps * 8 num, 8)
        if np.isnan(rows).any():
            raise AssertionError(f"smem {which}: ldmatrix of an element never written")
        mats = rows.reshape(self.T // 32, num, 8, 8)  # [warp][matrix][row][col]
        warp, g, t = np.arange(self.T) // 32, lane // 4, lane % 4
        out = []
        for j in range(num):
            m = mats[:, j].transpose(0, 2, 1) if trans else mats[:, j]
            out.append(np.stack([m[warp, g, 2 * t], m[warp, g, 2 * t + 1]], axis=1))
        return out

    def round_tf32_1(self, x: np.ndarray) -> np.ndarray:
        return round_to(x, "tf32")

    def load_flat(self, which: str, addr: np.ndarray, vec: int, ok: np.ndarray) -> np.ndarray:
        buf = self.A if which == "A" else self.B
        out = np.zeros((self.T, vec), dtype=np.float32)
        for i in range(vec):
            at = np.where(ok, addr + i, 0)
            assert ((at >= 0) & (at < buf.size)).all(), "global load out of bounds"
            out[:, i] = np.where(ok, buf[at], 0.0)
        assert not np.isnan(out).any(), f"{which}: load of an element outside the buffer's view"
        return out

    def inb(self, x: np.ndarray, upper: np.ndarray) -> np.ndarray:
        return (x >= 0) & (x < upper)

    def extract(self, val: np.ndarray, j: int, vec: int) -> np.ndarray:
        return val[:, j]

    def store_smem1(self, which: str, idx: list[np.ndarray], val: np.ndarray) -> None:
        self.store_smem(which, idx, val[:, None], 1)

    def fma(self, x: np.ndarray, y: np.ndarray, acc: np.ndarray) -> np.ndarray:
        return (x.astype(np.float64) * y + acc).astype(np.float32)  # one rounding, as fma

    def load_cflat(self, addr: np.ndarray, ok: np.ndarray) -> np.ndarray:
        return np.where(ok, self.C[np.where(ok, addr, 0)], 0.0).astype(np.float32)

    def store_cflat(self, addr: np.ndarray, val: np.ndarray, ok: np.ndarray, add: bool = False) -> None:
        at = addr[ok]
        assert ((at >= 0) & (at < self.C.size)).all(), "C store out of bounds"
        assert len(np.unique(at)) == len(at), "two threads store one C element"
        self.C[at] = round_to(val[ok] + (self.C[at] if add else 0), self.spec.c.elem)  # (add: atomic)


def _flat(arr: np.ndarray, op: Operand, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """The operand's flat view (from `offset`), holes NaN so that reading one is caught."""
    flat = np.full(op.span, np.nan, dtype=np.float32)
    view = np.lib.stride_tricks.as_strided(flat, shape, tuple(s * 4 for s in strides))
    view[...] = arr
    return flat


def emulate(spec: Spec, p: Plan, A: np.ndarray, B: np.ndarray, C: np.ndarray,
            strides: tuple[tuple[int, ...], ...], init: float = 0.0,
            epi: tuple[tuple[np.ndarray, tuple[int, ...]] | None, ...] = (),
            out: tuple[np.ndarray, tuple[int, ...]] | None = None,
            taps: tuple[tuple[np.ndarray, tuple[int, ...]], ...] = (),
            order: list[tuple[int, int, int]] | None = None, sk: dict | None = None) -> np.ndarray:
    """Run the kernel on the CPU. A, B, C are arrays shaped like the memrefs, whose strides
    (elements) are `strides`; returns C's new flat view (f32 holding values rounded to C's type),
    or with an epilogue Z's (`epi`: (array, strides) per epilogue input, None for Y; `out`: Z;
    `taps`: (array, strides) per tapped stage, written in place).
    Raises RaceError on a shared-memory race, AssertionError on out-of-range accesses.
    `order`: the blocks in the order to run them (default: the grid's, x fastest); stream-K's
    last ticket goes to the block run last. `sk`: gets the workspace ("W", "F") after the run."""
    rnd = "f32" if spec.kind in ("tf32", "f32") else spec.kind
    fa = _flat(round_to(A, rnd), spec.a, A.shape, strides[0])
    fb = _flat(round_to(B, rnd), spec.b, B.shape, strides[1])
    fc = _flat(np.asarray(C, np.float32), spec.c, C.shape, strides[2])
    ep = spec.epilogue
    fe = [None if x is None else _flat(np.asarray(x[0], np.float32), op[0], x[0].shape, x[1])
          for x, op in zip(epi, ep.inputs)] if ep is not None else []
    fz = _flat(np.asarray(out[0], np.float32), ep.out[0], out[0].shape, out[1]) if ep is not None else None
    ft = [_flat(np.asarray(x, np.float32), t[1][0], x.shape, st) for (x, st), t in zip(taps, ep.taps)] if ep else []
    nw, nf = conv_gemm_streamk.workspace(spec, p)
    ws, flags = np.full(nw, np.nan, np.float32), np.zeros(nf, np.int64)
    gx, gy, gz = p.grid
    for blk in order or [(x, y, z) for z in range(gz) for y in range(gy) for x in range(gx)]:
        k = _Numpy(spec, p, fa, fb, fc, init, blk)
        k.E, k.Z, k.taps, k.W, k.F = fe, fz, ft, ws, flags
        kernel(k, spec, p)
    if sk is not None:
        sk.update(W=ws, F=flags)
    for (x, st), f in zip(taps, ft):  # (the tapped arrays get their values)
        x[...] = np.lib.stride_tricks.as_strided(f, x.shape, tuple(4 * k for k in st))
    return fc if ep is None else fz
