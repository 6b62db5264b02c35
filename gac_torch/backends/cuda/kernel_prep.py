"""One outlined kernel made ready for the NVVM lowering: its launch-bound attributes and the
ABI rewrites (i1 buffers as bytes, TMA descriptors as pointers, aligned shared memory).

Run where the kernel is lowered: in a compile worker (ptx_worker.py, on the kernel's text as the
"gpu" stage printed it), or in-process. Imports only the MLIR bindings, so a worker loads it
without gac_torch (and torch). What depends on the process's settings (GAC_SGEMM_*) is decided
by the caller and passed in `Prep`, so it is part of the kernel's cache key.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import TypedDict

from mlir import ir

ACCEL_KINDS = ("wgmma", "cwgmma", "fa3")  # wgmma / setmaxnreg: sm_90a only (the whole module then)
SHARED_ALIGN = 16  # bytes: the mma template stages tiles with 16-byte shared-memory stores


class Prep(TypedDict):
    kind: str  # the kernel name's strategy suffix (gac_k<i>_<kind>)
    sgemm_blocks: int  # blocks per SM the exact-f32 sgemm is compiled for
    early_loads: bool  # sgemm: plain ld.global (kernels/conv_gemm_plan.py EARLY_LOADS)


def kind(name: str) -> str:
    return name.rsplit("_", 1)[-1]


def needs_accel(names) -> bool:
    """Does a kernel need the arch-specific target (sm_90a)? Then every kernel is lowered for it
    (it loads on compute capability 9.0 only, as sm_90 does)."""
    return any(kind(n) in ACCEL_KINDS for n in names)


def prepare(f: ir.Operation, prep: Prep) -> None:
    """Sets `f`'s attributes for ptxas and rewrites its ABI, in place (in the module's context)."""
    k = prep["kind"]
    i32 = ir.IntegerType.get_signless(32)
    if k in ACCEL_KINDS:
        _tensor_maps_as_pointers(f)
        f.attributes["nvvm.minctasm"] = ir.IntegerAttr.get(i32, 1)
        # CTA pairs (kernels/wgmma_gemm.py, cluster 2). (A local-scope print: a plain str()
        # numbers the whole module's values first.)
        if "multicast::cluster" in f.get_asm(use_local_scope=True):
            f.attributes["nvvm.cluster_dim"] = ir.DenseI32ArrayAttr.get([2, 1, 1])
    _i1_bytes().store_i1_as_bytes(f)
    _align_workgroup_buffers(f)
    if k in ("igemm", "sgemm"):  # implicit GEMM (strategies/implicit_gemm.py):
        # given only .maxntid, sm_90's ptxas caps registers near 80 and spills; asking for
        # 1 block per SM lifts the cap to 255 (at 2, 128, full-size tiles with a fused
        # epilogue spilled). An igemm staging only through cp.async (no registers hold a
        # slice in flight) fits 2 blocks per SM in 128 registers without spills: the second
        # block runs while the first waits at its barrier. The exact-f32 sgemm fits 2 in
        # 128 registers too (64 accumulators; checked in tests/test_sgemm.py): the other
        # block hides the late global loads ptxas sinks toward the slice's end.
        sgemm2 = k == "sgemm" and prep["sgemm_blocks"] == 2  # (GAC_SGEMM_CTAS=1 bisects)
        blocks = 2 if sgemm2 or (k == "igemm" and not _global_vector_loads(f)) else 1
        f.attributes["nvvm.minctasm"] = ir.IntegerAttr.get(i32, blocks)
        if k == "sgemm" and prep["early_loads"] and "arg_attrs" in f.attributes:
            # plain ld.global, not ld.global.nc (which noalias + read-only allows): ptxas keeps
            # those before the slice's barrier (conv_gemm.kernel 4), .nc ones it sinks past it
            del f.attributes["arg_attrs"]
    if k == "flash" and (cap := flash_maxnreg(f)):  # (flash attention)
        f.attributes["nvvm.maxnreg"] = ir.IntegerAttr.get(i32, cap)


def prepare_module(module: ir.Module, prep: Prep) -> None:
    """`prepare` on the one gpu.func of a kernel's module (kernel_jobs.split_bytecode)."""
    with module.context, ir.Location.unknown():
        for op in module.body.operations:
            if op.operation.name == "gpu.module":
                for f in op.regions[0].blocks[0].operations:
                    if f.operation.name == "gpu.func":
                        prepare(f.operation, prep)


def flash_maxnreg(kernel: ir.Operation) -> int | None:
    """A register cap for a flash-attention kernel: 128 for 8-warp blocks (two an SM; given only
    .maxntid, ptxas capped some f32 ones at 80 and spilled); smaller blocks keep ptxas's choice
    (it gave the 4-warp f32x3 D = 64 block 128, where a cap of 255 let it take 173)."""
    threads = math.prod(ir.DenseI32ArrayAttr(kernel.attributes["known_block_size"]))
    return 128 if threads >= 256 else None


def _tensor_maps_as_pointers(kernel: ir.Operation) -> None:
    """TMA descriptor parameters (!nvgpu.tensormap.descriptor) arrive as the descriptor's
    device address; the body reads them through a cast to !llvm.ptr, which then folds away."""
    body = kernel.regions[0].blocks[0]
    ptr = ir.Type.parse("!llvm.ptr")
    for a in body.arguments:
        if str(a.type).startswith("!nvgpu.tensormap.descriptor"):
            a.set_type(ptr)
    results = ir.FunctionType(ir.TypeAttr(kernel.attributes["function_type"]).value).results
    kernel.attributes["function_type"] = ir.TypeAttr.get(
        ir.FunctionType.get([a.type for a in body.arguments], results))


def _global_vector_loads(kernel: ir.Operation) -> bool:
    """The kernel body has a vector.load from global memory (a tile staged via registers)."""
    found = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "vector.load" and "workgroup" not in str(op.operands[0].type):
            found.append(op)
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    kernel.walk(visit, ir.WalkOrder.PRE_ORDER)
    return bool(found)


def _align_workgroup_buffers(kernel: ir.Operation) -> None:
    """Static shared-memory buffers are otherwise aligned only to their element type."""
    if "workgroup_attributions" not in kernel.attributes:
        return
    n = ir.IntegerAttr(kernel.attributes["workgroup_attributions"]).value
    if n:
        align = ir.DictAttr.get({"llvm.align": ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                                   SHARED_ALIGN)})
        kernel.attributes["workgroup_attrib_attrs"] = ir.ArrayAttr.get([align] * n)


def _i1_bytes():
    """backends/gpu/i1_bytes.py: from the package, or (in a worker: no gac_torch) by its path."""
    if __package__:
        from gac_torch.backends.gpu import i1_bytes

        return i1_bytes
    return sibling("i1_bytes")


def sibling(name: str):
    """Module backends/gpu/<name>.py loaded by its path (a worker process runs without gac_torch;
    the module imports only the MLIR bindings)."""
    key = f"gac_{name}"
    if key not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "gpu" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        sys.modules[key] = module
    return sys.modules[key]
