"""The RGB stem's stride-2 conv as a stride-1 conv on a space-to-depth input (passes/channels_last.py
takes a stem this way; GAC_STEM_S2D=0: the channel-padded stem instead).

    y[oh] = sum_kh x[2 oh + kh - p] w[kh]                      (per spatial dim; kh < k)
          = sum_{a < A, b < 2} X[oh + a, b] W[a, b]             X[i, b] = x[2 (i - L) + b]
                                                                W[a, b] = w[2 a + b - q]
with q = p % 2 (so that p + q is even), L = (p + q) / 2, A = ceil((k + q) / 2); x and w read as 0
outside their extents. X's two b's per dim join the channels: an N x (OH + A - 1) x (OW + A - 1)
x 4C' NHWC tensor (C' = C, or C + 1 where 4 C 2-byte channels are not whole 16-byte vectors),
its zero border (L before, the rest after) included, and the conv is A x A, stride 1, unpadded.

Why: the implicit GEMM's producers spend about as much per K slice as the tensor cores (a
stride-2 7x7 on 4 padded channels: K = 196, 7 slices of 32 tf32, each tap one 16-byte copy and
two padding guards). On X: K = 192 (tf32, 6 slices) or 256 (bf16: 4 slices of 64, which the wgmma
kernel takes; the padded stem's 8-byte taps went to mma.sync), and no guards at all. X is one
gather kernel (a replicate pad under a constant mask, reshaped: channels_last._pad_input's
trick), the same bytes as the padded input it replaces. Numerics: the same products, summed in
another order (a K permutation), plus products with zeros.
"""

from __future__ import annotations

import os

import torch
from mlir import ir

from gac_torch.ir.builder import GacBuilder, op_attrs
from gac_torch.ir.types import elem_of, is_float, shape_of, torch_dtype

MAX_CHANNELS = 3  # an RGB stem (more channels: the conv's own vectors)
VEC_BYTES = 16


def applies(op: ir.Operation) -> bool:
    """A 2-D ungrouped, undilated stride-2 conv of at most MAX_CHANNELS float input channels, on
    an even height and width (whole 2x2 blocks: X's gather is then one kernel)."""
    a = op_attrs(op)
    ws, xs = shape_of(op.operands[1].type), shape_of(op.operands[0].type)
    return (os.environ.get("GAC_STEM_S2D") != "0" and a["groups"] == 1 and list(a["stride"]) == [2, 2]
            and list(a["dilation"]) == [1, 1] and ws[1] <= MAX_CHANNELS and len(ws) == 4
            and xs[2] % 2 == 0 and xs[3] % 2 == 0 and is_float(elem_of(op.operands[0])))


def _channels(c: int, elem: ir.Type) -> int:
    """C': the channels per input pixel, so that a pixel of X (4 C') is whole 16-byte vectors."""
    es = {"f16": 2, "bf16": 2, "f64": 8}.get(str(elem), 4)
    while (4 * c * es) % VEC_BYTES:
        c += 1
    return c


def _dim(k: int, p: int, n: int, o: int) -> tuple[int, int, int, int]:
    """(q, A, L, X's extent) of one spatial dim (the banner's names)."""
    q = p % 2
    a = -(-(k + q) // 2)
    return q, a, (p + q) // 2, o + a - 1


def within(b: GacBuilder, rank: int, dim: int, size: int, lo: int, hi: int) -> ir.Value:
    """lo <= i < hi for i along `dim` (of `size`) of a rank-`rank` mask, 1 wide elsewhere."""
    shape = [1] * rank
    shape[dim] = size
    i, i32 = b.iota(shape, dim=dim, dtype=torch.int32), torch.int32
    return b.binary(b.binary(i, b.constant(lo, i32), kind="ge"), b.binary(i, b.constant(hi, i32), kind="lt"),
                    kind="logical_and")


def uncast(v: ir.Value) -> ir.Value:
    """v's source where v is a float cast of a float (cast again after the gather, it fuses)."""
    d = v.owner.operation if isinstance(v.owner, (ir.Operation, ir.OpView)) else None
    if d is not None and d.name == "gac.cast" and is_float(elem_of(d.operands[0])) and is_float(elem_of(v)):
        return d.operands[0]
    return v


def input_nhwc(b: GacBuilder, x: ir.Value, out_hw: tuple[int, int], w_shape: tuple[int, ...],
               padding: list[int], elem: ir.Type) -> ir.Value:
    """X (N, Hb, Wb, 4 C') of the NCHW input x (even H and W; a float cast of x: applied after
    the gather, where it fuses), in `elem`: x as (n, c, i, bh, j, bw) blocks, padded along i, j
    (and c) by a replicate pad (a generic that reads x), moved to (n, i, j, bh, bw, c), and 0
    where the pad read outside x (or a padded channel); one kernel with the moves and the cast."""
    x = uncast(x)
    n, c, h, w = shape_of(x.type)
    cp = _channels(c, elem)
    (_, _, lh, hb), (_, _, lw, wb) = (_dim(k, p, s, o) for k, p, s, o in zip(w_shape[2:], padding, (h, w), out_hw))
    x6 = b.reshape(x, [n, c, h // 2, 2, w // 2, 2])
    rep = b.pad(x6, low=[0, 0, lh, 0, lw, 0], high=[0, cp - c, hb - h // 2 - lh, 0, wb - w // 2 - lw, 0],
                mode="replicate", value=0.0)
    t = b.transpose(rep, perm=[0, 2, 4, 3, 5, 1])  # (n, i, j, bh, bw, c)
    mask = b.binary(b.binary(within(b, 6, 1, hb, lh, lh + h // 2), within(b, 6, 2, wb, lw, lw + w // 2),
                             kind="logical_and"), within(b, 6, 5, cp, 0, c), kind="logical_and")
    v = b.cast(b.select(mask, t, b.constant(0.0, torch_dtype(elem_of(x)), [])), elem)
    return b.reshape(v, [n, hb, wb, 4 * cp])


def weights(b: GacBuilder, w: ir.Value, padding: list[int], elem: ir.Type) -> ir.Value:
    """W (F, 4 C', A, A) of the F C KH KW weights: w[2 a + b - q], its channels in X's order."""
    f, c, kh, kw = shape_of(w.type)
    cp = _channels(c, elem)
    welem, w = elem_of(w), uncast(w)  # (autocast's weight cast: after the gather, fused)
    (qh, ah, _, _), (qw, aw, _, _) = (_dim(k, p, 0, 0) for k, p in zip((kh, kw), padding))
    # zero-padded to (F, C', 2 A, 2 A) as X is (a masked replicate pad: one kernel with the moves)
    rep = b.pad(w, low=[0, 0, qh, qw], high=[0, cp - c, 2 * ah - kh - qh, 2 * aw - kw - qw], mode="replicate",
                value=0.0)
    mask = None
    for dim, size, lo, hi in ((1, cp, 0, c), (2, 2 * ah, qh, qh + kh), (3, 2 * aw, qw, qw + kw)):
        m = within(b, 4, dim, size, lo, hi)
        mask = m if mask is None else b.binary(mask, m, kind="logical_and")
    w8 = b.cast(b.select(mask, rep, b.constant(0.0, torch_dtype(elem_of(w)), [])), welem)
    # stored (f, a_h, a_w, bh, bw, c), so that X's channels are the weights' unit-stride K run
    # too (the conv reads the transpose to F C KH KW through its indexing)
    w6 = b.transpose(b.reshape(w8, [f, cp, ah, 2, aw, 2]), perm=[0, 2, 4, 3, 5, 1])
    return b.transpose(b.reshape(w6, [f, ah, aw, 4 * cp]), perm=[0, 3, 1, 2])
