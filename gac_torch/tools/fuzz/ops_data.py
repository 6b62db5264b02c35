"""Fuzz ops: views, data movement, matrix products, nn layers and in-place ops (see table.py)."""

from __future__ import annotations

import torch

from gac_torch.tools.fuzz.table import (
    ANY,
    FLOAT,
    INT,
    NUM,
    _amax,
    _dim,
    _in,
    kind,
    op,
)


# --- views and data movement -------------------------------------------------------------------
@op("reshape", "view reshape _unsafe_view", ANY, exact=True)
def _reshape(g, a):
    return f"{a.name}.reshape(-1)" if g.rng.random() < 0.5 else f"{a.name}.reshape({a.t.numel()}, 1)"


@op("view", "view", ANY, exact=True)
def _view(g, a):
    if not a.t.is_contiguous() or a.t.dim() < 2:
        return None
    s = list(a.t.shape)
    return f"{a.name}.view({', '.join(map(str, [s[0] * s[1]] + s[2:]))})"


@op("permute", "permute", ANY, exact=True)
def _permute(g, a):
    if a.t.dim() < 2:
        return None
    p = list(range(a.t.dim()))
    g.rng.shuffle(p)
    return f"{a.name}.permute({', '.join(map(str, p))})"


@op("transpose", "transpose", ANY, exact=True)
def _transpose(g, a):
    return f"{a.name}.transpose({_dim(g, a.t)}, {_dim(g, a.t)})"


@op("unsqueeze", "unsqueeze", ANY, exact=True)
def _unsqueeze(g, a):
    return f"{a.name}.unsqueeze({g.rng.randrange(a.t.dim() + 1)})"


@op("squeeze", "squeeze", ANY, exact=True)
def _squeeze(g, a):
    return f"{a.name}.squeeze({_dim(g, a.t)})" if g.rng.random() < 0.6 else f"{a.name}.squeeze()"


@op("expand", "expand", ANY, exact=True)
def _expand(g, a):
    return f"{a.name}.expand(2, *{tuple(a.t.shape)})"


@op("flip", "flip", ANY, exact=True)
def _flip(g, a):
    return f"{a.name}.flip({_dim(g, a.t)})"


@op("roll", "roll", ANY, exact=True)
def _roll(g, a):
    return f"{a.name}.roll({g.rng.choice([1, -2])}, {_dim(g, a.t)})" if a.t.dim() else None


@op("slice", "slice", ANY, exact=True)
def _slice(g, a):
    if a.t.dim() == 0:
        return None
    d = g.rng.randrange(a.t.dim())
    idx = ", ".join([":"] * d + [g.rng.choice(["1:", "::2", ":-1", "1:3"])])
    return f"{a.name}[{idx}]"


@op("select", "select", ANY, exact=True)
def _select(g, a):
    if a.t.dim() == 0 or a.t.shape[0] == 0:
        return None
    return f"{a.name}[{g.rng.choice([0, -1])}]"


@op("narrow", "slice", ANY, exact=True)
def _narrow(g, a):
    if a.t.dim() == 0 or a.t.shape[-1] < 2:
        return None
    return f"{a.name}.narrow(-1, 1, {a.t.shape[-1] - 1})"


@op("cat", "cat", (ANY, ANY), exact=True)
def _cat(g, a, b):
    return f"torch.cat([{a.name}, {b.name}], {_dim(g, a.t)})"


@op("stack", "stack cat", (ANY, ANY), exact=True)
def _stack(g, a, b):
    return f"torch.stack([{a.name}, {b.name}])"


@op("split", "split split_with_sizes", ANY, exact=True)
def _split(g, a):
    if a.t.dim() == 0:
        return None
    return f"{a.name}.split(2, {_dim(g, a.t)})[{g.rng.choice([0, -1])}]"


@op("repeat", "repeat", ANY, exact=True)
def _repeat(g, a):
    return f"{a.name}.repeat({', '.join(['2'] + ['1'] * a.t.dim())})"


@op("diagonal", "diagonal", ANY, exact=True)
def _diagonal(g, a):
    return f"{a.name}.diagonal()" if a.t.dim() >= 2 else None


@op("unfold", "unfold", ANY, exact=True)
def _unfold(g, a):
    return f"{a.name}.unfold(-1, 2, 1)" if a.t.dim() and a.t.shape[-1] >= 2 else None


@op("pad", "constant_pad_nd", ANY, exact=True)
def _pad(g, a):
    return f"F.pad({a.name}, (1, 2))" if a.t.dim() else None


@op("contiguous", "clone", ANY, exact=True)
def _contiguous(g, a):
    return f"{a.name}.contiguous()"


@op("cast", "_to_copy convert_element_type", ANY)
def _cast(g, a):
    dt = g.rng.choice(["F32", "F16", "BF16", "torch.int64", "torch.int32", "torch.bool"])
    if kind(a.t) == FLOAT and dt.startswith("torch.int") and not a.exact:
        return None  # truncation of a value with rounding error
    if dt.startswith("torch.int") and kind(a.t) == FLOAT and (_amax(a.t) > 1e4 or not a.t.isfinite().all()):
        return None  # out of range: undefined
    if dt == "torch.bool" and kind(a.t) == FLOAT and not a.exact:
        return None
    return f"{a.name}.to({dt})"


@op("index_select", "index_select", ANY, exact=True)
def _index_select(g, a):
    if a.t.dim() == 0 or a.t.shape[-1] == 0:
        return None
    n = a.t.shape[-1]
    idx = [g.rng.randrange(n) for _ in range(3)]
    return f"{a.name}.index_select(-1, torch.tensor({idx}, device={a.name}.device))"


@op("index", "index", ANY, exact=True)
def _index(g, a):
    if a.t.dim() == 0 or a.t.shape[0] == 0:
        return None
    idx = [g.rng.randrange(-a.t.shape[0], a.t.shape[0]) for _ in range(2)]
    return f"{a.name}[torch.tensor({idx}, device={a.name}.device)]"


@op("gather", "gather", ANY, exact=True)
def _gather(g, a):
    if a.t.dim() == 0 or a.t.numel() == 0:
        return None
    n = a.t.shape[-1]
    shape = list(a.t.shape[:-1]) + [2]
    return f"{a.name}.gather(-1, {g.const(f'torch.randint(0, {n}, {tuple(shape)}, generator=G)')})"


@op("sort", "sort", NUM, exact=True)
def _sort(g, a):
    if a.exact and g.rng.random() < 0.5:  # indices only where the order of ties is defined
        return f"torch.sort({a.name}, {_dim(g, a.t)}, stable=True)[1]"
    return f"torch.sort({a.name}, {_dim(g, a.t)}, descending={g.rng.random() < 0.5})[0]"


@op("topk", "topk", NUM, exact=True)
def _topk(g, a):
    if a.t.dim() == 0 or a.t.shape[-1] < 2:
        return None
    return f"torch.topk({a.name}, 2)[0]"


# --- matrix products and nn --------------------------------------------------------------------
@op("matmul", "mm bmm", (FLOAT, FLOAT))
def _matmul(g, a, b):
    if a.t.dim() not in (2, 3) or b.t.dim() not in (2, 3) or a.t.dtype != b.t.dtype:
        return None
    return f"{a.name} @ {b.name}"


@op("mm_t", "mm", FLOAT)
def _mm_t(g, a):
    return f"{a.name} @ {a.name}.t()" if a.t.dim() == 2 else None


@op("linear", "addmm mm", FLOAT)
def _linear(g, a):
    if a.t.dim() == 0:
        return None
    k = a.t.shape[-1]
    w = g.const(f"torch.randn(3, {k}, generator=G).to({a.dt})")
    bias = g.const(f"torch.randn(3, generator=G).to({a.dt})")
    return f"F.linear({a.name}, {w}, {bias})"


@op("conv2d", "convolution", FLOAT)
def _conv2d(g, a):
    if a.t.dim() != 4 or min(a.t.shape[2:]) < 2:
        return None
    c = a.t.shape[1]
    w = g.const(f"torch.randn(2, {c}, 2, 2, generator=G).to({a.dt})")
    return f"F.conv2d({a.name}, {w}, padding={g.rng.choice([0, 1])})"


@op("avg_pool2d", "avg_pool2d", FLOAT)
def _avg_pool(g, a):
    if a.t.dim() not in (3, 4) or min(a.t.shape[-2:]) < 2:
        return None
    return f"F.avg_pool2d({a.name}, 2, {g.rng.choice([1, 2])})"


@op("max_pool2d", "max_pool2d_with_indices", FLOAT, exact=True)
def _max_pool(g, a):
    if a.t.dim() not in (3, 4) or min(a.t.shape[-2:]) < 2:
        return None
    return f"F.max_pool2d({a.name}, 2, {g.rng.choice([1, 2])})"


@op("adaptive_avg_pool2d", "_adaptive_avg_pool2d", FLOAT)
def _adaptive(g, a):
    if a.t.dim() not in (3, 4) or min(a.t.shape[-2:]) < 1:
        return None
    return f"F.adaptive_avg_pool2d({a.name}, {g.rng.choice([1, 2, 3])})"


@op("interpolate", "upsample_nearest2d upsample_bilinear2d", FLOAT)
def _interp(g, a):
    if a.t.dim() != 4 or a.t.numel() == 0:
        return None
    mode = g.rng.choice(["nearest", "bilinear"])
    extra = ", align_corners=False" if mode == "bilinear" else ""
    return f"F.interpolate({a.name}, scale_factor=2, mode={mode!r}{extra})"


@op("layer_norm", "native_layer_norm", FLOAT)
def _layer_norm(g, a):
    if a.t.dim() == 0:
        return None
    return f"F.layer_norm({a.name}, ({a.t.shape[-1]},))"


@op("group_norm", "native_group_norm", FLOAT)
def _group_norm(g, a):
    if a.t.dim() < 2 or a.t.numel() == 0:
        return None
    return f"F.group_norm({a.name}, 1)"


@op("batch_norm", "_native_batch_norm_legit_no_training", FLOAT)
def _batch_norm(g, a):
    if a.t.dim() < 2:
        return None
    c = a.t.shape[1]
    mean = g.const(f"torch.randn({c}, generator=G).to({a.dt})")
    var = g.const(f"(torch.rand({c}, generator=G) + 0.5).to({a.dt})")
    return f"F.batch_norm({a.name}, {mean}, {var}, training=False)"


# --- in-place (on intermediates, or on an input: feature input_mutation) -----------------------
@op("add_", "add", (NUM, NUM), inplace=True)
def _add_(g, a, b):
    return f"{a.name}.add_({b.name})"


@op("mul_", "mul", NUM, inplace=True, exact=True)
def _mul_(g, a):
    return f"{a.name}.mul_(2)"


@op("clamp_", "clamp", NUM, inplace=True, exact=True)
def _clamp_(g, a):
    return f"{a.name}.clamp_(min=-1)"


@op("relu_", "relu", NUM, inplace=True, exact=True)
def _relu_(g, a):
    return f"{a.name}.relu_()"


@op("slice_assign", "slice_scatter copy", (NUM, NUM), inplace=True, exact=True)
def _slice_assign(g, a, b):
    if a.t.dim() == 0 or a.t.shape[0] < 1:
        return None
    return f"{a.name}[:1].copy_({b.name})"


@op("index_put_", "index_put", NUM, inplace=True, exact=True)
def _index_put(g, a):
    if a.t.dim() == 0 or a.t.shape[0] == 0:
        return None
    dev = f"device={a.name}.device"
    return f"{a.name}.index_put_((torch.tensor([0], {dev}),), torch.tensor(1, {dev}).to({a.dt}))"


# --- scatter, embedding, attention, sampling ---------------------------------------------------
@op("scatter_add", "scatter_add", NUM)
def _scatter_add(g, a):
    if a.t.dim() == 0 or a.t.numel() == 0:
        return None
    idx = g.const(f"torch.randint(0, {a.t.shape[-1]}, {tuple(a.t.shape)}, generator=G)")
    return f"torch.zeros_like({a.name}).scatter_add(-1, {idx}, {a.name})"


@op("scatter", "scatter", ANY, exact=True)
def _scatter(g, a):
    if a.t.dim() == 0 or a.t.numel() == 0:
        return None
    n = a.t.shape[-1]  # a permutation per row: no two writes to one place (their order is undefined)
    idx = g.const(f"torch.rand({tuple(a.t.shape)}, generator=G).argsort(-1)")
    return f"torch.zeros_like({a.name}).scatter(-1, {idx}, {a.name})" if n else None


@op("index_put_acc", "index_put", NUM)
def _index_put_acc(g, a):
    if a.t.dim() != 1 or a.t.numel() == 0:
        return None
    n = a.t.shape[0]
    dev = f"device={a.name}.device"
    where = [0, n - 1, 0][:min(3, n + 1)]  # a repeated index: accumulate adds both
    return (f"torch.zeros({n + 2}, dtype={a.dt}, {dev}).index_put((torch.tensor({where}, {dev}),), "
            f"{a.name}[:1].expand({min(3, n + 1)}), accumulate=True)")


@op("embedding", "embedding", INT, exact=True)
def _embedding(g, a):
    if a.t.numel() == 0:
        return None
    table = g.const("torch.randn(9, 3, generator=G).to(F32)")
    return f"F.embedding({a.name} + 4, {table})" if _in(a.t, -4, 4) else None


@op("sdpa", "_scaled_dot_product_flash_attention", FLOAT)
def _sdpa(g, a):
    if a.t.dim() != 4 or a.t.numel() == 0 or a.t.dtype != torch.float32:
        return None
    return f"F.scaled_dot_product_attention({a.name}, {a.name} * 0.5, {a.name})"


@op("grid_sample", "grid_sampler_2d", FLOAT)
def _grid_sample(g, a):
    if a.t.dim() != 4 or a.t.numel() == 0:
        return None
    n = a.t.shape[0]
    grid = g.const(f"(torch.rand({n}, 3, 2, 2, generator=G) * 2.2 - 1.1).to({a.dt})")
    return f"F.grid_sample({a.name}, {grid}, align_corners={g.rng.random() < 0.5})"


@op("baddbmm", "baddbmm", (FLOAT, FLOAT))
def _baddbmm(g, a, b):
    if a.t.dim() != 3 or b.t.dim() != 3 or a.t.dtype != b.t.dtype:
        return None
    return f"torch.baddbmm({a.name} @ {b.name}, {a.name}, {b.name}, beta=0.5, alpha=2)"
