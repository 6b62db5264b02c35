"""Attention: softmax(q @ kᵀ · scale + mask) @ v as one op, so a target can run it as one fused
kernel (flash attention) instead of materialising the score matrix."""

from __future__ import annotations

from mlir import ir

from gac_torch.ir.dialect import define
from gac_torch.ir.ops._infer import GacTypeError, dims_match, shape_of, tensor


def _infer_attention(types, attrs):
    """q (..., L, D), k (..., S, D), v (..., S, Dv) with equal batch dims and element type; an
    optional mask broadcastable to (..., L, S) of the same rank: additive (q's type) or bool
    (true = attend). The result is (..., L, Dv) in q's type."""
    q, k, v = (shape_of(t) for t in types[:3])
    elems = {str(ir.RankedTensorType(t).element_type) for t in types[:3]}
    if len(elems) != 1 or elems.pop() not in ("f16", "bf16", "f32", "f64"):
        raise GacTypeError(f"gac.attention: q, k, v need one float type, got {[str(t) for t in types[:3]]}")
    if not (len(q) == len(k) == len(v) >= 2) or not all(map(dims_match, q[:-2], k[:-2])) \
            or not all(map(dims_match, k[:-1], v[:-1])) or not dims_match(q[-1], k[-1]):
        raise GacTypeError(f"gac.attention: q {list(q)}, k {list(k)}, v {list(v)} do not match")
    if len(types) > 4:
        raise GacTypeError("gac.attention: at most one mask")
    if len(types) == 4:
        m = shape_of(types[3])
        me = str(ir.RankedTensorType(types[3]).element_type)
        want = q[:-1] + (k[-2],)
        if len(m) != len(q) or not all(s == 1 or dims_match(s, w) for s, w in zip(m, want)):
            raise GacTypeError(f"gac.attention: mask {list(m)} does not broadcast to {list(want)}")
        if me not in ("i1", str(ir.RankedTensorType(types[0]).element_type)):
            raise GacTypeError(f"gac.attention: mask element type {me}")
    return [tensor(q[:-1] + (v[-1],), ir.RankedTensorType(types[0]).element_type)]


define("attention", ["q", "k", "v", "mask*"], attrs={"scale": "float", "causal": "int"},
       infer=_infer_attention,
       doc="softmax(q @ kᵀ · scale + mask) @ v over the last two dims; causal hides key j > query "
           "i (top-left aligned, as torch); a bool mask keeps the true entries; a query row with "
           "every key hidden gives 0")
