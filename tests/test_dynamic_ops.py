"""Run-time sizes, op by op: every lowering that claims `dynamic=True` (docs/coverage.md's
"run-time sizes" column) is compiled from a graph traced with symbolic sizes (make_fx
symbolic tracing: every dim other than 0/1 is a symbol) for OpInfo samples, run, and compared
with eager. A sample whose graph holds an op lowered for static sizes only is compiled per shape
instead and is not counted; the test fails if a claimed op is never exercised with run-time sizes
(unless listed in NOT_EXERCISED with a reason) or if any dynamic result differs from eager.
"""

from __future__ import annotations

import operator

import pytest
import torch

import expecttest  # noqa: E402,F401  (torch.testing._internal needs it: a dev dependency, never a skip)

from gac_torch.backends import get_target, stages_only  # noqa: E402
from gac_torch.frontends.fx import compile_graph, has_symbolic_shapes, specialization_reason  # noqa: E402
from gac_torch.legalize import decompositions  # noqa: E402
from gac_torch.legalize.registry import REGISTRY  # noqa: E402
from gac_torch.options import resolve  # noqa: E402
from gac_torch.tools.opinfo import (  # noqa: E402
    _sample_fn, _tensor_leaves, _Wrap, claimed_opinfos, compare, opinfo_db,
)

DYNAMIC = sorted({e.name for e in REGISTRY.values() if e.bucket == "lower" and e.dynamic})
SAMPLES_PER_OPINFO = 2

# Graphs for claimed ops that OpInfo samples do not reach with run-time sizes (constructors
# take their sizes from another tensor here; selects on a static dim of a dynamic tensor).
# Exported with dim 0 of the first input dynamic (one Dim shared by every input of that size),
# the other dims static.
EXTRA = {
    "constructors": (lambda x: (torch.zeros(x.shape[0], 3) + torch.ones(x.shape[0], 3) * 2
                                + torch.full((x.shape[0], 3), 1.5) + torch.empty(x.shape[0], 3).fill_(0.5)
                                + torch.scalar_tensor(0.25)) * x[:, :3], [(6, 5)]),
    "select": (lambda x: x[:, 1] * x.select(1, 2), [(7, 5)]),
    "copy": (lambda x, y: x.clone().copy_(y), [(6, 5), (6, 5)]),
    "bitwise": (lambda a, b: ((a << 1) ^ (b >> 1)) | (~a & b), [(6, 5), (6, 5)]),
    "sizes_as_values": (lambda x: x * x.shape[0] + x.mean(0) - x.mean(), [(6, 5)]),
    "kv_cache": (lambda k, past: torch.cat([past, k], 1).softmax(1), [(2, 7, 8), (2, 5, 8)],
                 lambda: ({1: torch.export.Dim("new", min=2, max=64)}, {1: torch.export.Dim("past", min=2, max=64)})),
    "indexing": (lambda x, i: torch.nn.functional.embedding(i[:, 0], x[:4]) + x.gather(1, i[:, :1].expand(-1, 5) % 5)
                 + torch.arange(x.shape[0]).unsqueeze(1) + x.index_select(1, i[0] % 5), [(6, 5), (6, 5)]),
    "windows": (lambda x, w, stats: torch.nn.functional.adaptive_avg_pool2d(torch.nn.functional.avg_pool2d(
        torch.nn.functional.max_pool2d(torch.nn.functional.batch_norm(
            torch.nn.functional.conv2d(x, w, padding=1), stats[0], stats[1].abs() + 0.5), 2), 2), 3),
        [(6, 3, 12, 12), (4, 3, 3, 3), (2, 4)]),
}

# Claimed ops no traced graph here reaches with a run-time size, and why.
NOT_EXERCISED = {
    "reshape": "torch decomposes reshape into view / _unsafe_view (exercised) before gac sees it",
    "alias": "functionalization removes aliases from these traces",
    "lift_fresh_copy": "only appears for tensor constants created inside a traced function",
    "convert_element_type": "a prims op: only in graphs traced through prims decompositions",
    "native_dropout": "a constant mask only for p = 0 or eval mode, where torch drops the op before gac",
    "empty_permuted": "empty_like of a permuted tensor; same lowering as empty (exercised)",
    "empty_strided": "empty_strided; same lowering as empty (exercised)",
    "__lshift__": "the same lowering as bitwise_left_shift (exercised)",
    "__rshift__": "the same lowering as bitwise_right_shift (exercised)",
}


# OpInfos whose samples symbolic tracing rejects (eager runs them): (the error, why). Any other
# tracing failure fails the test; an entry that no sample hits is stale and fails it too.
UNTRACEABLE = {
    "nn.functional.one_hot": ("GuardOnDataDependentSymNode", "num_classes=-1 reads the largest index "
                              "on the host: the output size is data-dependent"),
    "tensor_split": ("Cannot call numel() on tensor with symbolic sizes",
                     "indices given as a tensor are read on the host (tensor_split's kernel calls numel())"),
}


def _symbolic_graph(fn, inputs):
    """Functional core ATen with every size a symbol (make_fx symbolic tracing; torch still
    specializes sizes 0 and 1)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        gm = make_fx(torch.func.functionalize(_Wrap(fn), remove="mutations"), tracing_mode="symbolic",
                     decomposition_table=decompositions())(*inputs)
    n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    return gm, n_out


def _aten_names(gm) -> set[str]:
    return {n.target._schema.name.split("::")[-1] for n in gm.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem and hasattr(n.target, "_schema")}


def _run_opinfo(name: str, exercised: set[str], failures: list[str], target: str,
                untraceable: dict[str, int]) -> None:
    op = opinfo_db()[name]
    torch.manual_seed(0)
    dtype = next((d for d in (torch.float32, torch.int64, torch.bool) if d in op.supported_dtypes("cpu")), None)
    samples = [] if dtype is None else [_sample_fn(op, s) for s in op.sample_inputs("cpu", dtype, requires_grad=False)]
    _run_samples(name, samples, exercised, failures, target, untraceable=untraceable)


def _exported_graph(fn, inputs, spec=None):
    class Fn(torch.nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    n = torch.export.Dim("n", min=4, max=1000)
    dims = spec() if spec else tuple({0: n} if t.shape[0] == inputs[0].shape[0] else None for t in inputs)
    ep = torch.export.export(Fn(), tuple(inputs), dynamic_shapes=(dims,))
    gm = ep.run_decompositions(decompositions()).graph_module
    return gm, len(next(x for x in gm.graph.nodes if x.op == "output").args[0])


def _compile(gm, target: str):
    """`ptx`: the cuda target's stages only (CI has no GPU): the graph must still compile once."""
    if target != "ptx":
        return compile_graph(gm, resolve({"fallback": True}, target=target))
    return compile_graph(gm, resolve({"fallback": True}, target="cuda"), target=stages_only(get_target("cuda")))


def _run_samples(name: str, samples, exercised: set[str], failures: list[str], target: str,
                 trace=_symbolic_graph, untraceable: dict[str, int] | None = None) -> None:
    done = 0
    for fn, inputs in samples:
        if done >= SAMPLES_PER_OPINFO:
            break
        try:
            eager = _tensor_leaves(fn(*[t.clone() for t in inputs]))
        except Exception:
            continue  # eager rejects the sample: nothing to compile
        if any(t.numel() == 0 for t in list(inputs) + eager):
            continue
        try:
            gm, n_user = trace(fn, inputs)
        except Exception as e:  # counted: expected (UNTRACEABLE) or a failure, never a silent skip
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if untraceable is not None and name in UNTRACEABLE and UNTRACEABLE[name][0] in why:
                untraceable[name] = untraceable.get(name, 0) + 1
            else:
                failures.append(f"{name}: symbolic tracing fails: {why}")
            continue
        if not has_symbolic_shapes(gm) or specialization_reason(gm, {"target": "cpu"}):
            continue  # all sizes 0/1 (static), or an op lowered for static sizes only
        done += 1
        names = _aten_names(gm)  # (compiling replaces the nodes by partitions)
        device = "cuda" if target == "cuda" else "cpu"
        try:
            compiled = _compile(gm, target)
            assert compiled.dynamic
            failed = [why for (op, why) in compiled.report.unsupported if op.startswith("partition")]
            assert not failed, failed[0]
            if target == "ptx":  # compiled once with run-time sizes; nothing to run here
                exercised |= names
                continue
            outs = [o.cpu() for o in compiled(*[t.clone().to(device) for t in inputs])]
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        if compiled.report.unsupported:
            continue  # partly eager: the eager ops are not what this test is about
        outs = list(outs)[len(outs) - n_user:]
        for k, (o, e) in enumerate(zip(outs, eager, strict=True)):
            bad = compare(o, e, None)
            if bad:
                failures.append(f"{name}: output {k}: {bad}")
                break
        else:
            exercised |= names


@pytest.mark.parametrize("target", ["cpu", "ptx", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_every_dynamic_lowering_runs_with_run_time_sizes(target):
    """cpu: compiled once and run; ptx: compiled once for the cuda target (no GPU needed: the
    mapping, host program and PTX); cuda: run on the GPU against eager on the CPU."""
    exercised: set[str] = set()
    failures: list[str] = []
    untraceable: dict[str, int] = {}
    for name in claimed_opinfos(set(DYNAMIC)):
        _run_opinfo(name, exercised, failures, target, untraceable)
    print("samples symbolic tracing rejects (UNTRACEABLE):", untraceable)
    failures += [f"{name}: stale UNTRACEABLE entry (every sample traces)" for name in UNTRACEABLE
                 if name not in untraceable]
    g = torch.Generator().manual_seed(3)
    for name, (fn, shapes, *spec) in EXTRA.items():
        inputs = [torch.randint(-50, 50, s, generator=g) if name == "bitwise" else
                  torch.randint(0, 4, s, generator=g) if name == "indexing" and k else torch.randn(s, generator=g)
                  for k, s in enumerate(shapes)]
        trace = (lambda f, xs, spec=spec: _exported_graph(f, xs, *spec))
        _run_samples(name, [(fn, inputs)], exercised, failures, target, trace=trace)
    assert not failures, "\n".join(failures)
    missing = sorted(set(DYNAMIC) - exercised - set(NOT_EXERCISED))
    assert not missing, f"claimed dynamic but never run with run-time sizes: {missing}"
