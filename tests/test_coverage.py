"""The coverage table is generated from the registry and committed; the core ATen opset is
measured against the registry's buckets."""

from __future__ import annotations

import pathlib

import pytest
import torch

from gac_torch.legalize.registry import REGISTRY
from gac_torch.tools import coverage

pytestmark = pytest.mark.unit  # the fast tier: pure Python, no model compile

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "coverage.md"

# Core ATen overloads (torch.Tag.core) that are in no bucket, as measured by
# coverage.unbucketed_core_ops(). Bucketing one removes it from here; a torch upgrade that adds
# core ops shows up here too.
UNBUCKETED: list[str] = []


def test_coverage_doc_is_up_to_date():
    assert DOC.read_text() == coverage.render(), \
        "docs/coverage.md is stale: run `python -m gac_torch.tools.coverage > docs/coverage.md`"


def test_core_aten_ops_in_no_bucket():
    core = coverage.core_aten_ops()
    assert len(core) > 150, "the core opset was not found"
    missing = coverage.unbucketed_core_ops()
    print("core ATen ops in no bucket:", missing or "none")
    assert missing == UNBUCKETED


def test_at_least_150_ops_lowered():
    assert coverage.lowered_count() >= 150


def test_buckets_are_complete():
    """Every entry is in exactly one bucket (the registry refuses duplicates), lowerings have a
    function, fallbacks a reason, and lowerings declare at least one dtype."""
    for ov, e in REGISTRY.items():
        assert e.overload is ov
        assert e.bucket in ("lower", "decompose", "fallback"), e
        if e.bucket == "lower":
            assert e.fn is not None and e.dtypes, e
        if e.bucket == "fallback":
            assert e.reason, e


def test_decomposed_ops_are_decomposed():
    """The decompose bucket is part of the table both front-ends use; lowered ops are not."""
    from gac_torch.legalize import decompositions

    from gac_torch.legalize.registry import TRACE_REWRITES

    table = decompositions()
    for ov, e in REGISTRY.items():
        if e.bucket in ("lower", "fallback"):  # only a trace-time argument rewrite of a lowered op
            assert ov not in table or (e.bucket == "lower" and table[ov] is TRACE_REWRITES.get(ov)), ov
    from torch._decomp import decomposition_table
    for ov, e in REGISTRY.items():
        if e.bucket == "decompose" and ov in decomposition_table:
            assert ov in table, ov
    assert torch.ops.aten.hardswish.default in table
