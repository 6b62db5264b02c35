"""Shape and data-movement ONNX ops. Shape-like inputs (shape, axes, starts, repeats, split)
must be static; on static shapes, Shape/Size produce known tensors, so shape arithmetic folds."""

from __future__ import annotations

import math

import torch

from gac_torch.frontends.onnx.builder import GraphBuilder, Value
from gac_torch.frontends.onnx.registry import OnnxNode, Unsupported, onnx_op

aten = torch.ops.aten


@onnx_op("Shape")
def shape(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    dims = g.shape(x)
    start, end = n.attr("start", 0), n.attr("end", len(dims))  # opset 15: start/end slice
    return torch.tensor(dims[start:end], dtype=torch.int64)


@onnx_op("Size")
def size(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    return torch.tensor(math.prod(g.shape(x)), dtype=torch.int64)


@onnx_op("Constant")
def constant(g: GraphBuilder, n: OnnxNode) -> Value:
    a = n.attrs
    if "value" in a:
        return torch.from_numpy(a["value"].copy())
    for key, dtype in (
        ("value_float", torch.float32),
        ("value_floats", torch.float32),
        ("value_int", torch.int64),
        ("value_ints", torch.int64),
    ):
        if key in a:
            return torch.tensor(a[key], dtype=dtype)
    raise Unsupported(f"attribute {next(iter(a), '?')} (string and sparse constants)")


@onnx_op("ConstantOfShape")
def constant_of_shape(g: GraphBuilder, n: OnnxNode, shp: Value) -> Value:
    value = n.attr("value")
    v = torch.from_numpy(value.copy()).flatten() if value is not None else torch.zeros(1)
    return torch.full(g.ints(shp, "ConstantOfShape shape"), v[0].item(), dtype=v.dtype)


@onnx_op("Range")
def range_(g: GraphBuilder, n: OnnxNode, start: Value, limit: Value, delta: Value) -> Value:
    s, e, d = (
        g.scalar(v, f"Range {w}") for v, w in ((start, "start"), (limit, "limit"), (delta, "delta"))
    )
    return torch.arange(s, e, d, dtype=g.dtype(start))


@onnx_op("Reshape")
def reshape(g: GraphBuilder, n: OnnxNode, x: Value, shp: Value) -> Value:
    dims, src = g.ints(shp, "Reshape shape"), g.shape(x)
    if not n.attr("allowzero", 0):  # 0 copies the input's dim
        dims = [src[i] if d == 0 else d for i, d in enumerate(dims)]
    return g.call(aten.reshape.default, x, dims)


@onnx_op("Flatten")
def flatten(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    dims = g.shape(x)
    axis = n.attr("axis", 1) % (len(dims) + 1) if dims else 0
    return g.call(aten.reshape.default, x, [math.prod(dims[:axis]), math.prod(dims[axis:])])


@onnx_op("Transpose")
def transpose(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    perm = n.attr("perm") or list(reversed(range(g.rank(x))))
    return g.call(aten.permute.default, x, list(perm))


def _axes_of(g: GraphBuilder, n: OnnxNode, axes: Value | None) -> list[int] | None:
    return n.attr("axes") if n.attr("axes") is not None else g.ints(axes, f"{n.op_type} axes")


@onnx_op("Squeeze")
def squeeze(g: GraphBuilder, n: OnnxNode, x: Value, axes: Value | None = None) -> Value:
    dims = g.shape(x)
    given = _axes_of(g, n, axes)
    drop = [a % len(dims) for a in given] if given else [i for i, d in enumerate(dims) if d == 1]
    return g.call(aten.reshape.default, x, [d for i, d in enumerate(dims) if i not in drop])


@onnx_op("Unsqueeze")
def unsqueeze(g: GraphBuilder, n: OnnxNode, x: Value, axes: Value | None = None) -> Value:
    dims, new = g.shape(x), _axes_of(g, n, axes) or []
    for a in sorted(a % (len(dims) + len(new)) for a in new):
        dims.insert(a, 1)
    return g.call(aten.reshape.default, x, dims)


@onnx_op("Concat")
def concat(g: GraphBuilder, n: OnnxNode, *xs: Value) -> Value:
    axis = n.attr("axis") % g.rank(xs[0])
    parts = [x for x in xs if g.shape(x)[axis] != 0] or [xs[0]]
    return g.call(aten.cat.default, parts, axis)


@onnx_op("Split")
def split(g: GraphBuilder, n: OnnxNode, x: Value, sizes: Value | None = None) -> list[Value]:
    axis = n.attr("axis", 0) % g.rank(x)
    dim = g.shape(x)[axis]
    given = n.attr("split") or g.ints(sizes, "Split split")  # attribute before opset 13
    if not given:  # equal parts; opset 18's num_outputs allows a smaller last part
        k = n.attr("num_outputs", len(n.proto.output))
        step = -(-dim // k)
        given = [min(step, dim - i * step) for i in range(k)]
    return list(g.call(aten.split_with_sizes.default, x, list(given), axis))


@onnx_op("Expand")
def expand(g: GraphBuilder, n: OnnxNode, x: Value, shp: Value) -> Value:
    dims = g.ints(shp, "Expand shape")
    out = list(torch.broadcast_shapes(tuple(g.shape(x)), tuple(dims)))  # bidirectional
    return g.call(aten.expand.default, x, out)


@onnx_op("Tile")
def tile(g: GraphBuilder, n: OnnxNode, x: Value, repeats: Value) -> Value:
    return g.call(aten.repeat.default, x, g.ints(repeats, "Tile repeats"))


@onnx_op("Slice")
def slice_(
    g: GraphBuilder,
    n: OnnxNode,
    x: Value,
    starts: Value,
    ends: Value,
    axes: Value | None = None,
    steps: Value | None = None,
) -> Value:
    s, e = g.ints(starts, "Slice starts"), g.ints(ends, "Slice ends")
    dims = g.shape(x)
    ax = g.ints(axes, "Slice axes") or list(range(len(s)))
    st = g.ints(steps, "Slice steps") or [1] * len(s)
    for start, end, a, step in zip(s, e, ax, st):
        a %= len(dims)
        lo, hi, _ = slice(start, end, step).indices(dims[a])  # numpy's clamping, as ONNX
        if step > 0:
            if (lo, hi, step) != (0, dims[a], 1):
                x = g.call(aten.slice.Tensor, x, a, lo, max(hi, lo), step)
        else:  # negative steps gather their (static) indices
            x = g.call(aten.index_select.default, x, a, torch.arange(lo, hi, step))
    return x


def _normalized_indices(g: GraphBuilder, idx: Value, size: int) -> Value:
    """ONNX indices may be negative (counted from the end); ATen's must not."""
    if g.is_const(idx):
        return torch.where(idx < 0, idx + size, idx).to(torch.int64)
    idx = g.cast(idx, torch.int64)
    return g.call(
        aten.where.self, g.call(aten.lt.Scalar, idx, 0), g.call(aten.add.Scalar, idx, size), idx
    )


@onnx_op("Gather")
def gather(g: GraphBuilder, n: OnnxNode, x: Value, idx: Value) -> Value:
    dims = g.shape(x)
    axis = n.attr("axis", 0) % len(dims)
    idx = _normalized_indices(g, idx, dims[axis])
    ishape = g.shape(idx)
    if g.is_const(idx) and not ishape:  # a scalar index: select
        return g.call(aten.select.int, x, axis, int(idx))
    flat = g.call(aten.reshape.default, idx, [-1])
    y = g.call(aten.index_select.default, x, axis, flat)
    return g.call(aten.reshape.default, y, dims[:axis] + ishape + dims[axis + 1 :])


@onnx_op("GatherElements")
def gather_elements(g: GraphBuilder, n: OnnxNode, x: Value, idx: Value) -> Value:
    axis = n.attr("axis", 0) % g.rank(x)
    return g.call(aten.gather.default, x, axis, _normalized_indices(g, idx, g.shape(x)[axis]))


@onnx_op("GatherND")
def gather_nd(g: GraphBuilder, n: OnnxNode, x: Value, idx: Value) -> Value:
    """x[idx[..., 0], ..., idx[..., k-1]] as one index_select over x's first k dims flattened."""
    if n.attr("batch_dims", 0):
        raise Unsupported("batch_dims != 0")
    dims, ishape = g.shape(x), g.shape(idx)
    k = ishape[-1]
    linear: Value | None = None
    for i in range(k):
        col = _normalized_indices(g, g.call(aten.select.int, idx, -1, i), dims[i])
        term = g.call(aten.mul.Scalar, col, math.prod(dims[i + 1 : k]))
        linear = term if linear is None else g.call(aten.add.Tensor, linear, term)
    flat = g.call(aten.reshape.default, x, [math.prod(dims[:k])] + dims[k:])
    y = g.call(aten.index_select.default, flat, 0, g.call(aten.reshape.default, linear, [-1]))
    return g.call(aten.reshape.default, y, ishape[:-1] + dims[k:])


@onnx_op("Trilu")
def trilu(g: GraphBuilder, n: OnnxNode, x: Value, k: Value | None = None) -> Value:
    diag = 0 if k is None else int(g.scalar(k, "Trilu k"))
    return g.call(aten.triu.default if n.attr("upper", 1) else aten.tril.default, x, diag)


@onnx_op("DepthToSpace", "SpaceToDepth")
def depth_space(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    b = n.attr("blocksize")
    N, C, H, W = g.shape(x)
    if n.op_type == "SpaceToDepth":
        y = g.call(aten.reshape.default, x, [N, C, H // b, b, W // b, b])
        y = g.call(aten.permute.default, y, [0, 3, 5, 1, 2, 4])
        return g.call(aten.reshape.default, y, [N, C * b * b, H // b, W // b])
    if n.attr("mode", "DCR") == "DCR":
        y = g.call(aten.reshape.default, x, [N, b, b, C // (b * b), H, W])
        y = g.call(aten.permute.default, y, [0, 3, 4, 1, 5, 2])
    else:  # CRD
        y = g.call(aten.reshape.default, x, [N, C // (b * b), b, b, H, W])
        y = g.call(aten.permute.default, y, [0, 1, 4, 2, 5, 3])
    return g.call(aten.reshape.default, y, [N, C // (b * b), H * b, W * b])


@onnx_op("TopK")
def topk(g: GraphBuilder, n: OnnxNode, x: Value, k: Value) -> list[Value]:
    axis = n.attr("axis", -1) % g.rank(x)
    return list(
        g.call(
            aten.topk.default, x, int(g.scalar(k, "TopK k")), axis, bool(n.attr("largest", 1)), True
        )
    )


@onnx_op("NonZero")
def nonzero(g: GraphBuilder, n: OnnxNode, x: Value) -> Value:
    # The output's shape depends on the data: only a known input can be handled.
    return torch.stack(torch.nonzero(g.const(x, "NonZero input"), as_tuple=True)).to(torch.int64)


@onnx_op("OneHot")
def one_hot(g: GraphBuilder, n: OnnxNode, idx: Value, depth: Value, values: Value) -> Value:
    d = int(g.scalar(depth, "OneHot depth"))
    off, on = g.const(values, "OneHot values").flatten().tolist()
    idx = _normalized_indices(g, idx, d)
    axis = n.attr("axis", -1) % (g.rank(idx) + 1)
    classes = torch.arange(d).reshape([d] + [1] * (g.rank(idx) - axis))
    hit = g.call(aten.eq.Tensor, g.call(aten.unsqueeze.default, idx, axis), classes)
    dtype = g.dtype(values)
    return g.call(
        aten.where.self, hit, torch.tensor(on, dtype=dtype), torch.tensor(off, dtype=dtype)
    )
