"""OpInfo parity: every OpInfo whose ATen op the registry claims (lowered, or decomposed into
lowered ops), every sample input, dtypes float32/float16/bfloat16 and int32/int64/bool where
the op takes them, on each target; compared with eager (tolerances and the fp64 tie-break:
gac_torch/tools/opinfo.py TOL).

CI runs a deterministic subset: the first, last and evenly spaced samples, CI_SAMPLES per case.
GAC_OPINFO_FULL=1 runs every sample of every case (the full sweep) and also fails on entries of
EXPECTED that no longer match anything (so the table cannot rot).

Per sample: a pass must be compiled entirely by gac and match eager; a fallback, mismatch or
error must be covered by an EXPECTED entry (with its reason); each case needs one pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from conftest import TARGETS

pytest.importorskip("expecttest")  # torch.testing._internal needs it

from gac_torch.legalize.registry import REGISTRY  # noqa: E402
from gac_torch.tools.opinfo import (  # noqa: E402
    DTYPES, SampleResult, claimed_opinfos, compare, opinfo_db, run_opinfo,
)

FULL = os.environ.get("GAC_OPINFO_FULL") == "1"
CI_SAMPLES = {torch.float32: 3, torch.float16: 2, torch.bfloat16: 2, torch.int32: 1, torch.int64: 2,
              torch.bool: 1}


@dataclass(frozen=True)
class Expect:
    """One skip/xfail. kind: "skip" (the case does not run), "fallback" (samples may run in
    eager when the reason contains `match`), "xfail" (a mismatch or error whose detail contains
    `match`). op "*" applies to every OpInfo; dtypes () to every dtype."""

    op: str
    kind: str
    reason: str
    match: str = ""
    dtypes: tuple[torch.dtype, ...] = ()

    def covers(self, op: str, dtype: torch.dtype, kind: str, detail: str = "") -> bool:
        return (self.op in ("*", op) and self.kind == kind and (not self.dtypes or dtype in self.dtypes)
                and self.match in detail)


F16, BF16, I32, I64, BOOL = torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool

# The one table of every skip and expected failure, with its reason.
EXPECTED: list[Expect] = [
    # Whole-graph rules.
    Expect("*", "fallback", "the runtime launches nothing on empty buffers; eager does these",
           match="zero-size tensor"),
    Expect("*", "fallback", "uint8 has no signed reading in gac (types.py)", match="dtype torch.uint8"),
    Expect("*", "fallback", "random numbers stay in eager", match="random"),
]


def _ties_any_order(dim_pos: int):
    """sort/topk: equal values may come in any order (torch.sort is not stable by default), so
    check the values, and that the indices pick those values out of the input."""
    def check(sample, outs, eager) -> str | None:
        values, indices = outs[0], outs[1]
        bad = compare(values, eager[0], None)
        if bad:
            return f"values: {bad}"
        args = list(sample.args)
        dim = sample.kwargs.get("dim", args[dim_pos] if len(args) > dim_pos else -1)
        x = sample.input.cpu()
        picked = x.gather(dim, indices) if x.dim() else x
        same = (picked == values) | (picked.isnan() & values.isnan()) if values.is_floating_point() \
            else picked == values
        return None if bool(same.all()) else "indices do not pick the values"
    return check


def _argsort_check(sample, outs, eager) -> str | None:
    """argsort: the indices must sort the input like eager's do (ties in any order)."""
    dim = sample.kwargs.get("dim", sample.args[0] if sample.args else -1)
    x = sample.input.cpu()
    if not x.dim():
        return compare(outs[0], eager[0], None)
    return compare(x.gather(dim, outs[0]), x.gather(dim, eager[0]), None)


def _metadata_only(sample, outs, eager) -> str | None:
    """empty*: the values are whatever memory held; only dtype and shape are defined."""
    for o, e in zip(outs, eager):
        if o.dtype != e.dtype or o.shape != e.shape:
            return f"{o.dtype}{list(o.shape)} != eager {e.dtype}{list(e.shape)}"
    return None


CHECKS = {"sort": _ties_any_order(0), "topk": _ties_any_order(1), "argsort": _argsort_check,
          **{n: _metadata_only for n in ("empty", "empty_like", "new_empty", "empty_strided",
                                          "new_empty_strided", "empty_permuted")}}


def _claimed() -> list[str]:
    names = {e.name for e in REGISTRY.values() if e.bucket in ("lower", "decompose")}
    return claimed_opinfos(names)


def _cases():
    db = opinfo_db()
    for name in _claimed():
        supported = db[name].supported_dtypes("cpu")
        for dt in DTYPES:
            if dt in supported:
                marks = [pytest.mark.skip(reason=e.reason) for e in EXPECTED if e.covers(name, dt, "skip")]
                yield pytest.param(name, dt, id=f"{name}-{str(dt).removeprefix('torch.')}", marks=marks)


CASES = list(_cases())
_USED: set[int] = set()


def _explained(op: str, dtype: torch.dtype, r: SampleResult) -> Expect | None:
    kind = "fallback" if r.status == "fallback" else "xfail"
    if kind == "fallback":
        reasons = [part.split(": ", 1)[-1] for part in r.detail.split("; ")]
        hits = [next((e for e in EXPECTED if e.covers(op, dtype, kind, why)), None) for why in reasons]
        return hits[0] if hits and all(hits) else None
    return next((e for e in EXPECTED if e.covers(op, dtype, kind, r.detail)), None)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name,dtype", CASES)
def test_opinfo(name, dtype, target):
    op = opinfo_db()[name]
    results = run_opinfo(op, dtype, target=target, max_samples=None if FULL else CI_SAMPLES[dtype],
                         check=CHECKS.get(op.name))
    unexplained = []
    for r in results:
        if r.status in ("pass", "skipped"):
            continue
        e = _explained(name, dtype, r)
        if e is None:
            unexplained.append(str(r))
        else:
            _USED.add(EXPECTED.index(e))
    assert not unexplained, f"{name} {dtype}:\n  " + "\n  ".join(unexplained)
    assert any(r.status == "pass" for r in results) or all(r.status == "skipped" for r in results), \
        f"{name} {dtype}: no sample compiled entirely: {[str(r) for r in results]}"


def test_expected_table_is_consistent():
    """Every entry names a swept OpInfo and gives a reason."""
    claimed = set(_claimed())
    for e in EXPECTED:
        assert e.reason, e
        assert e.kind in ("skip", "fallback", "xfail"), e
        assert e.op == "*" or e.op in claimed, f"{e.op} is not swept (not claimed by the registry)"


@pytest.mark.skipif(not FULL, reason="only the full sweep sees every sample")
def test_zz_every_expectation_is_used():
    """After a full sweep (this test runs last), an entry that covered nothing is stale."""
    stale = [e for i, e in enumerate(EXPECTED) if i not in _USED and e.kind != "skip" and e.op != "*"]
    assert not stale, "stale EXPECTED entries:\n" + "\n".join(map(str, stale))
