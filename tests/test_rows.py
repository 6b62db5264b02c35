"""One pass per row (kernels/rows.py, strategies/row.py): the numpy twin runs the kernel's
schedule on odd shapes against float64 numpy (indexing, masks, barriers); on the CPU, the cuda
target compiles LayerNorm / RMSNorm / softmax / log_softmax to ONE kernel that ptxas accepts
without spills; on the H200 (marked cuda), parity with eager against a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from gac_torch.kernels import rows
from gac_torch.kernels.builder import RaceError, round_to
from gac_torch.kernels.rows import Math, Node

# ------------------------------------------------------------------------------------------------
# the numpy twin


def _layernorm(x: np.ndarray, w: np.ndarray, bias: np.ndarray, C: int, pick: bool = False):
    """The graph LayerNorm lowers to: shift by x[:, 0], mean, centre, variance, normalise.
    `pick`: the shift is column 0 of a computed value (f16 LayerNorm: of x in f32)."""
    shift = Node("pick", "row", (0,), at=0) if pick else Node("load", "row")
    nodes = [Node("load", "full"), shift, Node("load", "col"), Node("load", "col"),
             Node("map", "full", (0, 1)),  # 4: d = x - x0
             Node("reduce", "row", (4,)),  # 5: sum d
             Node("map", "full", (4, 5)),  # 6: c = d - sum / C
             Node("reduce", "row", (6,)),  # 7: sum c^2
             Node("map", "full", (6, 7, 2, 3), out=True)]  # 8: c * rsqrt(var + eps) * w + b
    m = [Math(data=x.ravel()), Math(data=x[:, 0].copy()), Math(data=w), Math(data=bias),
         Math(lambda a, b: a - b), Math(lambda d: d, "add"), Math(lambda d, s: d - s / C),
         Math(lambda c: c * c, "add"), Math(lambda c, v, w, b: c / np.sqrt(v / C + 1e-5) * w + b)]
    xc = x - x.mean(1, keepdims=True)
    ref = xc / np.sqrt((xc * xc).mean(1, keepdims=True) + 1e-5) * w + bias
    return nodes, m, {8: ref.ravel()}


def _softmax(x: np.ndarray, C: int, log: bool):
    nodes = [Node("load", "full"), Node("reduce", "row", (0,)),  # 1: max
             Node("map", "full", (0, 1)),  # 2: x - max
             Node("reduce", "row", (2,)),  # 3: sum exp
             Node("map", "full", (2, 3), out=True), Node("map", "row", (3,), out=True)]  # 5: log-sum
    m = [Math(data=x.ravel()), Math(lambda v: v, "max", init=-np.inf), Math(lambda a, b: a - b),
         Math(np.exp, "add"), Math((lambda d, s: d - np.log(s)) if log else (lambda d, s: np.exp(d) / s)),
         Math(np.log)]
    z = x - x.max(1, keepdims=True)
    s = np.exp(z).sum(1, keepdims=True)
    return nodes, m, {4: (z - np.log(s) if log else np.exp(z) / s).ravel(), 5: np.log(s).ravel()}


def _rmsnorm(x: np.ndarray, w: np.ndarray, C: int, acc: str):
    nodes = [Node("load", "full"), Node("load", "col"), Node("reduce", "row", (0,), out=True),
             Node("map", "full", (0, 2, 1), out=True)]
    m = [Math(data=x.ravel(), acc=acc), Math(data=w, acc=acc), Math(lambda v: v * v, "add"),
         Math(lambda v, s, w: v / np.sqrt(s / C + 1e-6) * w, acc=acc)]
    x64 = x.astype(np.float64)
    s = (x64 * x64).sum(1, keepdims=True)
    return nodes, m, {2: s.ravel(), 3: (x64 / np.sqrt(s / C + 1e-6) * w).ravel()}


def _groupnorm(x: np.ndarray, w: np.ndarray, bias: np.ndarray, G: int, HW: int):
    """GroupNorm: rows are (n, g), the affine weight is per channel c = (r * C + col) // HW % Ch
    (an `other` leaf: its index crosses rows)."""
    R, C = x.shape
    Ch = w.size
    chan = lambda flat: (flat // HW) % Ch  # noqa: E731
    nodes = [Node("load", "full"), Node("reduce", "row", (0,)), Node("map", "full", (0, 1)),
             Node("reduce", "row", (2,)), Node("load", "other"), Node("load", "other"),
             Node("map", "full", (2, 3, 4, 5), out=True)]
    m = [Math(data=x.ravel()), Math(lambda v: v, "add"), Math(lambda v, s: v - s / C),
         Math(lambda c: c * c, "add"), Math(data=w, index=chan), Math(data=bias, index=chan),
         Math(lambda c, v, w, b: c / np.sqrt(v / C + 1e-5) * w + b)]
    xc = x - x.mean(1, keepdims=True)
    y = xc / np.sqrt((xc * xc).mean(1, keepdims=True) + 1e-5)
    flat = np.arange(R * C)
    return nodes, m, {6: y.ravel() * w[chan(flat)] + bias[chan(flat)]}


@pytest.mark.parametrize("N,Ch,G,HW", [(2, 6, 3, 7), (3, 8, 2, 96), (2, 64, 8, 1024), (1, 4, 1, 40000)])
def test_groupnorm_emulated_on_cpu(N: int, Ch: int, G: int, HW: int) -> None:
    rng = np.random.default_rng(N * Ch + HW)
    R, C = N * G, Ch // G * HW
    x = rng.standard_normal((R, C))
    w, bias = rng.uniform(0.5, 1.5, Ch), rng.standard_normal(Ch)
    nodes, m, ref = _groupnorm(x, w, bias, G, HW)
    vec = 4 if C % 4 == 0 else 1
    got = rows.emulate(rows.plan(R, C, vec), nodes, m)
    assert np.linalg.norm(got[6] - ref[6]) / np.linalg.norm(ref[6]) <= 1e-5


@pytest.mark.parametrize("R,C,vec", [(5, 1, 1), (3, 7, 1), (9, 1000, 4), (2, 4097, 1), (4, 2048, 4),
                                     (3, 96, 4), (2, 40000, 4), (1, 70001, 1)])  # the last two: streamed
@pytest.mark.parametrize("which", ["layernorm", "layernorm_pick", "softmax", "log_softmax", "rmsnorm_f16"])
def test_rows_emulated_on_cpu(which: str, R: int, C: int, vec: int) -> None:
    rng = np.random.default_rng(R * 1009 + C)
    x = rng.standard_normal((R, C)) * 2 + 0.5
    w, bias = rng.uniform(0.5, 1.5, C), rng.standard_normal(C)
    if which.startswith("layernorm"):
        nodes, m, ref = _layernorm(x, w, bias, C, which.endswith("pick"))
    elif which == "rmsnorm_f16":
        x, w = round_to(x, "f16"), round_to(w, "f16")
        nodes, m, ref = _rmsnorm(x, w, C, "f16")
    else:
        nodes, m, ref = _softmax(x, C, which == "log_softmax")
    p = rows.plan(R, C, vec)
    assert p is not None and (p.trips > 1) == (C > 32 * 1024)
    got = rows.emulate(p, nodes, m)
    tol = 2e-3 if which.endswith("f16") else 1e-5
    for n, want in ref.items():
        err = np.linalg.norm(got[n] - want) / max(np.linalg.norm(want), 1e-30)
        assert err <= tol, (n, err)


def test_rows_plan() -> None:
    assert rows.plan(65536, 1024, 4) == rows.Plan(65536, 1024, 4, 64, 4, 64)  # 16 values a thread
    assert rows.plan(2500, 256, 4) == rows.Plan(2500, 256, 4, 32, 2, 256)  # a warp per row
    assert rows.plan(3, 7, 1) == rows.Plan(3, 7, 1, 8, 1, 256)  # 8 lanes, 32 rows per block
    assert rows.plan(32768, 2048, 4) == rows.Plan(32768, 2048, 4, 128, 4, 128)  # a block per row
    assert rows.plan(4, 4097, 1).group == 512
    assert rows.plan(4, 30000, 4) == rows.Plan(4, 30000, 4, 1024, 8, 1024)  # up to 32 values
    assert rows.plan(1, 1 << 20, 4) == rows.Plan(1, 1 << 20, 4, 1024, 4, 1024, 32, 64)  # streamed


def test_rows_emulation_catches_a_missing_barrier(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(0).standard_normal((2, 2048))
    nodes, m, _ = _softmax(x, 2048, False)
    p = rows.plan(2, 2048, 4)
    assert p is not None and p.group > p.warp
    monkeypatch.setattr(rows._Numpy, "barrier", lambda self: None)
    with pytest.raises(RaceError):
        rows.emulate(p, nodes, m)


# ------------------------------------------------------------------------------------------------
# the cuda target: one kernel per norm (CPU: PTX + ptxas), parity on the GPU

import re  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gac_torch  # noqa: E402
from gac_torch.backends.cuda.ptxas import assemble, find_ptxas  # noqa: E402
from tests.parity import Fn  # noqa: E402


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


NORMS = {  # name -> (fn, takes a weight and bias)
    "layernorm": (lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5), 2),
    "rmsnorm": (lambda x, w: _rms(x, w), 1),
    "softmax": (lambda x: torch.softmax(x, -1), 0),
    "log_softmax": (lambda x: torch.log_softmax(x, -1), 0),
    "softmax_scaled_3d": (lambda x: torch.softmax(x * 0.125 + 1.0, -1), 0),
    # the LayerNorm's input is computed (as after a residual add): its shift x[:, 0] is picked
    "computed_layernorm": (lambda x, w, b: F.layer_norm(x * 2 + 1, x.shape[-1:], w, b, 1e-5), 2),
}


def _inputs(name: str, shape: tuple[int, ...], dt: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2 + 0.5
    extra = [torch.rand(shape[-1], generator=g) + 0.5, torch.randn(shape[-1], generator=g)][:NORMS[name][1]]
    return [t.to(device=device, dtype=dt) for t in (x, *extra)]


@pytest.mark.parametrize("name,shape,dt", [
    ("layernorm", (64, 1024), torch.float32), ("rmsnorm", (64, 1024), torch.float32),
    ("softmax", (32, 2048), torch.float32), ("log_softmax", (7, 1000), torch.float32),
    ("softmax_scaled_3d", (2, 3, 4097), torch.float32), ("layernorm", (5, 7), torch.float32),
    ("layernorm", (2500, 256), torch.float32), ("layernorm", (16, 1000), torch.float16),
    ("computed_layernorm", (3, 4097), torch.bfloat16), ("rmsnorm", (8, 96), torch.bfloat16),
    ("layernorm", (128, 40000), torch.float32), ("computed_layernorm", (130, 70001), torch.float16),
    ("softmax", (2, 64, 65536), torch.bfloat16)], ids=str)  # the last three: streamed
def test_norm_is_one_kernel_without_spills(name: str, shape: tuple[int, ...], dt: torch.dtype) -> None:
    fn = NORMS[name][0]
    compiled = gac_torch.compile(Fn(fn), tuple(_inputs(name, shape, dt)), target="cuda",
                                 options={"arch": "sm_90", "fallback": False, "cache": False})
    ptx = compiled.ir("ptx")
    kernels = re.findall(r"\.entry (\w+)\(", ptx)
    assert len(kernels) == 1 and kernels[0].endswith("_row"), kernels
    assert find_ptxas() is not None, "ptxas not found (pip install nvidia-cuda-nvcc-cu12)"
    result = assemble(ptx, "sm_90")
    assert result.ok, result.log
    assert re.findall(r"(\d+) bytes spill stores", result.log) == ["0"], result.log


GROUP_NORM_SHAPES = [(2, 8, 5, 7), (4, 64, 32, 32), (3, 12, 1, 1), (2, 32, 50, 50)]


def _group_norm_inputs(shape, dt, device="cpu"):
    g = torch.Generator().manual_seed(sum(shape))
    x, w, b = torch.randn(shape, generator=g), torch.rand(shape[1], generator=g) + 0.5, torch.randn(shape[1], generator=g)
    return [t.to(device=device, dtype=dt) for t in (x, w, b)]


def _group_norm(x, w, b):
    return F.group_norm(x, 4, w, b, 1e-5)  # rows (n, group); the weight per channel crosses rows


@pytest.mark.parametrize("shape", GROUP_NORM_SHAPES[:2], ids=str)
def test_group_norm_is_one_kernel(shape) -> None:
    compiled = gac_torch.compile(Fn(_group_norm), tuple(_group_norm_inputs(shape, torch.float32)), target="cuda",
                                 options={"arch": "sm_90", "fallback": False, "cache": False})
    kernels = re.findall(r"\.entry (\w+)\(", compiled.ir("ptx"))
    assert len(kernels) == 1 and kernels[0].endswith("_row"), kernels
    result = assemble(compiled.ir("ptx"), "sm_90")
    assert result.ok and re.findall(r"(\d+) bytes spill stores", result.log) == ["0"], result.log


@pytest.mark.cuda
@pytest.mark.parametrize("dt", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", GROUP_NORM_SHAPES, ids=str)
def test_group_norm_parity_on_cuda(shape, dt) -> None:
    inputs = _group_norm_inputs(shape, dt, "cuda")
    compiled = gac_torch.compile(Fn(_group_norm), tuple(inputs), target="cuda", options={"fallback": False})
    out, ref, eager = compiled(*inputs), _group_norm(*[t.double() for t in inputs]), _group_norm(*inputs)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    err_eager = ((eager.double() - ref).norm() / ref.norm()).item()
    assert err <= max(1e-5 if dt == torch.float32 else 2e-3 if dt == torch.float16 else 1e-2, 2 * err_eager), err


CUDA_SHAPES = [(1, 1), (3, 7), (9, 1000), (2, 4097), (33, 96), (4, 2, 2048), (2500, 256)]


@pytest.mark.cuda
@pytest.mark.parametrize("dt", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("name", list(NORMS))
def test_norm_parity_on_cuda(name: str, shape: tuple[int, ...], dt: torch.dtype) -> None:
    fn = NORMS[name][0]
    inputs = _inputs(name, shape, dt, "cuda", seed=sum(shape))
    compiled = gac_torch.compile(Fn(fn), tuple(inputs), target="cuda", options={"fallback": False})
    out = compiled(*inputs)
    ref = fn(*[t.double() for t in inputs])
    eager = fn(*inputs)
    norm = ref.norm().clamp_min(1e-30)  # log_softmax of one column is all zeros
    err = ((out.double() - ref).norm() / norm).item()
    err_eager = ((eager.double() - ref).norm() / norm).item()
    assert not out.isnan().any() and err <= max(1e-5 if dt == torch.float32 else 2e-3 if dt == torch.float16
                                                 else 1e-2, 2 * err_eager), (err, err_eager)


@pytest.mark.cuda
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(128, 40000), (130, 70001)], ids=str)
@pytest.mark.parametrize("name", ["layernorm", "computed_layernorm", "rmsnorm", "softmax", "log_softmax"])
def test_long_row_parity_on_cuda(name: str, shape: tuple[int, ...], dt: torch.dtype) -> None:
    test_norm_parity_on_cuda(name, shape, dt)  # rows streamed through registers, one pass per reduction


@pytest.mark.cuda
def test_norm_parity_on_a_non_contiguous_input() -> None:
    x = torch.randn(300, 64, device="cuda").t()  # 64 rows of 300, strided
    fn = NORMS["softmax"][0]
    compiled = gac_torch.compile(Fn(fn), (x,), target="cuda", options={"fallback": False})
    ref = fn(x.double())
    assert ((compiled(x).double() - ref).norm() / ref.norm()).item() <= 1e-5


# streaming cache hints (GAC_ROWS_STREAM, opt-in; `auto`: tensors of 64 MiB and up): full-row vectors
# read `ld.global.nc.L1::no_allocate`, written `st.global.cs`, through inline PTX
STREAM_CASES = [("layernorm", (9, 1000), torch.float32), ("rmsnorm", (33, 96), torch.bfloat16),
                ("softmax", (2, 4098), torch.float32), ("computed_layernorm", (3, 2, 2050), torch.float16),
                ("log_softmax", (7, 6), torch.float16), ("layernorm", (5, 7), torch.float32),
                ("layernorm", (130, 70002), torch.float32), ("softmax", (2, 3, 20000), torch.bfloat16),
                ("softmax", (130, 40002), torch.float32), ("softmax_scaled_3d", (3, 5, 333), torch.float32)]
# (odd rows: scalar accesses, no hints; (130, ...): rows streamed through registers)


@pytest.mark.parametrize("name,shape,dt", STREAM_CASES, ids=str)
def test_stream_hints_assemble(name: str, shape: tuple[int, ...], dt: torch.dtype,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    fn, ptx, launches = NORMS[name][0], {}, {}
    for mode in ("all", "0"):
        monkeypatch.setenv("GAC_ROWS_STREAM", mode)  # (the host program's dataflow check runs too)
        compiled = gac_torch.compile(Fn(fn), tuple(_inputs(name, shape, dt)), target="cuda",
                                     options={"arch": "sm_90", "fallback": False, "cache": False})
        ptx[mode] = compiled.ir("ptx")
        launches[mode] = [line for line in compiled.ir("gpu").splitlines() if line.startswith("// launch")]
        result = assemble(ptx[mode], "sm_90")
        assert result.ok and re.findall(r"(\d+) bytes spill stores", result.log) == ["0"], result.log
    hinted = shape[-1] % 2 == 0  # vectors of 2+ elements: 4 to 16 bytes
    assert ("ld.global.nc.L1::no_allocate" in ptx["all"]) == hinted and ("st.global.cs" in ptx["all"]) == hinted
    assert "L1::no_allocate" not in ptx["0"] and "st.global.cs" not in ptx["0"]
    assert launches["all"] == launches["0"]  # inputs read (r), outputs written (W): through the asm too
    if shape == (9, 1000):  # 4 slots of 64 lanes x 4 floats: one address, the slots as immediates
        assert re.findall(r"no_allocate\.v4\.b32 \{[^}]*\}, \[%rd\d+\+(\d+)\]", ptx["all"]) == ["1024", "2048", "3072"]
        assert re.findall(r"st\.global\.cs\.v4\.b32 \[%rd\d+\+(\d+)\]", ptx["all"]) == ["1024", "2048", "3072"]


@pytest.mark.parametrize("shape,dt", [((7, 1000), torch.float32), ((3, 5, 333), torch.float16),
                                      ((130, 40002), torch.float32)], ids=str)  # (the last: streamed)
def test_softmax_divides_once_a_row(shape, dt, monkeypatch: pytest.MonkeyPatch) -> None:
    """GAC_ROWS_RCP (opt-in): softmax's x / sum as x * (1 / sum), one correctly rounded
    reciprocal a thread and row (a chunk, streamed), not a division sequence an element."""
    ptx = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("GAC_ROWS_RCP", mode)
        compiled = gac_torch.compile(Fn(NORMS["softmax"][0]), tuple(_inputs("softmax", shape, dt)), target="cuda",
                                     options={"arch": "sm_90", "fallback": False, "cache": False})
        ptx[mode] = compiled.ir("ptx")
        assert assemble(ptx[mode], "sm_90").ok
    assert "div.rn.f32" not in ptx["1"] and ptx["1"].count("rcp.rn.f32") == 1
    assert ptx["0"].count("div.rn.f32") >= 2 and "rcp.rn.f32" not in ptx["0"]


def test_stream_hints_only_past_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:  # (64 MiB: here 256 KiB)
    monkeypatch.setenv("GAC_ROWS_STREAM", "auto")
    small = gac_torch.compile(Fn(NORMS["softmax"][0]), (torch.randn(64, 1024),), target="cuda",
                              options={"arch": "sm_90", "fallback": False, "cache": False})
    assert "ld.global.nc.v4" in small.ir("ptx") and "st.global.cs" not in small.ir("ptx")


@pytest.mark.cuda
@pytest.mark.parametrize("name,shape,dt", STREAM_CASES, ids=str)
def test_stream_hints_parity_on_cuda(name: str, shape: tuple[int, ...], dt: torch.dtype,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAC_ROWS_STREAM", "all")
    test_norm_parity_on_cuda(name, shape, dt)


# ------------------------------------------------------------------------------------------------
# a reduction to a few outputs spreads over the GPU (strategies/reduce.py: split + partials)


SPLIT = {  # name -> (fn, input shapes)
    "mse_loss": (lambda x, y: F.mse_loss(x, y), [(1024, 4099), (1024, 4099)]),
    "sum_all": (lambda x: x.sum(), [(3, 100003)]),
    "amax_rows": (lambda x: x.amax(1), [(5, 70001)]),
}


def test_few_long_reductions_split_over_many_blocks() -> None:
    fn, shapes = SPLIT["mse_loss"]
    g = torch.Generator().manual_seed(1)
    compiled = gac_torch.compile(Fn(fn), tuple(torch.randn(s, generator=g) for s in shapes), target="cuda",
                                 options={"arch": "sm_90", "fallback": False, "cache": False})
    from gac_torch.backends.cuda import pipeline
    from gac_torch.backends.cuda.target import compile_options

    part = next(iter(compiled.compiled.partitions.values()))
    program = pipeline.map_stage(part.ir("linalg"), compile_options({"arch": "sm_90"})).program
    first, second = [k for k in program.launches if k.strategy == "reduce"]
    assert first.grid[0] >= 256 and second.grid[0] == 1, program.describe()


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(SPLIT))
def test_split_reduction_parity_on_cuda(name: str) -> None:
    fn, shapes = SPLIT[name]
    g = torch.Generator().manual_seed(2)
    inputs = [torch.randn(s, generator=g).cuda() for s in shapes]
    compiled = gac_torch.compile(Fn(fn), tuple(inputs), target="cuda", options={"fallback": False})
    ref = fn(*[t.double() for t in inputs])
    out = compiled(*inputs)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-5


# ------------------------------------------------------------------------------------------------
# graphs around row groups: outputs inside a group, consumers outside it, masks, several outputs


EDGES = {  # name -> (fn, input shapes; "bool": a mask shaped like the first input)
    "sum_max_and_centred": (lambda x: (x.sum(-1), x.amax(-1), x - x.mean(-1, keepdim=True)), [(33, 300)]),
    "softmax_transposed": (lambda x: torch.softmax(x, -1).t().contiguous(), [(64, 100)]),
    "softmax_then_matmul": (lambda x, w: torch.softmax(x, -1) @ w, [(64, 100), (100, 20)]),
    "layernorm_relu_residual": (lambda x: torch.relu(F.layer_norm(x, (96,))) + x, [(8, 5, 96)]),
    "softmax_and_argmax": (lambda x: (torch.softmax(x, -1), x.argmax(-1)), [(16, 130)]),
    "masked_softmax": (lambda x, m: torch.softmax(x.masked_fill(m, -1e9), -1), [(16, 130), "bool"]),
    "three_reductions": (lambda x: torch.softmax(x, -1) * x.sum(-1, keepdim=True) / x.amax(-1, keepdim=True),
                         [(7, 1000)]),
}


def _edge_inputs(shapes):
    g = torch.Generator().manual_seed(3)
    first = shapes[0]
    return [(torch.rand(first, generator=g) > 0.5) if s == "bool" else torch.randn(s, generator=g)
            for s in shapes]


@pytest.mark.parametrize("name", list(EDGES))
def test_row_groups_in_larger_graphs_compile(name: str) -> None:
    fn, shapes = EDGES[name]
    compiled = gac_torch.compile(Fn(fn), tuple(_edge_inputs(shapes)), target="cuda",
                                 options={"arch": "sm_90", "fallback": False, "cache": False})
    assert "_row(" in compiled.ir("ptx")
    assert assemble(compiled.ir("ptx"), "sm_90").ok


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(EDGES))
def test_row_groups_in_larger_graphs_on_cuda(name: str) -> None:
    fn, shapes = EDGES[name]
    inputs = [t.cuda() for t in _edge_inputs(shapes)]
    compiled = gac_torch.compile(Fn(fn), tuple(inputs), target="cuda", options={"fallback": False})
    outs, refs = compiled(*inputs), fn(*[t.double() if t.is_floating_point() else t for t in inputs])
    for out, ref in zip(outs if isinstance(outs, tuple) else (outs,), refs if isinstance(refs, tuple) else (refs,)):
        if ref.is_floating_point():
            assert ((out.double() - ref).norm() / ref.norm()).item() <= 1e-5, name
        else:
            assert torch.equal(out.cpu(), ref.cpu()), name


def test_a_member_value_used_inside_another_ops_region() -> None:
    # Regression (fuzz seed 93): a row group's value read inside a gather's body made the escape
    # check compare ops of different blocks (an MLIR assertion aborted the process).
    def fn(x0, x1):
        v0 = x0.diagonal()
        v1 = torch.clamp(x0, x0, v0)
        v3 = v0[torch.tensor([-1, -1])]
        v7 = torch.hypot(v3, torch.relu(v0))
        return torch.exp(v1), v7.max(), v3, (x1.transpose(2, 1) % 3) != v3

    g = torch.Generator().manual_seed(93)
    inputs = (torch.randn((3, 1, 1), generator=g), torch.randint(-4, 5, (3, 1, 1), generator=g))
    compiled = gac_torch.compile(Fn(fn), inputs, target="cuda", options={"arch": "sm_90", "cache": False})
    assert ".entry" in compiled.ir("ptx")


CONTRACTIONS = {  # a reduction that gathers its operands is a GEMM's, never a row group's
    "bf16_matmul_rounded": (lambda a, b: a @ b, [(64, 96), (96, 80)], torch.bfloat16),
    "bmm_transposed": (lambda a, b: a.transpose(1, 2) @ b, [(3, 40, 24), (3, 40, 56)], torch.float16),
    "conv1x1": (lambda x, w: F.conv2d(x, w), [(2, 16, 9, 11), (24, 16, 1, 1)], torch.float32),
    "matvec": (lambda a, b: (a.unsqueeze(1) * b).sum(-1), [(50, 1, 70), (30, 70)], torch.float32),
}


@pytest.mark.parametrize("name", list(CONTRACTIONS))
def test_contractions_are_not_row_groups(name: str) -> None:
    # Regression: a generic contraction (parallel M, N; reduction K) matched the row form with
    # "gathered" leaves, so a whole GEMM became one row kernel (a thread block per output row).
    fn, shapes, dt = CONTRACTIONS[name]
    g = torch.Generator().manual_seed(5)
    inputs = tuple(torch.randn(s, generator=g).to(dt) for s in shapes)
    for arch in ("sm_80", "sm_90"):
        compiled = gac_torch.compile(Fn(fn), inputs, target="cuda",
                                     options={"arch": arch, "fallback": False, "cache": False})
        kernels = re.findall(r"\.entry (\w+)\(", compiled.ir("ptx"))
        assert kernels and not any(k.endswith("_row") for k in kernels), (arch, kernels)


@pytest.mark.parametrize("M,K,N", [(512, 256, 512), (1000, 520, 1032)])
def test_generic_contraction_then_rounding_is_not_a_row_group(M: int, K: int, N: int) -> None:
    # the same, as a linalg.generic contraction into f32 + a truncf map (failed before the fix)
    from tests.cuda_cases import compile_case
    from tests.test_wgmma_gemm import _case

    for arch in ("sm_80", "sm_90"):
        kernels = [launch.kernel for launch in compile_case(_case(M, K, N, torch.bfloat16, False, False, 0),
                                                             arch).launches]
        assert not any(k.endswith("_row") for k in kernels), (arch, kernels)
