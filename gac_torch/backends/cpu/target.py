"""cpu target: stages `llvm` (LLVM dialect) and a loader around mlir.execution_engine.

It is the oracle CI checks every op and model on, so it favours plain, obviously-correct code
generation (loops, no vectorization tricks) over speed.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from typing import TYPE_CHECKING, Sequence

import torch

from gac_torch.backends.base import Signature, SizeSpec, Stage, Target
from gac_torch.backends.cpu.memref import descriptor, descriptor_type

log = logging.getLogger("gac_torch")
# MLIR is imported where it is used: a saved artifact loads this target without it.
if TYPE_CHECKING:
    from mlir import ir

# Why each step: inline the private functions of fused units (gac.attention's maths: a target
# without a template runs it in place); bufferize with identity layouts at the boundary so
# arguments stay plain pointers; memref.copy -> linalg.copy (no runtime library); loops; then
# everything to LLVM.
BUFFERIZE = ",".join([
    "inline{default-pipeline=}", "symbol-dce",
    "one-shot-bufferize{bufferize-function-boundaries function-boundary-type-conversion=identity-layout-map}",
    "canonicalize", "cse",
])
TO_LLVM = ",".join([
    "buffer-deallocation-pipeline",
    "func.func(convert-linalg-to-loops)",
    "convert-scf-to-cf",
    "expand-strided-metadata",
    "lower-affine",
    "convert-math-to-llvm",
    "convert-math-to-libm",
    "finalize-memref-to-llvm",
    "convert-arith-to-llvm",
    "convert-index-to-llvm",
    "convert-func-to-llvm",
    "convert-cf-to-llvm",
    "reconcile-unrealized-casts",
])


def lower_to_llvm(module: ir.Module) -> ir.Module:
    from mlir import ir, passmanager

    from gac_torch.passes.copies import memref_copy_to_linalg

    with module.context, ir.Location.unknown():
        passmanager.PassManager.parse(f"builtin.module({BUFFERIZE})").run(module.operation)
        memref_copy_to_linalg(module)
        passmanager.PassManager.parse(f"builtin.module({TO_LLVM})").run(module.operation)
    return module


class CpuExecutable:
    """Calls `_mlir_ciface_main` with one memref descriptor per tensor, pointing at torch storage
    (sizes known only at run time travel in the descriptors' shape fields), and an int64 per
    size argument."""

    def __init__(self, module: ir.Module, signature: Signature):
        from mlir.execution_engine import ExecutionEngine

        self.module = module  # keeps the context alive as long as the engine
        self.engine = ExecutionEngine(module, opt_level=2)
        self.desc_types = [ctypes.c_int64 if isinstance(s, SizeSpec) else descriptor_type(len(s.shape))
                           for s in signature.inputs + signature.outputs]

    def run(self, inputs: Sequence[torch.Tensor | int], outputs: Sequence[torch.Tensor]) -> None:
        descs = []
        for t, dtype in zip(list(inputs) + list(outputs), self.desc_types):
            if dtype is ctypes.c_int64:
                descs.append(dtype(int(t)))
                continue
            descs.append(descriptor(t, dtype))
        # The packed interface takes a pointer to each argument: a descriptor pointer, or an int64.
        self.engine.invoke("main", *[ctypes.pointer(d) if isinstance(d, ctypes.c_int64)
                                     else ctypes.pointer(ctypes.pointer(d)) for d in descs])


def _load(artifact: ir.Module, signature: Signature, options: dict):
    """The in-process JIT, except for a huge module (one function of a whole model): the JIT's
    O2 pipeline takes ~10x longer than llc on it, so it goes through native.py when it can."""
    from mlir.dialects.llvm import translate_module_to_llvmir

    from gac_torch.backends.cpu import native

    llvm_ir = translate_module_to_llvmir(artifact.operation)
    if len(llvm_ir) > native.OPT_MAX_IR_BYTES:
        try:
            return native.NativeExecutable(native.shared_object(llvm_ir), signature)
        except native.NativeUnavailable as e:
            log.info("gac: cpu native code unavailable (%s); JIT-compiling instead", e)
    return CpuExecutable(artifact, signature)


def _pack(artifact: ir.Module, options: dict, required: bool = False) -> tuple[dict, dict[str, bytes]] | None:
    """Native code for the cache and artifacts (native.py): a shared object. Not for the cache
    below NATIVE_MIN_IR_BYTES: linking costs more (~0.3 s) than JIT-compiling a small module."""
    from mlir.dialects.llvm import translate_module_to_llvmir

    from gac_torch.backends.cpu import native

    llvm_ir = translate_module_to_llvmir(artifact.operation)
    if not required and len(llvm_ir) < native.NATIVE_MIN_IR_BYTES:
        return None
    return {"entry": native.ENTRY}, {"so": native.shared_object(llvm_ir)}


def _unpack(meta: dict, blobs: dict[str, bytes], signature: Signature, options: dict):
    from gac_torch.backends.cpu import native

    return native.NativeExecutable(blobs["so"], signature)


TARGET = Target(
    name="cpu",
    device_type="cpu",
    stages=lambda options: [Stage("llvm", lower_to_llvm, "mlir")],
    load=_load,
    dynamic_shapes=True,
    pack=_pack,
    unpack=_unpack,
    cache_key=lambda options: {"machine": platform.machine()},
)
