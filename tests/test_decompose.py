"""frontends/decompose.py gives the graph torch's run_decompositions gives, node for node (names,
targets, arguments, values' metadata) and the same signature, on the models gac compiles; the
fast partitioner gives torch's CapabilityBasedPartitioner's partitions."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner

from gac_torch.frontends import decompose
from gac_torch.frontends.torch_state import lazy_graph_modules, retrace_without_export_guards, tracing
from gac_torch.legalize import decompositions
from gac_torch.legalize.norm import eager_layer_norm_stat_dtypes
from gac_torch.passes import partition as P


_rows = decompose.graph_rows


def _torch(ep):
    with tracing(), retrace_without_export_guards(), lazy_graph_modules():
        return ep.run_decompositions(decompositions())


def _assert_same(ep, fast: bool = True):
    want = _torch(ep)
    with tracing():
        got = decompose._Decomposer(ep, decompositions()).program() if fast else \
            decompose.decompose_program(ep, decompositions())
    assert _rows(got.graph_module) == _rows(want.graph_module)
    assert str(got.graph_signature) == str(want.graph_signature)
    return want, got


class Block(nn.Module):
    """A ResNet bottleneck: conv/batch-norm/relu, a strided downsample."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(8, 4, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.conv3 = nn.Conv2d(4, 16, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(16)
        self.down = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2, bias=False), nn.BatchNorm2d(16))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        return torch.relu(self.bn3(self.conv3(y)) + self.down(x))


class Quirks(nn.Module):
    """What run_decompositions rewrites beyond table entries: a tensor made in forward (lifted,
    lift_fresh_copy + detach_), an explicit detach, dtype casts, reshapes of non-contiguous
    views, a 3-d @ 2-d matmul, and an argument called `input`."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, input, y):
        k = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
        t = input.transpose(1, 2).reshape(2, -1, 6).detach()
        z = self.lin(t) * self.scale + k
        w = (z @ y).to(torch.float64).softmax(-1).to(torch.float32)
        return w.flatten(1), torch.nn.functional.layer_norm(z, (6,))


class More(nn.Module):
    """Multi-output ops (split, chunk), a constructor, a kept CIA op (upsample), group norm,
    attention, a tanh GELU."""

    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 4)

    def forward(self, x):
        a, b = x.split([1, 3], dim=1)
        c, d = x.chunk(2, dim=2)
        up = nn.functional.interpolate(self.norm(x), scale_factor=2, mode="bilinear", align_corners=False)
        q = x.flatten(2).transpose(1, 2)
        att = nn.functional.scaled_dot_product_attention(q, q, q)
        pos = torch.arange(x.shape[-1], dtype=torch.float32)
        return (a * b.sum(1, keepdim=True) + pos, c - d, nn.functional.gelu(up, approximate="tanh"),
                att.mean(), torch.zeros_like(x) + x.new_ones(()))


def _export(model, *inputs):
    with torch.no_grad():
        return torch.export.export(model.eval(), inputs)


def _seeded(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)))


@pytest.mark.parametrize("name", ["block", "transformer", "quirks", "more", "with_grad"])
def test_same_graph_as_run_decompositions(name):
    torch.manual_seed(0)
    if name == "block":
        ep = _export(Block(), _seeded(2, 8, 9, 11))
    elif name == "transformer":  # (eval: its dropout is the identity)
        layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.1, batch_first=True)
        ep = _export(layer, _seeded(2, 5, 16))
    elif name == "quirks":
        ep = _export(Quirks(), _seeded(2, 6, 3), _seeded(6, 5))
    elif name == "more":
        ep = _export(More(), _seeded(2, 4, 6, 6))
    else:  # exported with autograd on: the metadata says requires_grad, the inference graph not
        ep = torch.export.export(Quirks().eval(), (_seeded(2, 6, 3), _seeded(6, 5)))
    _assert_same(ep)


def test_same_graph_as_run_decompositions_bevformer():
    from gac_torch.models.bevformer import build_bevformer, make_test_inputs

    model = build_bevformer("test_tiny", seed=0)
    ep = _export(model, *make_test_inputs(model.cfg, frame=0))
    want, got = _assert_same(ep)
    # the decomposed program runs as torch's does (its graph module's code made on first use)
    inputs = make_test_inputs(model.cfg, frame=0)
    for a, b in zip(pytree.tree_leaves(got.module()(*inputs)), pytree.tree_leaves(want.module()(*inputs))):
        assert torch.equal(a, b)


class Mutates(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x):
        self.count.add_(1)
        return x.reshape(-1) * self.count.sum()


def test_other_programs_are_run_decompositions():
    """A mutation and symbolic sizes go through torch's re-export (and give its graph)."""
    ep = _export(Mutates(), _seeded(3, 4))
    with pytest.raises(decompose._Unsupported, match="mutates"):
        decompose._Decomposer(ep, decompositions()).program()
    _assert_same(ep, fast=False)
    with torch.no_grad():
        ep = torch.export.export(Block().eval(), (_seeded(2, 8, 9, 11),),
                                 dynamic_shapes=({0: torch.export.Dim("b", min=2, max=8)},))
    with pytest.raises(decompose._Unsupported, match="symbolic"):
        decompose._Decomposer(ep, decompositions()).program()
    _assert_same(ep, fast=False)


def test_dispatcher_args_drop_defaults_as_the_dispatcher_does():
    aten = torch.ops.aten
    x = torch.ones(2)
    args, kwargs = decompose.dispatcher_args(aten._assert_tensor_metadata.default, (x,),
                                             {"dtype": torch.float32, "device": torch.device("cpu")})
    assert args == (x, None, None, torch.float32) and kwargs == {"device": torch.device("cpu")}
    assert decompose.dispatcher_args(aten.sum.dim_IntList, (x, (0,), False), {}) == ((x, [0]), {})


def _torch_partition(gm, decisions):
    """partition() as it was: CapabilityBasedPartitioner's proposal and fusion."""
    partitioner = CapabilityBasedPartitioner(gm, P._Support(decisions), allows_single_node_partition=True)
    fused = partitioner.fuse_partitions(partitioner.propose_partitions())
    return fused, P.renumber_partitions(fused)


class Split(nn.Module):
    """Two compiled regions around an op gac leaves to eager (nonzero)."""

    def forward(self, x):
        y = torch.relu(x * 2 + 1)
        idx = torch.nonzero(y > 1.5)
        return (idx.to(torch.float32) * 2).sum() + y.sum(), idx


def _aot_graph(model, *inputs) -> fx.GraphModule:
    """The inference graph AOTAutograd hands torch.compile's backend (constants as get_attr)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model.eval(), backend=aot_autograd(fw_compiler=keep, decompositions=decompositions()))(*inputs)
    torch._dynamo.reset()
    return graphs[0]


@pytest.mark.parametrize("name", ["block", "split", "aot"])
def test_partition_as_capability_based_partitioner(name):
    def graph():
        if name == "aot":  # a dynamo graph, its tensor constant a get_attr
            gm = _aot_graph(Quirks(), _seeded(2, 6, 3), _seeded(6, 5))
            assert any(n.op == "get_attr" for n in gm.graph.nodes)
        else:
            ep = _export(Block(), _seeded(2, 8, 9, 11)) if name == "block" else _export(Split(), _seeded(5, 3))
            with tracing():
                gm = decompose.decompose_program(ep, decompositions()).graph_module
        P.drop_metadata_asserts(gm)
        eager_layer_norm_stat_dtypes(gm)
        gm.graph.eliminate_dead_code()
        return gm, P.analyze(gm)[0]

    want, want_names = _torch_partition(*graph())
    gm, decisions = graph()
    assert (P._whole_graph(gm, decisions) is None) == (name == "split")
    got, names = P.partition(gm, decisions)
    assert names == want_names and (len(names) == 1) == (name != "split")
    assert str(got.graph) == str(want.graph)
    assert [str(getattr(got, n).graph) for n in names] == [str(getattr(want, n).graph) for n in names]


def test_compile_neither_re_exports_nor_merges_partitions(monkeypatch):
    """A cold compile of a program gac takes whole skips torch's two slow steps (BEVFormer-tiny:
    ~6 s re-exporting, ~1.5 s merging partitions); its result is eager's."""
    import gac_torch

    def fail(*args, **kwargs):
        raise AssertionError("called")

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", fail)
    monkeypatch.setattr(CapabilityBasedPartitioner, "propose_partitions", fail)
    model, x = Block().eval(), _seeded(2, 8, 9, 11)
    compiled = gac_torch.compile(_export(model, x), target="cpu", options={"fallback": False, "cache": False})
    assert compiled.report.partitions == 1
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_failing_fast_path_falls_back_to_torch_visibly(monkeypatch, caplog):
    """A bug in the node-by-node path (or a torch it does not know) costs speed, not the compile:
    torch's run_decompositions gives the graph, with a warning; tests (strict) see the error."""
    def broken(self):
        raise RuntimeError("a bug")

    ep = _export(Block(), _seeded(2, 8, 9, 11))
    monkeypatch.setattr(decompose._Decomposer, "program", broken)
    with pytest.raises(RuntimeError, match="a bug"), tracing():
        decompose.decompose_program(ep, decompositions())
    monkeypatch.setenv("GAC_STRICT_INTERNAL", "0")
    with caplog.at_level("WARNING", logger="gac_torch"), tracing():
        got = decompose.decompose_program(ep, decompositions())
    assert "RuntimeError: a bug" in caplog.text
    assert _rows(got.graph_module) == _rows(_torch(ep).graph_module)


def test_an_older_torch_or_the_switch_uses_run_decompositions(monkeypatch):
    """The node-by-node path is checked on torch 2.11 (the H200's) and 2.13: an older torch, or
    GAC_DECOMPOSE=torch, gets torch's run_decompositions."""
    ep = _export(Block(), _seeded(2, 8, 9, 11))
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    with pytest.raises(decompose._Unsupported, match="2.11"):
        decompose._Decomposer(ep, decompositions())
    monkeypatch.undo()
    monkeypatch.setenv("GAC_DECOMPOSE", "torch")
    with pytest.raises(decompose._Unsupported, match="GAC_DECOMPOSE"):
        decompose._Decomposer(ep, decompositions())
    with tracing():
        got = decompose.decompose_program(ep, decompositions())
    assert _rows(got.graph_module) == _rows(_torch(ep).graph_module)


class NormThenAdd(nn.Module):
    """H200 fuzz seed 401: a vector norm over a negative dim of size 1, then an add with alpha."""

    def forward(self, x0, x1):
        return torch.add(x1, torch.linalg.vector_norm(x0, 1, dim=-4), alpha=2), torch.sqrt(x1.abs())


def test_consumers_of_a_value_with_new_metadata_are_traced_anew(monkeypatch):
    """torch 2.11's meta of linalg_vector_norm keeps a size-1 dim reduced by a negative index (the
    exported add's value: [1, 4, 4, 1]); gac's table rewrites the dim ([4, 4, 1]), so the add's
    value must be recomputed as torch's re-trace does: the node-by-node path copied the exported
    one and legalization refused the graph (fuzz seed 401 on the H200, cuda and cpu alike). The
    same on any torch: a table entry whose expansion has other strides than the op's meta."""
    import gac_torch

    x0, x1 = _seeded(1, 4, 1, 4).transpose(-1, -2), _seeded(1, 1)
    ep = _export(NormThenAdd(), x0, x1)
    _assert_same(ep)
    model = Strides()
    table = dict(decompositions())
    table[torch.ops.aten.neg.default] = _contiguous_neg
    ep2 = _export(model, _seeded(3, 5))
    want = _torch_with(ep2, table)
    with tracing():
        got = decompose._Decomposer(ep2, table).program()
    assert _rows(got.graph_module) == _rows(want.graph_module)
    strides = {r[1]: r[-1][1] for r in _rows(got.graph_module) if isinstance(r[-1], tuple)}
    assert strides["t"] == (1, 5) and strides["add_1"] == strides["mul_2"] == strides["getitem_1"] == (3, 1)
    # the whole compile takes the node-by-node path (no re-export) and gives eager's values
    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", _called)
    compiled = gac_torch.compile(ep, target="cpu", options={"fallback": False, "cache": False})
    for a, b in zip(compiled(x0, x1), NormThenAdd()(x0, x1)):
        torch.testing.assert_close(a, b)


class Strides(nn.Module):
    """neg of a transposed view (a kept op after it, a decomposed one, a getitem's op)."""

    def forward(self, x):
        y = torch.neg(x.t())
        return torch.nn.functional.hardswish(y) + 1, y * 2, y.split(2, dim=1)[1].exp()


def _contiguous_neg(x):
    """A test entry whose expansion is contiguous where neg's meta keeps x's strides."""
    return torch.ops.aten.mul.Tensor(x, -1).clone(memory_format=torch.contiguous_format)


def _torch_with(ep, table):
    with tracing(), retrace_without_export_guards(), lazy_graph_modules():
        return ep.run_decompositions(table)


def _called(*args, **kwargs):
    raise AssertionError("called")


def test_partitions_fuse_with_an_insert_subgm_without_insertion_point(monkeypatch):
    """torch < 2.12's insert_subgm takes (gm, sub_gm, inputs, outputs): the partitioner calls it
    so (every compile failed on the H200's torch 2.11 when it passed an insertion point)."""
    import gac_torch
    from torch.fx.passes.utils import fuser_utils

    real = fuser_utils.insert_subgm

    def insert_subgm(gm, sub_gm, orig_inputs, orig_outputs):
        return real(gm, sub_gm, orig_inputs, orig_outputs)

    monkeypatch.setattr(fuser_utils, "insert_subgm", insert_subgm)
    model, x = Block().eval(), _seeded(2, 8, 9, 11)
    compiled = gac_torch.compile(_export(model, x), target="cpu", options={"fallback": False, "cache": False})
    assert compiled.report.partitions == 1
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
