"""GAC_GPU_LAZY_SETTLE: the epilogue's question "may another allocation stand in for this
buffer?" (epilogue._renamable) answered from the template texts of kernels still being folded
(strategy.views_pending) rather than by putting them in place first (strategy.settle), which
folded their templates in the main process; the answers are the same, and a text that misleads
is reported when its kernel is put in place."""

from __future__ import annotations

import pytest
from mlir import ir

from gac_torch.backends.gpu import strategy
from gac_torch.backends.gpu.irutil import block_ops, func_block
from gac_torch.backends.gpu.strategies import epilogue
from gac_torch.backends.gpu.strategy import deferred_splices, splice_template, template_cache
from gac_torch.errors import CompileError
from gac_torch.ir.dialect import make_context

from test_gpu_fold_pool import HOST_BUF as HOST  # (%buf, an allocation)
from test_gpu_stage_reuse import TEMPLATE

STORE = "    memref.store %v, %A[%k] : memref<7xf32>"
# the kernel's view of its buffer: of the buffer alone (static), or at a thread's offset (dynamic)
STATIC = TEMPLATE.replace(STORE, (
    "    %r = memref.reinterpret_cast %A to offset: [0], sizes: [7], strides: [1] : memref<7xf32> to memref<7xf32>\n"
    "    memref.store %v, %r[%k] : memref<7xf32>"))
DYNAMIC = TEMPLATE.replace(STORE, (
    "    %r = memref.cast %A : memref<7xf32> to memref<?xf32>\n"
    "    %w = memref.reinterpret_cast %r to offset: [%k], sizes: [1], strides: [1] : memref<?xf32> to memref<1xf32, strided<[1], offset: ?>>\n"
    "    %c0 = arith.constant 0 : index\n"
    "    memref.store %v, %w[%c0] : memref<1xf32, strided<[1], offset: ?>>"))


def _ask(monkeypatch, template: str, lazy: bool) -> tuple[bool, bool, str]:
    """%buf handed to a kernel folded by a worker, then _renamable(%buf) asked at once:
    (the answer, whether the kernel was still pending after it, the final module)."""
    monkeypatch.setenv("GAC_GPU_STAGE_WORKERS", "1")
    monkeypatch.setenv("GAC_GPU_LAZY_SETTLE", "1" if lazy else "0")
    module = ir.Module.parse(HOST, make_context())
    with module.context, ir.Location.unknown():
        ops = block_ops(func_block(module.body.operations[0].operation))
        buf = ops[0].results[0]
        with template_cache(), deferred_splices(1):
            splice_template(template, ops[1], [buf], None, "f32", "gac_k0_t")
            assert strategy._cache.pending  # (a stand-in: its template is being folded)
            answer = epilogue._renamable(buf, ops[1])
            still = bool(strategy._cache.pending)
        assert module.operation.verify()
        return answer, still, str(module)


@pytest.mark.unit
@pytest.mark.parametrize("template, renamable", [(TEMPLATE, True), (STATIC, True), (DYNAMIC, False)],
                         ids=["no view", "static view", "dynamic view"])
def test_the_answer_is_the_same_and_a_no_view_text_settles_nothing(monkeypatch, template, renamable):
    eager, eager_pending, eager_module = _ask(monkeypatch, template, lazy=False)
    lazy, lazy_pending, lazy_module = _ask(monkeypatch, template, lazy=True)
    assert eager == lazy == renamable
    assert not eager_pending  # as before: the kernel put in place to answer
    assert lazy_pending == renamable  # a dynamic view in the text: put in place first, as before
    assert lazy_module == eager_module


@pytest.mark.unit
def test_dynamic_views_read_off_the_text():
    header = "func.func @tmpl(%A: memref<7xf32>, %B: memref<7xf32>, %init: f32) {\n"
    assert strategy._dynamic_views(header + "  %r = memref.cast %A : memref<7xf32> to memref<?xf32>\n}", 3) \
        == [False, False, False]
    chained = header + ("  %r = memref.cast %B : memref<7xf32> to memref<?xf32>\n"
                        "  %s = memref.subview %r[%i] [1] [1] : memref<?xf32> to memref<1xf32, strided<[1], offset: ?>>\n}")
    assert strategy._dynamic_views(chained, 3) == [False, True, False]  # through a view of it
    assert strategy._dynamic_views(chained, 2) is None  # (a header that does not read as n arguments)


@pytest.mark.unit
def test_a_text_that_misleads_is_reported(monkeypatch):
    monkeypatch.setattr(strategy, "_dynamic_views", lambda text, n: [False] * n)  # (a wrong reading)
    monkeypatch.setenv("GAC_STRICT_INTERNAL", "1")
    with pytest.raises(CompileError, match="dynamically once folded, unlike its text"):
        _ask(monkeypatch, DYNAMIC, lazy=True)
    monkeypatch.setenv("GAC_STRICT_INTERNAL", "0")  # (a warning otherwise)
    assert _ask(monkeypatch, STATIC, lazy=True)[0]


@pytest.mark.unit
def test_an_operand_redirected_meanwhile_is_the_kernels(monkeypatch):
    """epilogue.rename_from may hand a pending kernel's stand-in another buffer (no longer putting
    the kernel in place first): the kernel, once in place, uses that one."""
    monkeypatch.setenv("GAC_GPU_STAGE_WORKERS", "1")
    module = ir.Module.parse(HOST, make_context())
    with module.context, ir.Location.unknown():
        block = func_block(module.body.operations[0].operation)
        ops = block_ops(block)
        buf, a = ops[0].results[0], block.arguments[0]
        with template_cache(), deferred_splices(1):
            splice_template(TEMPLATE, ops[1], [buf], None, "f32", "gac_k0_t")
            ((stand_in, *_),) = strategy._cache.pending.values()
            stand_in.operands[0] = a
        assert module.operation.verify()
        stores = [o for o in _walk(module) if o.name == "memref.store"]
        assert [s.operands[1] for s in stores] == [a]
        assert not any(o.name == "memref.store" for o in _walk(module) if buf in list(o.operands))


def _walk(module: ir.Module) -> list[ir.Operation]:
    out: list[ir.Operation] = []
    module.operation.walk(lambda o: out.append(o) or ir.WalkResult.ADVANCE, ir.WalkOrder.PRE_ORDER)
    return out
