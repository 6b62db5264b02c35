"""The gpu stage's shortcuts give what the long way gives: kernel templates parsed once and
cloned (strategy.template_cache), block positions by bisection (irutil.op_index), one PTX
parse per distinct kernel (kernel_jobs.join_ptx), top-level ops memoized per block
(irutil.Tops), a pipeline's result verified once (irutil.run_passes)."""

from __future__ import annotations

import pytest
from mlir import ir

from gac_torch.backends.cuda import kernel_jobs
from gac_torch.backends.gpu.irutil import (
    Tops, block_ops, func_block, op_at, op_index, ops_between, run_passes, top_level,
)
from gac_torch.backends.gpu.strategy import splice_template, template_cache
from gac_torch.ir.dialect import make_context

HOST = """func.func @main(%a: memref<7xf32>, %b: memref<7xf32>, %x: f32) {
  %0 = arith.addf %x, %x : f32
  %1 = arith.mulf %0, %x : f32
  %2 = arith.subf %1, %x : f32
  return
}"""

# a template whose body folds (c2 * c3, the duplicated c1), as the generated ones do
TEMPLATE = """func.func @tmpl(%A: memref<7xf32>, %init: f32) {
  %one = arith.constant 1 : index
  %n = arith.constant 7 : index
  gpu.launch blocks(%bx, %by, %bz) in (%gx = %one, %gy = %one, %gz = %one)
             threads(%tx, %ty, %tz) in (%sx = %n, %sy = %one, %sz = %one) {
    %c1 = arith.constant 1 : index
    %c1b = arith.constant 1 : index
    %c2 = arith.constant 2 : index
    %c3 = arith.constant 3 : index
    %s = arith.muli %c2, %c3 : index
    %i = arith.addi %tx, %c1 : index
    %j = arith.subi %i, %c1b : index
    %k = arith.remui %j, %s : index
    %v = arith.addf %init, %init : f32
    memref.store %v, %A[%k] : memref<7xf32>
    gpu.terminator
  }
  return
}"""


def _spliced(cached: bool) -> str:
    module = ir.Module.parse(HOST, make_context())
    with module.context, ir.Location.unknown():
        ops = block_ops(func_block(module.body.operations[0].operation))
        args = list(func_block(module.body.operations[0].operation).arguments)

        def splice() -> None:
            splice_template(TEMPLATE, ops[1], [args[0]], args[2], "f32", "gac_k0_t")
            splice_template(TEMPLATE, ops[2], [args[1]], ops[0].results[0], "f32", "gac_k1_t")

        if cached:
            with template_cache():
                splice()
        else:
            splice()
        assert module.operation.verify()
        return str(module)


def test_a_cached_template_splices_like_a_fresh_parse():
    text = _spliced(cached=True)
    assert text == _spliced(cached=False)
    assert text.count("gpu.launch") == 2 and "gac_k1_t" in text
    assert "arith.muli" not in text  # folded


def test_op_positions_by_bisection():
    module = ir.Module.parse(HOST, make_context())
    block = func_block(module.body.operations[0].operation)
    ops = block_ops(block)
    assert [op.name for op in ops] == ["arith.addf", "arith.mulf", "arith.subf", "func.return"]
    assert [op_index(op) for op in ops] == [0, 1, 2, 3]
    assert op_at(block, 1) == ops[1] and op_at(block, -1) is None and op_at(block, 4) is None
    assert ops_between(ops[0], ops[3]) == ops[1:3] and ops_between(ops[2], ops[1]) == []


def test_kernels_sharing_a_ptx_join_like_separate_ones():
    head = "//\n.version 7.8\n.target sm_90\n.address_size 64\n\n"
    ptx = (head + ".global .align 4 .b8 g[4] = {1, 2, 3, 4};\n\n"
           f".visible .entry {kernel_jobs.PLACEHOLDER}( // {kernel_jobs.PLACEHOLDER} here\n"
           f"\t.param .u64 {kernel_jobs.PLACEHOLDER}_param_0\n)\n{{\n$L__BB0_1:\n\tret;\n}}\n")
    shared = kernel_jobs.join_ptx([kernel_jobs.KernelResult(["a", "b"], "", ptx)], ["b", "a"])
    apart = kernel_jobs.join_ptx([kernel_jobs.KernelResult([n], "", ptx) for n in "ab"], ["b", "a"])
    assert shared == apart
    assert shared.index(".entry b(") < shared.index(".entry a(") and shared.count(".global") == 1


NESTS = """func.func @main(%n: index, %x: f32, %m: memref<7xf32>) {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  scf.for %i = %c0 to %n step %c1 {
    scf.for %j = %c0 to %n step %c1 {
      memref.store %x, %m[%j] : memref<7xf32>
    }
    memref.store %x, %m[%i] : memref<7xf32>
  }
  scf.for %k = %c0 to %n step %c1 {
    %y = arith.addf %x, %x : f32
    memref.store %y, %m[%k] : memref<7xf32>
  }
  return
}"""


def _nested(block: ir.Block) -> list[ir.Operation]:
    out = []
    for top in block_ops(block):
        top.walk(lambda o: out.append(o) or ir.WalkResult.ADVANCE)
    return out


@pytest.mark.unit
def test_tops_answer_as_top_level_while_the_ir_holds():
    module = ir.Module.parse(NESTS, make_context())
    block = func_block(module.body.operations[0].operation)
    tops = Tops(block)
    ops = _nested(block)
    assert len(ops) == 13 and [tops(o) for o in ops] == [top_level(o, block) for o in ops]
    # a loop moved (with its body block) into the other loop: the memo of the analysis before
    # knows the body's block under its old top-level op; a fresh one follows the move
    first, second = [o for o in block_ops(block) if o.name == "scf.for"]
    inner = next(o for o in block_ops(first.regions[0].blocks[0]) if o.name == "scf.for")
    store = block_ops(inner.regions[0].blocks[0])[0]
    inner.move_before(block_ops(second.regions[0].blocks[0])[0])
    assert tops(store) == first  # stale: a Tops lives within one analysis of an unchanged IR
    assert Tops(block)(store) == second == top_level(store, block)


@pytest.mark.unit
def test_a_pipelines_result_is_verified_once(monkeypatch):
    bad = """func.func @f(%x: f32) -> f32 {
  %0 = arith.addf %x, %x : f32
  return %0 : f32
}"""
    module = ir.Module.parse(bad, make_context())
    with module.context:  # the result no longer matches the function's type: invalid
        module.body.operations[0].operation.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get([ir.F32Type.get()], [ir.IndexType.get()]))
        run_passes(module, "canonicalize", verify=False)  # (the caller verifies later)
        with pytest.raises(ir.MLIRError, match="verification failed|Verification failed"):
            run_passes(module, "canonicalize, cse")
        monkeypatch.setenv("GAC_VERIFY_PASSES", "1")  # (after each pass: the pass manager's)
        with pytest.raises(ir.MLIRError):
            run_passes(module, "canonicalize, cse")
