"""gac-channels-last: 2-D convolutions on N H W C activations, converted only at chain edges.

    conv(x, w)                      ->  transpose(conv[channels_last](transpose(x, NHWC)), NCHW)
    ew(transpose(t, NCHW), y, ...)  ->  transpose(ew(t, y', ...), NCHW)      (ew elementwise)
    transpose(transpose(t, p), q)   ->  t  (or one transpose)

Why: an NCHW conv's im2col gathers channels at a stride of H*W elements, one scalar load each;
on N H W C the channels are the unit-stride run of K = (kh, kw, c), which the GPU's implicit
GEMM stages in 16-byte vectors (kernels/conv_gemm.py). Converting around every conv would cost
a transpose of every activation (about 40 % of the time where peers did so): instead each
conv's NCHW result transpose is moved down through the elementwise ops after it (bias,
BatchNorm, ReLU, residual add, casts; their small broadcast operands are just reshaped, a big
one transposed) until it meets the next conv's NHWC transpose and both vanish. What is left
sits where the graph's own layout is needed: the graph's inputs and outputs and the non-
elementwise ops (pooling, reductions); the shared lowering folds such a transpose into the
indexing of its one reader (a graph input into the first conv, the output into the last
epilogue), else it is one copy kernel (ResNet-50: the max-pool's result). Only convs joined
to another conv are converted (`_chained`). Numerics are unchanged: every element is computed by the same
operations in the same order. Targets opt in (`Target.channels_last`; option `channels_last`).
"""

from __future__ import annotations

import os

from mlir import ir

from gac_torch.ir.builder import GacBuilder, op_attrs
from gac_torch.ir.types import DYN, elem_of, shape_of, torch_dtype
from gac_torch.passes import space_to_depth
from gac_torch.passes.dce import gac_dce

TO_LAST = (0, 2, 3, 1)  # NCHW -> NHWC
TO_FIRST = (0, 3, 1, 2)  # NHWC -> NCHW
ELEMENTWISE = ("gac.unary", "gac.binary", "gac.select", "gac.cast")
_FLOATS = ("f16", "bf16", "f32", "f64")
# a conv whose per-group output channels fill under one mma tile (depthwise) is left to the
# reduction kernels, which walk NCHW's spatial runs; one with under a 16-byte f32 vector of input
# channels per group reads no vectors on NHWC either, except an ungrouped one (an RGB stem):
# a stride-2 one on even sizes becomes a stride-1 conv on 2x2 pixel blocks (space_to_depth.py:
# 12 or 16 channels), else its input and weights are zero-padded to PAD_INPUTS channels, so the
# implicit GEMM stages its NHWC input in whole vectors (K 147 -> 196, scalar 2-byte loads
# without; GAC_STEM_PAD=0: left on NCHW)
MIN_GROUP_CHANNELS = 8
MIN_GROUP_INPUTS = PAD_INPUTS = 4


def _op(v: ir.Value) -> ir.Operation | None:
    o = v.owner
    return o.operation if isinstance(o, (ir.Operation, ir.OpView)) else None


def _perm_of(v: ir.Value) -> tuple[ir.Value, tuple[int, ...]] | None:
    d = _op(v)
    if d is None or d.name != "gac.transpose":
        return None
    return d.operands[0], tuple(op_attrs(d)["perm"])


def _tensor(shape, elem: ir.Type) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(list(shape), elem)


def _reshape(b: GacBuilder, v: ir.Value, shape: list[int]) -> ir.Value:
    """reshape(v), of the source of a reshape that made v: one reshape, which the shared
    lowering folds into the elementwise op reading it (a chain of them stays a kernel)."""
    d = _op(v)
    if d is not None and d.name == "gac.reshape" and len(d.operands) == 1:
        v = d.operands[0]
    return b.reshape(v, shape)


def _permute(b: GacBuilder, v: ir.Value, perm: tuple[int, ...]) -> ir.Value:
    """transpose(v, perm), composed with a transpose that made v (identity: its source), or a
    reshape when only unit dims move."""
    src = _perm_of(v)
    if src is not None:
        v, perm = src[0], tuple(src[1][p] for p in perm)
    if perm == tuple(range(len(perm))):
        return v
    shape = shape_of(v.type)
    moved = [p for p in perm if shape[p] != 1]  # the non-unit dims, in their new order: a reshape
    if moved == sorted(moved) and DYN not in shape:  # only when it keeps it (equal sizes too: 16x16x16)
        return _reshape(b, v, [shape[p] for p in perm])
    return b.transpose(v, perm=list(perm))


def _eligible_conv(op: ir.Operation) -> bool:
    a = op_attrs(op)
    x, w = op.operands
    xs, ws = shape_of(x.type), shape_of(w.type)
    ys = shape_of(op.results[0].type)
    elem = str(ir.RankedTensorType(x.type).element_type)
    # (an output row or column of one: the cuda pipeline folds that unit dim, and the NHWC
    # generic's input map is left with a bare kh/kw over the padded extent: 'inferred 4, found 3')
    return (len(xs) == 4 and not a["channels_last"] and DYN not in xs and elem in _FLOATS
            and ws[0] // a["groups"] >= MIN_GROUP_CHANNELS and (ws[1] >= MIN_GROUP_INPUTS or _padded(op))
            and len(ys) == 4 and min(ys[2:]) > 1)


def _padded(op: ir.Operation) -> bool:
    """An ungrouped conv of under PAD_INPUTS input channels: on NHWC with its channels
    zero-padded (`_to_channels_last`)."""
    ws = shape_of(op.operands[1].type)
    return op_attrs(op)["groups"] == 1 and ws[1] < PAD_INPUTS and os.environ.get("GAC_STEM_PAD") != "0"


def _pad_to(x: ir.Value) -> int:
    """The channels a padded stem's input gets: PAD_INPUTS; with GAC_STEM_PAD_WIDE=1 a whole
    16-byte vector of them (f16/bf16: 8), so the sm_90 wgmma implicit GEMM (cwgmma, 16-byte
    copies) takes a 2-byte stem too instead of mma.sync's (8-byte copies), at twice its K."""
    es = {"f16": 2, "bf16": 2}.get(str(elem_of(x)), 4)
    return 16 // es if os.environ.get("GAC_STEM_PAD_WIDE") == "1" else PAD_INPUTS


def _chained(ops: list[ir.Operation]) -> set[ir.Operation]:
    """The convs whose input or result is joined to another conv's result or input by
    elementwise ops alone (a union of each elementwise op's 4-d operands and result): only there
    does NHWC pay for the transposes left at the chain's edges (a lone conv, one whose result
    only meets its own input in a residual add, or one next to a pooling op keeps NCHW)."""
    parent: dict = {}

    def find(v):
        while v in parent:
            v = parent[v]
        return v

    def union(a, b):
        a, b = find(a), find(b)
        if a != b:
            parent[a] = b

    for op in ops:
        if _nhwc_pool(op):
            union(op.operands[0], op.results[0])
        if op.name in ELEMENTWISE and len(shape_of(op.results[0].type)) == 4:
            for v in op.operands:
                if len(shape_of(v.type)) == 4:
                    union(v, op.results[0])
    convs = [o for o in ops if o.name == "gac.conv" and _eligible_conv(o)]
    ends: dict = {}  # group -> the convs reading / writing it
    for c in convs:
        for v in (c.operands[0], c.results[0]):
            ends.setdefault(find(v), []).append(c)
    return {c for c in convs if any(o != c for v in (c.operands[0], c.results[0]) for o in ends[find(v)])}


def _to_channels_last(b: GacBuilder, op: ir.Operation, inputs: dict) -> None:
    """The conv on NHWC; `inputs`: the NHWC transposes made so far, shared by the convs that
    read one value (a block input read by its first conv and its downsample)."""
    a = op_attrs(op)
    x, w = op.operands
    y = op.results[0]
    ys = shape_of(y.type)
    if _padded(op) and space_to_depth.applies(op):  # an RGB stem: stride 1 on 2x2 pixel blocks
        with ir.InsertionPoint(op), op.location:
            elem = elem_of(x)
            xt = space_to_depth.input_nhwc(b, x, ys[2:], shape_of(w.type), list(a["padding"]), elem)
            yt = b.conv(xt, space_to_depth.weights(b, w, list(a["padding"]), elem), stride=[1, 1],
                        padding=[0, 0], dilation=[1, 1], groups=1, channels_last=1,
                        result_type=_tensor([ys[p] for p in TO_LAST], ir.RankedTensorType(y.type).element_type))
            y.replace_all_uses_with(b.transpose(yt, perm=list(TO_FIRST)))
        op.erase()
        return
    pad = _pad_to(x) - shape_of(w.type)[1] if _padded(op) else 0
    if (x, pad) not in inputs:
        with ir.InsertionPoint(op), op.location:
            inputs[x, pad] = _permute(b, _pad_input(b, x, pad), TO_LAST)
    with ir.InsertionPoint(op), op.location:
        xt = inputs[x, pad]
        w = _pad_channels(b, w, pad)
        yt = b.conv(xt, w, stride=a["stride"], padding=a["padding"], dilation=a["dilation"],
                    groups=a["groups"], channels_last=1,
                    result_type=_tensor([ys[p] for p in TO_LAST], ir.RankedTensorType(y.type).element_type))
        out = b.transpose(yt, perm=list(TO_FIRST))
    y.replace_all_uses_with(out)
    op.erase()


def _pad_channels(b: GacBuilder, v: ir.Value, n: int) -> ir.Value:
    """v (N C H W, or F C KH KW) with n zero channels after its C (none: v)."""
    if not n:
        return v
    return b.pad(v, low=[0] * 4, high=[0, n, 0, 0], mode="constant", value=0.0)


def _pad_input(b: GacBuilder, x: ir.Value, n: int) -> ir.Value:
    """x (N C H W) with n zero channels after its C, as elementwise ops on a gather: the edge
    channel repeated (a replicate pad: a generic reading x) where a constant channel mask says
    so, else 0. The NHWC transpose after it, and a float cast before it (moved after the pad:
    the cast of 0 is 0), fuse into one kernel with it; a constant pad is a fill and a copy,
    each a kernel, and the transpose a third (ResNet-50's input, bf16: four kernels, 0.06 ms
    on the H200). GAC_STEM_PAD_GATHER=0: the constant pad."""
    if not n or os.environ.get("GAC_STEM_PAD_GATHER") == "0":
        return _pad_channels(b, x, n)
    elem, x = elem_of(x), space_to_depth.uncast(x)
    c = shape_of(x.type)[1]
    mask = space_to_depth.within(b, 4, 1, c + n, 0, c)
    rep = b.pad(x, low=[0] * 4, high=[0, n, 0, 0], mode="replicate", value=0.0)
    zero = b.constant(0.0, torch_dtype(elem_of(x)), [])
    return b.cast(b.select(mask, rep, zero), elem)


def _sink(b: GacBuilder, op: ir.Operation) -> bool:
    """ew(..., transpose(t, NCHW), ...) computed on the NHWC side; False when not elementwise
    over a static 4-d result with such an operand."""
    ys = shape_of(op.results[0].type)
    if len(op.results) != 1 or len(ys) != 4 or DYN in ys:
        return False
    if not any(p is not None and p[1] == TO_FIRST for p in map(_perm_of, op.operands)):
        return False
    if any(len(shape_of(v.type)) > 4 for v in op.operands):
        return False
    with ir.InsertionPoint(op), op.location:
        ins = []
        for v in op.operands:
            s = shape_of(v.type)
            if 0 < len(s) < 4:  # numpy broadcasting: align to the right first
                v = _reshape(b, v, [1] * (4 - len(s)) + list(s))
            ins.append(_permute(b, v, TO_LAST) if len(s) else v)
        elem = ir.RankedTensorType(op.results[0].type).element_type
        new = ir.Operation.create(op.name, results=[_tensor([ys[p] for p in TO_LAST], elem)], operands=ins,
                                  attributes={k: op.attributes[k] for k in op_attrs(op)})
        out = _permute(b, new.results[0], TO_FIRST)
    op.results[0].replace_all_uses_with(out)
    op.erase()
    return True


def _nhwc_pool(op: ir.Operation) -> bool:
    """A 2-D pooling of a static 4-d NCHW tensor (it runs on NHWC as well)."""
    if op.name != "gac.pool":
        return False
    xs = shape_of(op.operands[0].type)
    return len(xs) == 4 and DYN not in xs and len(op_attrs(op)["kernel"]) == 2 and not op_attrs(op)["channels_last"]


def _sink_pool(b: GacBuilder, op: ir.Operation) -> None:
    """pool(transpose(t, NCHW)) -> transpose(pool[channels_last](t), NCHW) (the max-pool after
    ResNet's stem: its conv writes NHWC, the first bottleneck reads NHWC)."""
    src = _perm_of(op.operands[0])
    if not _nhwc_pool(op) or src is None or src[1] != TO_FIRST:
        return
    a = {k: v for k, v in op_attrs(op).items() if not k.startswith("gac.")}
    with ir.InsertionPoint(op), op.location:
        y = _permute(b, b.pool(src[0], **{**a, "channels_last": 1}), TO_FIRST)
    op.results[0].replace_all_uses_with(y)
    op.erase()


def channels_last(module: ir.Module) -> ir.Module:
    b = GacBuilder()
    with module.context, ir.Location.unknown():
        for fn in module.body.operations:
            ops = [o.operation for o in fn.regions[0].blocks[0].operations]
            chained = _chained(ops)
            convs = [o for o in ops if o in chained]
            if not convs:
                continue
            inputs: dict = {}
            for op in convs:
                _to_channels_last(b, op, inputs)
            # in program order: a sunk op's NCHW transpose moves on through the ops after it
            for op in [o.operation for o in fn.regions[0].blocks[0].operations]:
                if op.name in ELEMENTWISE:
                    _sink(b, op)
                elif op.name == "gac.pool":
                    _sink_pool(b, op)
            for op in [o.operation for o in fn.regions[0].blocks[0].operations]:
                if op.name == "gac.transpose" and _perm_of(op.operands[0]) is not None:
                    with ir.InsertionPoint(op), op.location:  # a conv's NHWC input after a sunk one
                        out = _permute(b, op.operands[0], tuple(op_attrs(op)["perm"]))
                    op.results[0].replace_all_uses_with(out)
                    op.erase()
    return gac_dce(module)
