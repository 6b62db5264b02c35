"""The CUDA target's stages: linalg -> "gpu" -> "llvm" -> "ptx".

- "gpu":  backends/gpu with the cuda strategies (one kernel per linalg op, outlined into
          `gpu.module @gac_kernels`); the host function that is left is read into data (launch
          list + buffer plan).
- "llvm": the gpu.module lowered to the NVVM/LLVM dialect (bare-pointer memref arguments, so a
          kernel takes one pointer per buffer and bakes static shapes/strides/offsets in).
- "ptx":  `gpu-module-to-binary{format=isa}` in-process; libdevice is linked for math functions.

Everything here runs without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlir import ir
from mlir.dialects import gpu

from gac_torch.backends.gpu import host
from gac_torch.errors import CompileError
from gac_torch.backends.gpu.irutil import run_passes
from gac_torch.backends.gpu.program import GpuProgram
from gac_torch.backends.gpu.stage import read_scheduled, schedule_module
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy


@dataclass
class CudaCodegen:
    """What the stages need, made from the user's options.CudaOptions (target.compile_options)."""

    arch: str  # "sm_90"
    ptx_features: str  # "+ptx80": the PTX ISA version LLVM emits
    opt_level: int
    limits: GpuLimits
    strategies: tuple[Strategy, ...]  # tried in order on each linalg op
    allow_tf32: bool = False  # f32 matmuls may run on tensor cores in TF32 (the mma strategy's)


@dataclass
class GpuStage:
    """Artifact of the "gpu" and "llvm" stages: the module plus the host program read from it."""

    module: ir.Module
    program: GpuProgram  # ptx still empty
    options: CudaCodegen

    @property
    def text(self) -> str:  # what the driver records for this stage
        described = "\n".join("// " + line for line in self.program.describe().splitlines())
        return f"{described}\n{self.module}"

    def __str__(self) -> str:
        return self.text


# --------------------------------------------------------------------------------------------
# stage "gpu"


def _as_module(artifact: str | ir.Module) -> ir.Module:
    """The linalg module, rewritten in place by the stages that follow: the driver has recorded
    its text already, and printing and parsing it again would cost more than the stage itself
    on a whole model. Text (a dumped stage) is parsed into a fresh context."""
    return artifact if isinstance(artifact, ir.Module) else ir.Module.parse(artifact, ir.Context())


def map_stage(artifact: Any, options: CudaCodegen) -> GpuStage:
    module = _as_module(artifact)
    program = schedule_module(module, options.limits, options.strategies, "cuda", options.arch)
    return GpuStage(module, program, options)


def parse_gpu_stage(text: str, options: CudaCodegen) -> GpuStage:
    """A dumped (possibly edited) "gpu" stage back: the module, its host program read again."""
    module = _as_module(text)
    return GpuStage(module, read_scheduled(module, options.arch), options)


# --------------------------------------------------------------------------------------------
# stage "llvm"


def lower_stage(stage: GpuStage) -> GpuStage:
    """Lower the kernels to NVVM. The host function is dropped: it is data in `program` now."""
    opts = stage.options
    module = stage.module  # in place: the "gpu" stage's text is recorded already
    with module.context, ir.Location.unknown():
        for op in list(module.body.operations):
            if op.operation.name == "func.func":
                op.operation.erase()
        if not host.kernel_funcs(module):
            return GpuStage(module, stage.program, opts)
        for name, f in host.kernel_funcs(module).items():
            host.store_i1_as_bytes(f)
            _align_workgroup_buffers(f)
            if name.endswith(("_igemm", "_sgemm")):  # implicit GEMM (strategies/implicit_gemm.py):
                # given only .maxntid, sm_90's ptxas caps registers near 80 and spills; asking for
                # 1 block per SM lifts the cap to 255 (at 2, 128, full-size tiles with a fused
                # epilogue spilled). Occupancy vs. registers is for tuning on the device.
                f.attributes["nvvm.minctasm"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1)
        run_passes(
            module,
            f"nvvm-attach-target{{chip={opts.arch} features={opts.ptx_features} O={opts.opt_level}}}, "
            "gpu.module(lower-affine, convert-scf-to-cf, expand-strided-metadata, lower-affine, "
            "convert-gpu-to-nvvm{use-bare-ptr-memref-call-conv=1}, convert-vector-to-llvm, "
            # math ops libdevice does not cover (trunc, ...) map to LLVM intrinsics NVPTX selects
            "convert-math-to-llvm, canonicalize, cse), "
            "reconcile-unrealized-casts")
    return GpuStage(module, stage.program, opts)


SHARED_ALIGN = 16  # bytes: the mma template stages tiles with 16-byte shared-memory stores


def _align_workgroup_buffers(kernel: ir.Operation) -> None:
    """Static shared-memory buffers are otherwise aligned only to their element type."""
    if "workgroup_attributions" not in kernel.attributes:
        return
    n = ir.IntegerAttr(kernel.attributes["workgroup_attributions"]).value
    if n:
        align = ir.DictAttr.get({"llvm.align": ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                                   SHARED_ALIGN)})
        kernel.attributes["workgroup_attrib_attrs"] = ir.ArrayAttr.get([align] * n)




# --------------------------------------------------------------------------------------------
# stage "ptx"


def find_cuda_toolkit() -> str | None:
    """A directory holding nvvm/libdevice/libdevice.10.bc (needed to link math functions):
    $GAC_CUDA_TOOLKIT, $CUDA_HOME, $CUDA_PATH, the nvidia-cuda-nvcc wheel, /usr/local/cuda."""
    candidates = [os.environ.get(k) for k in ("GAC_CUDA_TOOLKIT", "CUDA_HOME", "CUDA_PATH")]
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        candidates += [str(Path(p) / "cuda_nvcc") for p in spec.submodule_search_locations]
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "nvvm" / "libdevice" / "libdevice.10.bc").is_file():
            return c
    return None


def ptx_stage(stage: GpuStage) -> GpuProgram:
    program = replace(stage.program)
    if not program.launches:
        program.ptx = ""
        return program
    module = stage.module  # in place, as in lower_stage
    toolkit = find_cuda_toolkit()
    opt = f"format=isa toolkit={toolkit}" if toolkit else "format=isa"
    with module.context:
        run_passes(module, f"gpu-module-to-binary{{{opt}}}")
        binaries = [op for op in module.body.operations if op.operation.name == "gpu.binary"]
        ptx = gpu.ObjectAttr(binaries[0].attributes["objects"][0]).object.decode()
    if ".extern .func __nv_" in ptx:
        raise CompileError("kernels call libdevice math functions but no CUDA toolkit with "
                           "nvvm/libdevice was found: pip install nvidia-cuda-nvcc-cu12 or set "
                           "CUDA_HOME / GAC_CUDA_TOOLKIT")
    program.ptx = ptx
    return program
