"""Flash attention for the cuda target: O = softmax(Q Kᵀ · scale + mask) V without the score
matrix in memory (FlashAttention-2's schedule on warp-level `mma.sync`, sm_80+).

  kinds  f16 / bf16   Q Kᵀ and P V on m16n8k16 (P rounded to the operand type), f32 accumulators
         tf32         m16n8k8 on operands rounded with cvt.rna (when TF32 is allowed)
         f32x3        exact-f32 mode: each f32 operand split into tf32 big + small parts and
                      a·b ≈ a_big·b_big + a_big·b_small + a_small·b_big (three m16n8k8 per
                      product; error at f32 level, as CUTLASS's 3xTF32)
  masks  none | add (q's type, broadcast dims of size 1) | bool (i8, nonzero keeps); causal
         hides key j > query i; a row with every key hidden gives 0.

One CTA of W warps owns BM = 16·W·MT query rows of one batch index and one DVC-wide chunk of
the output columns (Dv > 128 takes several chunks: Q Kᵀ is recomputed per chunk so the O
accumulators stay at most 64 registers a m-tile). Each warp owns MT m-tiles of 16 rows (MT = 2,
f16/bf16 only, as FA2's 32 rows a warp: every K and V fragment then serves two mma). Lane l of
warp w: g = l / 4, t = l % 4; it owns query rows r0 = m0 + 16(MT·w + m) + g and r0 + 8 of
m-tile m (FRAG_C of cuda_mma).

  1. locate     block -> (query tile m0, column chunk c0, batch index); warp, g, t
  2. stage      cp.async of Q's BM x D tile and the first K tile into shared memory (zero
                outside L, S and D; no register round trip), wait, barrier. Two stages (f16/bf16,
                D <= 64, where Q's fragments live in registers anyway): the fragments load
                straight from global memory, and cp.async of K and V's first tile
  3. for each key tile n0 (BN keys; causal: only tiles with a key <= the block's last row; the
     last tile is peeled: it alone masks keys past S and fetches no next K). One K and one V
     buffer, FA2's order: V(n0) loads during 3b-3d, K(n0 + BN) during 3e-3f. Two stages (K and
     V buffers of 2·BN rows; tile n0 in rows (n0 / BN % 2)·BN..): K and V (n0 + BN) load during
     the whole of tile n0, one barrier a tile (3a; no 3e)
     3a. wait      K(n0) landed (and every warp is done with V(n0 - BN)): barrier, V(n0) starts.
                   Two stages: K and V (n0) landed, every warp done with tile n0 - BN: barrier,
                   K and V (n0 + BN) start into the other stage
     3b. S = Q Kᵀ  per k-step, A fragments of Q (loaded once before the loop where D <= 64,
                   but for f32x3) and B fragments of K from shared memory (f16/bf16:
                   ldmatrix x4, two fragments an instruction); S 16 x BN per warp, f32 accumulators
     3c. mask      s = s·scale (+ mask | -inf where a bool mask is false), -inf where causal
                   hides it or the key is past S; kept in base 2 (times log2 e) for exp2
     3d. row max   over the lane's values (unscaled where no additive mask: the scale then
                   goes into one fma per score), then the quad (shfl.xor 1, 2); m_new =
                   max(m, tile max) (0 where it is -inf)
     3e. wait      V(n0) landed (every warp done with K(n0)): barrier; K(n0 + BN) starts
     3f. O += P V  corr = exp2(m - m_new); O *= corr (f16/bf16: only where a row max of the warp
                   grew by more than RESCALE = 8 log2 units, a warp-uniform branch: else the old
                   max stays, p <= 2^8, and the tile skips O's multiplies); then per k-step of
                   16 keys (8: tf32) its p = exp2(s - m_new) (ex2.approx.ftz) and its mma, so
                   that the exponentials
                   (MUFU) of one k-step overlap the mma (tensor pipe) of the one before (they
                   came before the barrier: each warp then ran MUFU and the tensor pipe in
                   turn); the lane's partial row sums l = l·corr + Σp.
                   P stays in registers: the S accumulator layout is the A fragment layout
                   of the next mma (f16/bf16: S n-tiles 2kk, 2kk+1 make k-step kk; tf32: keys
                   permuted inside each 8-key step, k-index t <-> key 2t, t+4 <-> 2t+1, and V's
                   B fragments are read with the same permutation); f16/bf16 read V's B
                   fragments with ldmatrix.trans. f32x3: the tile's P V goes into fresh
                   accumulators and O = O·corr + them in fmas (the tensor cores truncate as
                   they add: one mma chain over every key drifted to 2e-5 at S = 4096)
  4. finish     l summed over the quad; O · (1 / l) (0 where l == 0), rounded to O's type, stored

The body (`kernel`) is written once against a builder with cuda_mma's verbs plus float ones:
`FlashText` in flash_attention_text.py emits the MLIR (`template`: a `func.func @tmpl(%Q, %K, %V,
[%M,] %O)` holding one gpu.launch, which backends/gpu/strategies/flash_attention.py splices in);
`FlashNumpy` in flash_attention_twin.py runs it on the CPU, threads in lockstep, checking
shared-memory races (`emulate`, the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gac_torch.kernels.cuda_mma import (
    FRAG_A8,
    FRAG_B8,
    FRAG_C,
)

KINDS = ("f16", "bf16", "tf32", "f32x3")
LOG2E = 1.4426950408889634  # scores are kept in base 2: exp(x) = exp2(x · log2 e)
RESCALE = 8.0  # f16/bf16: O and l are rescaled only when a row max grows by more (log2 units)
SM_COUNT_HINT = 132  # H200: 8-warp blocks once they still make about two waves
ELEM_BYTES = {"f16": 2, "bf16": 2, "f32": 4}


@dataclass(frozen=True)
class Buf:
    """A memref as the kernel sees it (rank = batch + 2), identity-or-strided, static shape."""

    type: str
    elem: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True)
class Spec:
    kind: str
    q: Buf  # (batch..., L, D)
    k: Buf  # (batch..., S, D)
    v: Buf  # (batch..., S, Dv)
    o: Buf  # (batch..., L, Dv)
    mask: Buf | None  # (batch or 1..., L or 1, S or 1)
    mask_kind: str  # none | add | bool
    scale: float
    causal: bool

    @property
    def batch(self) -> tuple[int, ...]:
        return self.q.shape[:-2]

    L = property(lambda s: s.q.shape[-2])
    S = property(lambda s: s.k.shape[-2])
    D = property(lambda s: s.q.shape[-1])
    Dv = property(lambda s: s.v.shape[-1])

    @property
    def elem(self) -> str:  # operands' type in shared memory
        return "f32" if self.kind in ("tf32", "f32x3") else self.kind


@dataclass(frozen=True)
class Plan:
    warps: int
    bn: int  # keys per tile
    dp: int  # D padded to the k-step
    dvc: int  # output columns per CTA
    pad: int  # shared-memory row padding (elements)
    vq: int  # elements per global vector load of Q / K, V
    vkv: int
    grid: tuple[int, int, int]
    mt: int = 1  # 16-row m-tiles a warp (f16/bf16): K and V fragments serve mt mma rows
    stages: int = 1  # K/V buffers: 2 = the next tile loads during the whole of this one (Q's
    #                  fragments then come straight from global memory: no Q buffer)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def bm(self) -> int:
        return 16 * self.warps * self.mt


def kind_for(elem: str, allow_tf32: bool) -> str | None:
    return {"f16": "f16", "bf16": "bf16", "f32": "tf32" if allow_tf32 else "f32x3"}.get(elem)


def smem_bytes(spec: Spec, bm: int, bn: int, dp: int, dvc: int, pad: int, stages: int = 1) -> int:
    return ELEM_BYTES[spec.elem] * (bm * (dp + pad) * (stages == 1) + stages * bn * (dp + pad + dvc + pad))


def _vec(buf: Buf, cols: int, rows: int, threads: int, es: int) -> int | None:
    if buf.strides[-1] != 1 and buf.shape[-1] > 1:
        return None
    for v in (8, 4, 2, 1) if es == 2 else (4, 2, 1):
        if (buf.shape[-1] % v == 0 and cols % v == 0 and all(s % v == 0 for s in buf.strides[:-1])
                and (rows * cols // v) % threads == 0):
            return v
    return None


def plan(spec: Spec, max_grid=(2**31 - 1, 65535, 65535), smem_limit: int = 48 * 1024,
         big: bool | None = None, tiles: tuple[tuple[int, int], ...] | None = None,
         mt: int | None = None, stages: int | None = None) -> Plan | None:
    """Tiling for `spec`, or None when the kernel does not apply (then the maths runs unfused).
    `big` forces (or forbids) the 8-warp block; `tiles` replaces the (warps, BN) candidates;
    `mt` m-tiles a warp for every candidate (f16/bf16 only; None: the plan's choice); `stages`
    K/V buffers (2: f16/bf16 with D <= 64, whose Q fragments stay in registers; the default
    there where shared memory holds them)."""
    if spec.kind not in KINDS or min(spec.L, spec.S, spec.D, spec.Dv) < 1 or spec.D > 256 or spec.Dv > 256:
        return None
    bufs = [spec.q, spec.k, spec.v, spec.o] + ([spec.mask] if spec.mask is not None else [])
    if any(b.elem != spec.elem for b in (spec.q, spec.k, spec.v)) or ((mt or 1) > 1 and spec.elem == "f32"):
        return None
    if spec.o.elem not in ("f16", "bf16", "f32") or any(len(b.shape) != len(spec.q.shape) for b in bufs):
        return None
    ks = 16 if spec.elem in ("f16", "bf16") else 8
    dp = -(-spec.D // ks) * ks
    dv8 = -(-spec.Dv // 8) * 8
    dvc = dv8 if dv8 <= 128 else -(-dv8 // 2 // 8) * 8
    pad = 8 if ELEM_BYTES[spec.elem] == 2 else 4
    es = ELEM_BYTES[spec.elem]
    half = spec.elem in ("f16", "bf16")
    auto = big is None
    if big is None:  # (only where ~128 registers a thread still let two blocks share an SM)
        big = (dp <= (64 if half else 32)
               and -(-spec.L // 128) * math.prod(spec.batch) >= 2 * SM_COUNT_HINT)
    two = half and dp <= 64
    if stages == 2 and not two:
        return None
    if tiles is not None:
        cands = tuple((w, n, mt or 1) for w, n in tiles)
    else:
        # 128-row blocks where they fill the GPU. f16/bf16 with D, Dv <= 32, no mask, not causal:
        # 4 warps of 2 m-tiles (each K/V fragment serves 2 mma rows, 4 warps a barrier; 168
        # registers at D = 32: 3 blocks an SM), measured on the H200 (2026-12-02, bf16
        # 8x8x2500x32): 0.236 ms against 0.276 for 8 warps of 1 and 0.249 for 4 warps of 1
        # (64-row blocks), eager 0.266. (Masks and causal take 178-228 registers: 2 blocks an SM,
        # unmeasured.)
        mt2 = auto and half and max(dp, dvc) <= 32 and mt is None and spec.mask is None and not spec.causal
        first = ((4, 64, 2),) if mt2 else ((8, 64, mt or 1),)
        cands = first * big + tuple((w, n, mt or 1) for w, n in
                                    ((4, 64), (4, 32), (2, 64), (2, 32), (4, 16), (2, 16), (1, 16)))
    for warps, bn, m in cands:
        bm = 16 * warps * m
        fits = [n for n in ((stages,) if stages else (2, 1) if two else (1,))
                if smem_bytes(spec, bm, bn, dp, dvc, pad, n) <= smem_limit]
        if not fits:
            continue
        t = 32 * warps
        vq = _vec(spec.q, dp, bm, t, es)
        vk = _vec(spec.k, dp, bn, t, es)
        vv = _vec(spec.v, dvc, bn, t, es)
        if None in (vq, vk, vv) or min(vq, vk, vv) * es < 4:  # (cp.async moves 4, 8 or 16 bytes)
            continue
        grid = (-(-spec.L // bm), -(-dv8 // dvc), math.prod(spec.batch))
        if any(x > lim for x, lim in zip(grid, max_grid)):
            return None
        return Plan(warps, bn, dp, dvc, pad, vq, min(vk, vv), grid, m, fits[0])  # type: ignore[type-var]
    return None


# --------------------------------------------------------------------------------------------
# the kernel, once, against a builder


def tree(op: Any, xs: list[Any]) -> Any:
    while len(xs) > 1:
        xs = [op(xs[i], xs[i + 1]) for i in range(0, len(xs) - 1, 2)] + xs[len(xs) - len(xs) % 2:]
    return xs[0]


def kernel(b: Any, spec: Spec, p: Plan) -> None:
    T, BM, BN, DP, DVC = p.threads, p.bm, p.bn, p.dp, p.dvc
    c = b.const
    half = spec.elem in ("f16", "bf16")
    KS = 16 if half else 8
    NT, NO, MT = BN // 8, DVC // 8, p.mt
    neg = -math.inf
    # 1. locate
    tid = b.tid()
    m0, c0 = b.mul(b.bid(0), c(BM)), b.mul(b.bid(1), c(DVC))
    bidx, rest = [], b.bid(2)
    for j in range(len(spec.batch) - 1, -1, -1):
        ext = spec.batch[j]
        bidx.insert(0, rest if j == 0 else b.rem(rest, c(ext)))
        if j:
            rest = b.div(rest, c(ext))
    warp, lane = b.div(tid, c(32)), b.rem(tid, c(32))
    g, t = b.div(lane, c(4)), b.rem(lane, c(4))
    t2 = b.mul(t, c(2))
    wrow = b.mul(warp, c(16 * MT))
    rows = [[b.add(m0, b.add(wrow, b.add(g, c(16 * m + r)))) for r in (0, 8)]  # the lane's query rows
            for m in range(MT)]

    def tile_copy(which: str, r0: Any, nrows: int, col0: Any, ncols: int, ext_r: int,
                  ext_c: int, vec: int, srow: Any = None) -> None:
        """cp.async of a tile (rows r0.., cols col0..) into shared memory (from row srow), zero
        outside."""
        per_row = ncols // vec
        for i in range(nrows * ncols // vec // T):
            lin = b.add(tid, c(i * T))
            r, col = b.div(lin, c(per_row)), b.mul(b.rem(lin, c(per_row)), c(vec))
            gr, gc = b.add(r0, r), b.add(col0, col)
            ok = b.and_(b.lt(gr, c(ext_r)), b.lt(gc, c(ext_c)))
            b.copy_async(which, [r if srow is None else b.add(srow, r), col], bidx + [gr, gc], vec, ok)

    def kv_copy(n0: Any, srow: Any) -> None:
        """K and V of the key tile at n0 into the buffers' rows srow.. (two stages)."""
        tile_copy("K", n0, BN, c(0), DP, spec.S, spec.D, p.vkv, srow)
        tile_copy("V", n0, BN, c0, DVC, spec.S, spec.Dv, p.vkv, srow)

    # 2. stage Q and the first K tile (two stages: K and V of the first tile; Q's fragments
    # come from global memory below)
    two = p.stages == 2
    if two:
        kv_copy(c(0), c(0))
    else:
        tile_copy("Q", m0, BM, c(0), DP, spec.L, spec.D, p.vq)
        tile_copy("K", c(0), BN, c(0), DP, spec.S, spec.D, p.vkv)
        b.wait_async()
        b.barrier()

    nkt = -(-spec.S // BN)
    if spec.causal:  # tiles with a key <= the block's last row
        ntiles = b.min(c(nkt), b.div(b.add(m0, c(BM + BN - 1)), c(BN)))
    else:
        ntiles = c(nkt)

    # ldmatrix (f16/bf16): lane l gives the address of row l % 8 of 8x8 matrix l / 8
    l8, l8h, l16 = b.rem(lane, c(8)), b.mul(b.rem(b.div(lane, c(8)), c(2)), c(8)), b.mul(b.div(lane, c(16)), c(8))
    krow, vrow = b.add(l8, l16), b.add(l8, l8h)  # the lane's row in K's x4 (n-tile pairs), V's .trans

    def q_frag(k0: int, m: int) -> list[Any]:
        wr = wrow if m == 0 else b.add(wrow, c(16 * m))
        if two:  # FRAG_A16 straight from global: (rows g, g + 8) x (cols k0 + 2t, k0 + 8 + 2t), pairs
            out = []
            for cc in (0, 8):
                for r in (0, 8):
                    row, col = b.add(m0, b.add(wr, b.add(g, c(r)))), b.add(t2, c(k0 + cc))
                    out.append(b.load_pair("Q", bidx + [row, col], b.and_(b.lt(row, c(spec.L)), b.lt(col, c(spec.D)))))
            return out
        if half:  # matrices (rows +0/+8) x (cols k0/k0+8) = FRAG_A16's four registers
            return b.ldmatrix("Q", b.add(wr, b.add(l8, l8h)), l16, 4, False, coff=k0)
        return [b.load_smem("Q", [b.add(wr, b.add(g, c(r))), b.add(t, c(k0 + cc))], 1)
                for r, cc in FRAG_A8]

    # Q's A fragments stay in registers across key tiles while D <= 64 (tf32: 16 scalar loads a
    # k-step saved, 32 registers; f16/bf16: one ldmatrix a k-step, 16 registers); f32x3 (whose
    # split parts would stay live too) reloads them from shared memory: registers are tighter
    qfrags = ({(k0, m): q_frag(k0, m) for k0 in range(0, DP, KS) for m in range(MT)}
              if spec.kind != "f32x3" and DP <= 64 else {})

    # Without an additive mask (and scale > 0) the row max is taken on the raw scores and the
    # scale applied inside exp2(s·c - m·c), which contracts to one fma per score.
    raw = spec.mask_kind != "add" and spec.scale > 0
    sc = b.fconst(spec.scale * LOG2E)

    def mask_scores(s: list[Any], rows: list[Any], n0: Any, last: bool) -> None:
        """3c on one m-tile's scores, in place."""
        for j in range(NT):
            for q, (rq, cq) in enumerate(FRAG_C):
                row = rows[rq // 8]
                key = b.add(n0, b.add(t2, c(8 * j + cq)))
                x = s[4 * j + q] if raw else b.fmul(s[4 * j + q], sc)
                # keys past S exist in the last tile only (S % BN of them)
                hide = b.ge(key, c(spec.S)) if last and spec.S % BN else None
                if spec.causal:
                    hide = b.gt(key, row) if hide is None else b.or_(hide, b.gt(key, row))
                if spec.mask_kind != "none":
                    ok = b.and_(b.lt(row, c(spec.L)), b.lt(key, c(spec.S)))
                    mb = spec.mask  # type: ignore[union-attr]
                    idx = [c(0) if mb.shape[d] == 1 else bidx[d] for d in range(len(bidx))]
                    idx += [c(0) if mb.shape[-2] == 1 else row, c(0) if mb.shape[-1] == 1 else key]
                    mv = b.load_mask(idx, ok)
                    if spec.mask_kind == "add":
                        x = b.fadd(x, b.fmul(mv, b.fconst(LOG2E)))
                    else:
                        hide = mv if hide is None else b.or_(hide, mv)  # load_mask: `hidden` for bool
                s[4 * j + q] = x if hide is None else b.fsel(hide, b.fconst(neg), x)

    def row_max(s: list[Any], mrow: list[Any], corr: list[Any] | None = None) -> tuple[list[Any], list[Any]]:
        """3d, first half, on one m-tile: the new row maxima (per half: rows g, g + 8) and the
        value exp2's argument subtracts (0 where the max is -inf; not yet scaled where raw).
        With `corr` (f32x3): also each half's correction appended to it, and the value scaled."""
        mnew, use = [], []
        half_rows = [[s[4 * j + q] for j in range(NT) for q in (2 * h, 2 * h + 1)] for h in range(2)]
        for h in range(2):  # (pairwise trees: 5-6 dependent steps for 2·NT values, not 2·NT)
            mx = b.fmax(mrow[h], tree(b.fmax, half_rows[h]))
            mx = b.fmax(mx, b.shfl_xor(mx, 1))
            mx = b.fmax(mx, b.shfl_xor(mx, 2))
            mnew.append(mx)
            use.append(b.fsel(b.feq(mx, b.fconst(neg)), b.fconst(0.0), mx))
            if corr is not None:  # (in this order the f32x3 kernels keep to their registers)
                c1, u1 = correction(mrow[h:h + 1], use[h:h + 1])
                corr += c1
                use[h] = u1[0]
        return mnew, use

    def correction(mrow: list[Any], use: list[Any]) -> tuple[list[Any], list[Any]]:
        """corr = exp2(m - m_new) per half, and m_new as exp2's argument subtracts it."""
        corr = [b.fexp2(b.fmul(b.fsub(m, u), sc) if raw else b.fsub(m, u)) for m, u in zip(mrow, use)]
        return corr, [b.fmul(u, sc) if raw else u for u in use]

    def exponentiate(s: list[Any], j: int, muse: list[Any]) -> None:
        """3f on n-tile j of one m-tile's scores, in place: p = exp2(s - m_new)."""
        for q in range(4):
            x = s[4 * j + q]
            s[4 * j + q] = b.fexp2(b.fsub(b.fmul(x, sc) if raw else x, muse[q // 2]))

    def row_sums(s: list[Any], lrow: list[Any], corr: list[Any] | None) -> list[Any]:
        """The lane's partial row sums l = l·corr + Σp (summed over the quad in 4)."""
        half_rows = [[s[4 * j + q] for j in range(NT) for q in (2 * h, 2 * h + 1)] for h in range(2)]
        return [b.fadd(lrow[h] if corr is None else b.fmul(lrow[h], corr[h]), tree(b.fadd, half_rows[h]))
                for h in range(2)]

    def lazy_rescale(mrow: list[Any], lrow: list[Any], acc: list[Any], mx: list[Any], use: list[Any]) -> list[Any]:
        """f16/bf16, 3f's O *= corr only where a row max of the warp grew by more than RESCALE
        (log2 units; a warp-uniform branch): else the old max stays the reference, p <= 2^8
        (f32 sums, P's type holds it) and the tile skips 4·NO + 2 multiplies and 2 exp2.
        Returns the maxima used, l and O."""
        grow = [b.fgt(b.fmul(b.fsub(mx[h], mrow[h]), sc) if raw else b.fsub(mx[h], mrow[h]), b.fconst(RESCALE))
                for h in range(2)]  # (-inf - -inf is NaN: no growth)

        def rescale() -> list[Any]:
            corr, _ = correction(mrow, use)
            return (list(mx) + [b.fmul(x, corr[h]) for h, x in enumerate(lrow)]
                    + [b.fmul(a, corr[(i % 4) // 2]) for i, a in enumerate(acc)])
        return b.cond(b.warp_any(b.or_(grow[0], grow[1])), rescale, list(mrow) + list(lrow) + list(acc))

    def p_fragment(s: list[Any], kk: int) -> list[Any]:
        """One m-tile's P as the A fragment of P·V k-step kk (3f): f16/bf16 n-tiles 2kk, 2kk+1;
        tf32 n-tile kk, its keys permuted (k-index t <-> key 2t, t + 4 <-> key 2t + 1)."""
        if half:
            return [b.pack_f32(s[8 * kk + 0], s[8 * kk + 1]), b.pack_f32(s[8 * kk + 2], s[8 * kk + 3]),
                    b.pack_f32(s[8 * kk + 4], s[8 * kk + 5]), b.pack_f32(s[8 * kk + 6], s[8 * kk + 7])]
        return [s[4 * kk + 0], s[4 * kk + 2], s[4 * kk + 1], s[4 * kk + 3]]

    def v_fragments(kk: int, j: int, fbs: list[Any], st: Any) -> list[Any]:
        """V's B fragment of n-tile j at P·V k-step kk (f16/bf16: ldmatrix.trans of n-tiles j,
        j + 1 at even j into `fbs`, which the odd j reuses)."""
        if not half:  # k-index t <-> key 2t, t + 4 <-> key 2t + 1
            return [b.load_smem("V", [b.add(t2, c(8 * kk + e)), b.add(g, c(8 * j))], 1) for e in (0, 1)]
        if j % 2 == 0:  # transposed: keys +0/+8 x cols 8j / 8j + 8
            num = 4 if j + 1 < NO else 2
            fbs[:] = b.ldmatrix("V", vrow, l16 if num == 4 else c(0), num, True, st, 16 * kk, 8 * j)
        return fbs[2 * (j % 2):2 * (j % 2) + 2]

    def body(kt: Any, state: list[Any], last: bool) -> list[Any]:
        # state: the row maxima (2 a m-tile), the row sums (2 a m-tile), the O accumulators
        mrow = [state[2 * m:2 * m + 2] for m in range(MT)]
        lrow = [state[2 * MT + 2 * m:2 * MT + 2 * m + 2] for m in range(MT)]
        acc = [state[4 * MT + 4 * NO * m:4 * MT + 4 * NO * (m + 1)] for m in range(MT)]
        n0 = b.mul(kt, c(BN))
        # 3a. K(kt) has landed (and every warp is done with V(kt - 1)): V(kt) starts.
        # Two stages: K and V (kt) have landed in rows st.. (and every warp is done with the
        # other stage's tile kt - 1): K and V (kt + 1) start there
        b.wait_async()
        b.barrier()
        st = None  # the stage's first row in the K and V buffers (one stage: 0)
        if two:
            st = b.mul(b.rem(kt, c(2)), c(BN))
            if not last:
                kv_copy(b.add(n0, c(BN)), b.sub(c(BN), st))
        else:
            tile_copy("V", n0, BN, c0, DVC, spec.S, spec.Dv, p.vkv)
        # 3b. S = Q Kᵀ (each K fragment serves the warp's MT m-tiles)
        s = [[b.fconst(0.0)] * (NT * 4) for _ in range(MT)]
        for k0 in range(0, DP, KS):
            fa = [qfrags[(k0, m)] if qfrags else q_frag(k0, m) for m in range(MT)]
            for j in range(NT):
                if half and j % 2 == 0:  # B fragments of n-tiles j, j + 1 (keys x cols k0/k0+8)
                    fbs = b.ldmatrix("K", krow, l8h, 4, False, st, 8 * j, k0)
                if half:
                    fb = fbs[2 * (j % 2):2 * (j % 2) + 2]
                else:
                    fb = [b.load_smem("K", [b.add(g, c(8 * j)), b.add(t, c(k0 + kk))], 1) for kk in FRAG_B8]
                for m in range(MT):
                    s[m][4 * j:4 * j + 4] = b.mma(spec.kind, fa[m], fb, s[m][4 * j:4 * j + 4])
        # 3c. mask, 3d. the row maxima (they need every score of the tile)
        maxima, corr = [], []
        for m in range(MT):
            mask_scores(s[m], rows[m], n0, last)
            maxima.append(row_max(s[m], mrow[m], corr if spec.kind == "f32x3" else None))
        # 3e. V(kt) has landed (and every warp is done with K(kt)): K(kt + 1) starts. 3f. The
        # exponentials come after this barrier, so that the scheduler can interleave them
        # (MUFU) with the P·V mma (tensor pipe) of the k-steps before them.
        if spec.kind == "f32x3":  # (MT == 1; its P·V chains start after every exponential, so
            # nothing interleaves: they stay before the barrier, where they used fewer registers)
            corr, muse = [corr], [maxima[0][1]]
            mnew = list(maxima[0][0])
            for j in range(NT):
                exponentiate(s[0], j, muse[0])
            lnew = row_sums(s[0], lrow[0], corr[0])
        if not two:
            b.wait_async()
            b.barrier()
            if not last:
                tile_copy("K", b.add(n0, c(BN)), BN, c(0), DP, spec.S, spec.D, p.vkv)
        if half:
            mnew = []
            for m in range(MT):
                out = lazy_rescale(mrow[m], lrow[m], acc[m], *maxima[m])
                mnew += out[:2]
                lrow[m], acc[m] = out[2:4], out[4:]
            use = [b.fsel(b.feq(x, b.fconst(neg)), b.fconst(0.0), x) for x in mnew]
            muse = [[b.fmul(u, sc) if raw else u for u in use[2 * m:2 * m + 2]] for m in range(MT)]
            corr = [None] * MT
        elif spec.kind == "tf32":
            corr, muse = zip(*(correction(mrow[m], maxima[m][1]) for m in range(MT)))  # type: ignore[assignment]
            mnew = [x for mx in maxima for x in mx[0]]
        if spec.kind == "f32x3":
            # The tensor cores truncate while they accumulate: a sum over every key in one mma
            # chain drifts toward zero (2e-5 at S = 4096). The tile's keys go into a
            # fresh accumulator, added to O in an fma rounded to nearest: all n-tiles at once
            # (k-steps outer: NO·4 more registers) or one at a time (P's 8·NT split parts stay
            # live across them), whichever keeps fewer registers live.
            jg = NO if 4 * NO + 8 <= 4 + 8 * NT else 1
            steps = [p_fragment(s[0], kk) for kk in range(NT)]
            for j0 in range(0, NO, jg):
                tmp = [b.fconst(0.0)] * (4 * jg)
                for kk, fa in enumerate(steps):
                    for j in range(j0, j0 + jg):
                        i = 4 * (j - j0)
                        tmp[i:i + 4] = b.mma(spec.kind, fa, v_fragments(kk, j, [], st), tmp[i:i + 4])
                for i in range(4 * jg):
                    acc[0][4 * j0 + i] = b.fadd(b.fmul(acc[0][4 * j0 + i], corr[0][(i % 4) // 2]), tmp[i])
        else:  # O *= corr (f16/bf16: done above), then per k-step: its exponentials, P's fragment, O += P V
            if spec.kind == "tf32":
                acc = [[b.fmul(a, corr[m][(i % 4) // 2]) for i, a in enumerate(acc[m])] for m in range(MT)]
            per = 2 if half else 1  # score n-tiles a k-step
            for kk in range(NT // per):
                fa = []
                for m in range(MT):
                    for j in range(per * kk, per * kk + per):
                        exponentiate(s[m], j, muse[m])
                    fa.append(p_fragment(s[m], kk))
                fbs: list[Any] = []
                for j in range(NO):
                    fb = v_fragments(kk, j, fbs, st)
                    for m in range(MT):
                        acc[m][4 * j:4 * j + 4] = b.mma(spec.kind, fa[m], fb, acc[m][4 * j:4 * j + 4])
        if spec.kind != "f32x3":  # (f32x3: above)
            lnew = [x for m in range(MT) for x in row_sums(s[m], lrow[m], corr[m])]
        return mnew + lnew + [x for a in acc for x in a]

    # every tile but the last in the loop; the last one peeled (no prefetch, the S tail masked)
    init = [b.fconst(neg)] * (2 * MT) + [b.fconst(0.0)] * (2 * MT + MT * NO * 4)
    state = b.loop(b.sub(ntiles, c(1)), init, lambda kt, st: body(kt, st, False))
    state = body(b.sub(ntiles, c(1)), state, True)
    # 4. finish
    for m in range(MT):
        lsum = []
        for h in range(2):
            x = state[2 * MT + 2 * m + h]
            x = b.fadd(x, b.shfl_xor(x, 1))
            lsum.append(b.fadd(x, b.shfl_xor(x, 2)))
        acc_m = state[4 * MT + 4 * NO * m:4 * MT + 4 * NO * (m + 1)]
        inv = [b.fsel(b.feq(x, b.fconst(0.0)), b.fconst(0.0), b.fdiv(b.fconst(1.0), x)) for x in lsum]
        for j in range(NO):
            for q, (rq, cq) in enumerate(FRAG_C):
                row, h = rows[m][rq // 8], rq // 8
                col = b.add(c0, b.add(t2, c(8 * j + cq)))
                val = b.fmul(acc_m[4 * j + q], inv[h])
                ok = b.and_(b.lt(row, c(spec.L)), b.lt(col, c(spec.Dv)))
                b.store_out(bidx + [row, col], val, ok)
