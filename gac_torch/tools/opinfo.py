"""Per-op parity against eager PyTorch over the OpInfo database's sample inputs.

For one OpInfo and some dtypes: every sample is traced as the dynamo front-end traces a graph
(AOTAutograd's functional inference graph with our decomposition table), a few samples are
merged into one graph (one compile and JIT for them), compiled by gac with eager fallback, run,
and each sample's outputs are compared with eager. Every sample gets a status:

    pass       compiled entirely by gac and matches eager
    fallback   some of its ATen nodes run eagerly (the reasons are kept)
    mismatch   compiled, but differs from eager beyond tolerance (the detail says when gac
               equals torch's decomposition run in eager: then torch's decomposition and
               torch's kernel disagree)
    error      gac raised while compiling or running it
    skipped    eager itself rejects the sample
    untraceable  eager runs it but AOTAutograd cannot trace it (e.g. a size read from a tensor's
               value): nothing reaches gac, so it is counted and reported, never a silent skip

This is the per-op blame tool: run it on one op to see which samples and dtypes fail and why.

    python -m gac_torch.tools.opinfo add nn.functional.grid_sample --dtype float16 -v
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool)

# (rtol, atol) against eager. A float result outside them still passes when it is that close to
# an fp64 reference rounded to the output dtype, plus eager's own error (at most once more the
# tolerance): see compare().
TOL = {
    torch.float32: (1.3e-5, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


@dataclass
class SampleResult:
    index: int
    status: str
    detail: str = ""
    aten_ops: set[str] = field(default_factory=set)  # what the sample's graph contains

    def __str__(self) -> str:
        return f"sample {self.index}: {self.status}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class _Sample:
    index: int
    sample: Any  # the OpInfo SampleInput
    fn: Callable
    inputs: list[torch.Tensor]
    eager: list[torch.Tensor] | None = None
    wide_fn: Callable | None = None  # fn with float dtype arguments widened (the fp64 reference)
    uid: int = 0  # position in the merged graph
    gm: fx.GraphModule | None = None
    n_user: int = 0  # the graph's last n_user outputs are the op's outputs
    out_slots: list[int] = field(default_factory=list)


def opinfo_db() -> dict[str, Any]:
    """OpInfo by full name ("name" or "name.variant")."""
    from torch.testing._internal.common_methods_invocations import op_db

    return {full_name(o): o for o in op_db}


def full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


# OpInfos whose ATen op is named differently from them (the rest are matched by name).
OPINFO_ATEN = {
    "nn.functional.conv1d": "convolution", "nn.functional.conv2d": "convolution",
    "nn.functional.conv_transpose1d": "convolution", "nn.functional.conv_transpose2d": "convolution",
    "nn.functional.adaptive_avg_pool2d": "_adaptive_avg_pool2d",
    "nn.functional.adaptive_max_pool1d": "adaptive_max_pool2d",
    "nn.functional.max_pool2d": "max_pool2d_with_indices",
    "nn.functional.batch_norm": "native_batch_norm", "nn.functional.group_norm": "native_group_norm",
    "nn.functional.layer_norm": "native_layer_norm", "nn.functional.instance_norm": "native_batch_norm",
    "nn.functional.rms_norm": "mean", "nn.functional.grid_sample": "grid_sampler_2d",
    "nn.functional.interpolate.nearest": "upsample_nearest2d",
    "nn.functional.interpolate.bilinear": "upsample_bilinear2d",
    "nn.functional.interpolate.linear": "upsample_linear1d",
    "nn.functional.interpolate.nearest-exact": "_upsample_nearest_exact2d",
    "nn.functional.interpolate.bicubic": "upsample_bicubic2d",
    "nn.functional.interpolate.area": "_adaptive_avg_pool2d",
    "nn.functional.upsample_bilinear": "upsample_bilinear2d",
    "nn.functional.upsample_nearest": "upsample_nearest2d",
    "nn.functional.pad.reflect": "reflection_pad2d", "nn.functional.pad.replicate": "replication_pad2d",
    "nn.functional.pad.replicate_negative": "replication_pad2d",
    "nn.functional.pad.circular": "slice_scatter",
    "nn.functional.cosine_similarity": "linalg_vector_norm", "nn.functional.normalize": "linalg_vector_norm",
    "nn.functional.pairwise_distance": "linalg_vector_norm", "nn.functional.pdist": "_pdist_forward",
    "cdist": "_cdist_forward", "nn.functional.softmin": "_softmax", "nn.functional.softmin.with_dtype": "_softmax",
    "nn.functional.logsigmoid": "log_sigmoid_forward", "nn.functional.softsign": "abs",
    "nn.functional.tanhshrink": "tanh", "nn.functional.nll_loss": "nll_loss_forward",
    "nn.functional.cross_entropy": "_log_softmax", "nn.functional.kl_div": "xlogy",
    "nn.functional.binary_cross_entropy_with_logits": "log_sigmoid_forward",
    "nn.functional.dropout": "native_dropout", "nn.functional.one_hot": "eq",
    "nn.functional.local_response_norm": "avg_pool2d",
    "argsort": "sort", "msort": "sort", "isfinite": "isinf", "isclose": "isnan",
    "chunk": "split", "tensor_split": "slice", "flatten": "view", "unflatten": "view", "ravel": "view",
    "broadcast_to": "expand", "expand_as": "expand", "contiguous": "clone", "fliplr": "flip",
    "flipud": "flip", "hstack": "cat", "vstack": "cat", "dstack": "cat", "column_stack": "cat",
    "diag": "diagonal", "tensordot": "mm", "inner": "mm", "addr": "mul", "kron": "mul",
    "broadcast_tensors": "expand", "atleast_2d": "view", "cross": "sub", "diff": "sub",
    "cumulative_trapezoid": "cumsum", "trapezoid": "sum", "nanmean": "sum",
    "renorm": "linalg_vector_norm", "einsum": "bmm",
}
_NOT_SWEPT = ("masked.", "sparse.", "fft.", "special.", "linalg.", "signal.", "_refs", "jiterator")


def claimed_opinfos(names: set[str]) -> list[str]:
    """OpInfos whose ATen op is one of `names` (registry base names), by name or OPINFO_ATEN."""
    found = []
    for key, op in sorted(opinfo_db().items()):
        if key in OPINFO_ATEN:
            if OPINFO_ATEN[key] in names:
                found.append(key)
            continue
        if key.startswith(_NOT_SWEPT) and key not in ("linalg.vector_norm", "linalg.diagonal"):
            continue
        aliases = {getattr(a, "name", "") for a in getattr(op, "aliases", ())}
        if ({op.aten_name, op.name.split(".")[-1], op.name.replace(".", "_")} | aliases) & names:
            found.append(key)
    return found


def pick(n: int, k: int | None) -> list[int]:
    """k of n sample indices, spread evenly and deterministically (all when k is None)."""
    if k is None or n <= k:
        return list(range(n))
    return sorted({i * n // k for i in range(k)})


def _sample_fn(op, sample, wide: bool = False) -> tuple[Callable, list[torch.Tensor]]:
    """A function of the sample's tensors only (Python scalars and options are baked in).
    wide: float dtype arguments (e.g. cumsum's dtype=torch.float16) become float64, for the
    fp64 reference (else it is computed, and rounded, in the very dtype eager uses)."""
    flat, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    slots = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    if wide:
        flat = [torch.float64 if isinstance(v, torch.dtype) and v.is_floating_point and not v.is_complex
                else v for v in flat]

    def fn(*tensors):
        leaves = list(flat)
        for i, t in zip(slots, tensors):
            leaves[i] = t
        inp, args, kwargs = pytree.tree_unflatten(leaves, spec)
        return op.op(inp, *args, **kwargs)

    return fn, [flat[i] for i in slots]


def _tensor_leaves(out) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


class _Wrap(torch.nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *ts):
        return _tensor_leaves(self.fn(*ts))


def _trace(fn: Callable, inputs: Sequence[torch.Tensor]) -> tuple[fx.GraphModule, int]:
    """The inference graph AOTAutograd gives the dynamo front-end (functional core ATen, views
    kept, our decompositions), and how many of its outputs are the user's (the leading ones
    are inputs the op mutates)."""
    from torch._functorch.aot_autograd import aot_export_module

    from gac_torch.legalize import decompositions

    with torch.no_grad():
        gm, sig = aot_export_module(_Wrap(fn), tuple(inputs), trace_joint=False,
                                    decompositions=decompositions())
    return gm, len(sig.user_outputs)


def _merge(samples: list[_Sample]) -> tuple[fx.GraphModule, dict[fx.Node, int]]:
    """One graph computing every sample; node -> sample index for blame."""
    root = torch.nn.Module()
    graph = fx.Graph()
    owner: dict[fx.Node, int] = {}
    outs: list[Any] = []
    for s in samples:
        assert s.gm is not None
        env: dict[fx.Node, Any] = {}
        for n in s.gm.graph.nodes:
            if n.op == "placeholder":
                new = graph.placeholder(f"s{s.uid}_{n.name}")
                new.meta = copy.copy(n.meta)
            elif n.op == "get_attr":
                name = f"s{s.uid}_{n.target.replace('.', '_')}"
                setattr(root, name, getattr(s.gm, n.target))
                new = graph.get_attr(name)
                new.meta = copy.copy(n.meta)
            elif n.op == "output":
                first = len(outs) + len(n.args[0]) - s.n_user
                s.out_slots = list(range(first, first + s.n_user))
                outs.extend(env[a] if isinstance(a, fx.Node) else a for a in n.args[0])
                continue
            else:
                new = graph.node_copy(n, lambda a: env[a])
            env[n] = new
            owner[new] = s.uid
    graph.output(tuple(outs))
    return fx.GraphModule(root, graph), owner


def _to64(t):
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def compare(out: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor | None) -> str | None:
    """None if out matches eager, else what differs.

    Where eager is finite, out must be finite and within TOL of eager. Where eager is not finite,
    out must be the same: the same infinity, NaN where eager has NaN. The fp64 tie-break (`ref`,
    the op computed in float64): an element outside TOL still passes when it is within TOL of the
    reference rounded to the output dtype, widened by eager's own distance from it, but by at most
    TOL again (eager's rounding is not our error; a wrong value is never excused by a worse eager)."""
    if out.dtype != eager.dtype:
        return f"dtype {out.dtype} != eager {eager.dtype}"
    if out.shape != eager.shape:
        return f"shape {list(out.shape)} != eager {list(eager.shape)}"
    if not out.is_floating_point():
        bad = out != eager
        return None if not bad.any() else f"{int(bad.sum())}/{out.numel()} elements differ"
    rtol, atol = TOL.get(out.dtype, (0.0, 0.0))
    o, e = out.double(), eager.double()
    finite = e.isfinite()
    same = (o == e) | (o.isnan() & e.isnan())  # the only way to match a non-finite element
    ok = same | (finite & o.isfinite() & ((o - e).abs() <= atol + rtol * e.abs()))
    if ref is not None and not bool(ok.all()):
        r = ref.to(out.dtype).double()
        tol = atol + rtol * r.abs()
        slack = torch.minimum((e - r).abs(), tol)
        ok |= finite & o.isfinite() & r.isfinite() & ((o - r).abs() <= tol + slack)
    if bool(ok.all()):
        return None
    i = int((~ok).flatten().nonzero()[0])
    return (f"{int((~ok).sum())}/{out.numel()} elements off, e.g. [{i}] gac={o.flatten()[i].item():.6g} "
            f"eager={e.flatten()[i].item():.6g}")


Checker = Callable[[Any, Sequence[torch.Tensor], Sequence[torch.Tensor]], "str | None"]
Key = tuple[torch.dtype, int]  # (dtype, sample index)


def _collect(op, dtype: torch.dtype, device: str, max_samples: int | None, seed: int,
             results: dict[Key, SampleResult], part: tuple[int, int] | None = None) -> list[_Sample]:
    """The case's samples with eager outputs and traced graphs. With a limit, samples are taken
    in a spread order (first, last, middle, ...) skipping those eager rejects or that touch no
    data (an empty input or output: those always run eagerly), up to max_samples. `part` (k, n):
    only the samples whose index is k modulo n (to spread one long case over processes)."""
    torch.manual_seed(seed)  # OpInfo samples draw from the global generator
    all_samples = list(op.sample_inputs(device, dtype, requires_grad=False))
    first = pick(len(all_samples), max_samples)
    order = first + sorted(set(range(len(all_samples))) - set(first))
    if part is not None:
        order = [i for i in order if i % part[1] == part[0]]
    chosen: list[_Sample] = []
    for i in order:
        if max_samples is not None and len(chosen) >= max_samples:
            break
        fn, inputs = _sample_fn(op, all_samples[i])
        s = _Sample(i, all_samples[i], fn, inputs, wide_fn=_sample_fn(op, all_samples[i], wide=True)[0])
        try:
            s.eager = _tensor_leaves(fn(*[t.clone() for t in inputs]))
        except Exception as e:
            if max_samples is None:
                results[(dtype, i)] = SampleResult(i, "skipped", f"eager raises {type(e).__name__}")
            continue
        if max_samples is not None and any(t.numel() == 0 for t in list(inputs) + s.eager):
            continue
        try:
            s.gm, s.n_user = _trace(fn, inputs)
        except Exception as e:
            results[(dtype, i)] = SampleResult(i, "untraceable", f"{type(e).__name__}: {str(e)[:80]}")
            continue
        chosen.append(s)
    return chosen


def run_cases(op, plan: dict[torch.dtype, int | None], *, target: str = "cpu", seed: int = 0,
              check: Checker | None = None, group: int = 2,
              part: tuple[int, int] | None = None) -> dict[torch.dtype, list[SampleResult]]:
    """Runs every dtype of `plan` (dtype -> how many samples; None: all) for one OpInfo, `group`
    samples per compiled graph; one SampleResult per sample. `check(sample, outs, eager_outs)`
    replaces the comparison with eager (for ops whose result is not unique).

    Grouping saves the per-module JIT set-up, but LLVM's optimizer is superlinear in function
    size, so large groups cost more than they save (measured: 2 to 3 is best)."""
    device = "cuda" if target == "cuda" else "cpu"
    results: dict[Key, SampleResult] = {}
    samples: list[tuple[torch.dtype, _Sample]] = []
    for dt, k in plan.items():
        samples += [(dt, s) for s in _collect(op, dt, device, k, seed, results, part)]
    for n, (_, s) in enumerate(samples):
        s.uid = n
    for start in range(0, len(samples), max(group, 1)):
        _run_group(samples[start:start + max(group, 1)], target, check, results)
    return {dt: [results[k] for k in sorted((k for k in results if k[0] == dt), key=lambda k: k[1])]
            for dt in plan}


def _run_group(samples: list[tuple[torch.dtype, _Sample]], target: str, check: Checker | None,
               results: dict[Key, SampleResult]) -> None:
    """Merges, compiles (with eager fallback), runs and checks some samples, into `results`."""
    from gac_torch.frontends.fx import compile_graph
    from gac_torch.options import resolve
    from gac_torch.passes.partition import analyze, drop_metadata_asserts, op_name

    merged, owner = _merge([s for _, s in samples])
    drop_metadata_asserts(merged)  # as compile_graph does
    decisions, _ = analyze(merged)
    by_uid: dict[int, list[fx.Node]] = {}
    for node, uid in owner.items():
        if node.op == "call_function" and node.target is not operator.getitem:
            by_uid.setdefault(uid, []).append(node)
    for dt, s in samples:
        nodes = by_uid.get(s.uid, [])
        falls = sorted({f"{op_name(n)}: {decisions[n]}" for n in nodes if decisions.get(n)})
        results[(dt, s.index)] = SampleResult(s.index, "fallback" if falls else "pass", "; ".join(falls),
                                              {op_name(n) for n in nodes})
    try:
        compiled = compile_graph(merged, resolve({"fallback": True}, target=target))
        failed = [why for (name, why), _ in compiled.report.unsupported.items() if name.startswith("partition ")]
        if failed:
            raise RuntimeError(failed[0])
        outs = compiled(*[t.clone() for _, s in samples for t in s.inputs])
    except Exception as e:
        for dt, s in samples:  # blame: each sample on its own
            r = results[(dt, s.index)]
            r.status, r.detail = run_one(s, target, check) if len(samples) > 1 else \
                ("error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        return
    for dt, s in samples:
        r = results[(dt, s.index)]
        bad = _check(s, [outs[k] for k in s.out_slots], check)
        if bad is not None:
            r.status, r.detail = "mismatch", bad + (f"; with fallback {r.detail}" if r.detail else "")


def run_opinfo(op, dtype: torch.dtype, *, target: str = "cpu", max_samples: int | None = None,
               seed: int = 0, check: Checker | None = None) -> list[SampleResult]:
    """One (OpInfo, dtype) case (see run_cases)."""
    return run_cases(op, {dtype: max_samples}, target=target, seed=seed, check=check)[dtype]


def run_one(s: _Sample, target: str, check: Checker | None = None) -> tuple[str, str]:
    """Compiles and checks one sample alone (after a failed merged compile)."""
    from gac_torch.frontends.fx import compile_graph
    from gac_torch.options import resolve
    from gac_torch.passes.partition import analyze, drop_metadata_asserts

    merged, _ = _merge([s])
    drop_metadata_asserts(merged)
    _, report = analyze(merged)
    try:
        compiled = compile_graph(merged, resolve({"fallback": True}, target=target))
        failed = [why for (name, why), _ in compiled.report.unsupported.items() if name.startswith("partition ")]
        if failed:
            return "error", failed[0][:300]
        outs = compiled(*[t.clone() for t in s.inputs])
    except Exception as e:
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    bad = _check(s, [outs[k] for k in s.out_slots], check)
    if bad:
        return "mismatch", bad
    falls = "; ".join(f"{o}: {w}" for (o, w) in sorted(report.unsupported))
    return ("fallback", falls) if falls else ("pass", "")


def _check(s: _Sample, outs: Sequence[torch.Tensor], check: Checker | None = None) -> str | None:
    assert s.eager is not None
    if len(outs) != len(s.eager):
        return f"{len(outs)} outputs, eager has {len(s.eager)}"
    if check is not None:
        return check(s.sample, [o.cpu() for o in outs], [e.cpu() for e in s.eager])
    refs: list[torch.Tensor | None] = [None] * len(outs)
    if any(e.is_floating_point() and e.dtype != torch.float64 for e in s.eager):
        with contextlib.suppress(Exception):
            wide = _tensor_leaves((s.wide_fn or s.fn)(*[_to64(t.clone()) for t in s.inputs]))
            if len(wide) == len(outs):
                refs = list(wide)
    for k, (o, e, r) in enumerate(zip(outs, s.eager, refs, strict=True)):
        bad = compare(o.cpu(), e.cpu(), r.cpu() if r is not None and r.shape == e.shape else None)
        if bad:
            return f"output {k}: {bad}" + _same_as_decomposition(s, k, o)
    return None


def _same_as_decomposition(s: _Sample, k: int, out: torch.Tensor) -> str:
    """When gac differs from eager, whether it matches the graph it compiled run in eager (then
    the difference is between torch's decomposition and torch's kernel, not gac's)."""
    assert s.gm is not None
    with contextlib.suppress(Exception), torch.no_grad():
        graph_outs = s.gm(*[t.clone() for t in s.inputs])
        mine = graph_outs[len(graph_outs) - s.n_user + k]
        if compare(out.cpu(), mine.cpu(), None) is None:
            return " (as torch's decomposition gives when run in eager)"
    return ""


def supported(op, dtypes: Sequence[torch.dtype] = DTYPES) -> list[torch.dtype]:
    """The dtypes of `dtypes` the OpInfo takes on cpu."""
    ok = op.supported_dtypes("cpu")
    return [dt for dt in dtypes if dt in ok]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ops", nargs="*", help="OpInfo names (default: all)")
    p.add_argument("--dtype", action="append", help="e.g. float32 (default: the usual six)")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--target", default="cpu")
    p.add_argument("-v", "--verbose", action="store_true", help="print every sample")
    a = p.parse_args(argv)
    dtypes = [getattr(torch, d) for d in a.dtype] if a.dtype else list(DTYPES)
    names = a.ops or sorted(opinfo_db())
    db = opinfo_db()
    for name in names:
        op = db[name]
        try:
            by_dtype = run_cases(op, {dt: a.max_samples for dt in supported(op, dtypes)}, target=a.target)
        except Exception as e:
            print(f"{name:40s} HARNESS ERROR {type(e).__name__}: {str(e)[:200]}")
            continue
        for dt, res in by_dtype.items():
            counts: dict[str, int] = {}
            for r in res:
                counts[r.status] = counts.get(r.status, 0) + 1
            print(f"{name:40s} {str(dt).removeprefix('torch.'):9s} "
                  + " ".join(f"{k}={v}" for k, v in sorted(counts.items())), flush=True)
            for r in res:
                if a.verbose or r.status in ("mismatch", "error", "fallback", "untraceable"):
                    print(f"    {r}  [{', '.join(sorted(r.aten_ops))}]")


if __name__ == "__main__":
    main()
