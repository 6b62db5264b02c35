"""The CUDA target's stages: linalg -> "gpu" -> "llvm" -> "ptx".

- "gpu":  backends/gpu with the cuda strategies (one kernel per linalg op, outlined into
          `gpu.module @gac_kernels`); the host function that is left is read into data (launch
          list + buffer plan).
- "llvm": the gpu.module lowered to the NVVM/LLVM dialect (bare-pointer memref arguments, so a
          kernel takes one pointer per buffer and bakes static shapes/strides/offsets in), kernel
          by kernel, each distinct kernel once, in parallel, through `gpu-module-to-binary` to
          PTX too (kernel_jobs.py: that is most of a cold compile).
- "ptx":  the kernels' PTX joined into one module; libdevice is linked for math functions. With a
          ptxas (ptxas.for_cubins) each distinct kernel's cubin rides along (program.cubins), so
          the first call loads SASS instead of JIT-compiling the PTX.

Everything here runs without a GPU.
"""

from __future__ import annotations

import importlib.util
import math
import os
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlir import ir
from mlir.dialects import gpu

from gac_torch.backends.cuda import kernel_jobs, ptxas
from gac_torch.backends.gpu import host, tuning
from gac_torch.errors import CompileError
from gac_torch.kernels import conv_gemm_plan
from gac_torch.backends.gpu.irutil import run_passes
from gac_torch.backends.gpu.program import Cubin, GpuProgram
from gac_torch.backends.gpu.stage import read_scheduled, schedule_module
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy
from gac_torch.runtime import progress

log = logging.getLogger("gac_torch")


@dataclass
class CudaCodegen:
    """What the stages need, made from the user's options.CudaOptions (target.compile_options)."""

    arch: str  # "sm_90"
    ptx_features: str  # "+ptx80": the PTX ISA version LLVM emits
    opt_level: int
    limits: GpuLimits
    strategies: tuple[Strategy, ...]  # tried in order on each linalg op
    allow_tf32: bool = False  # f32 matmuls may run on tensor cores in TF32 (the mma strategy's)
    accel_arch: str | None = None  # arch-specific target (sm_90a: wgmma) for kernels needing it
    accel_ptx: str = ""  # its PTX ISA feature
    cache: bool = False  # keep each kernel's PTX in the on-disk cache (runtime/cache.py)


@dataclass
class GpuStage:
    """Artifact of the "gpu" and "llvm" stages: the module plus the host program read from it."""

    module: ir.Module
    program: GpuProgram  # ptx still empty
    options: CudaCodegen
    # map_stage's: the driver records the text after the "llvm" stage, which lowers a copy and
    # prints this one while its workers compile (a 37 MB print on BEVFormer-tiny, ~2 s)
    defer_text: bool = False
    printed: str | None = None

    @property
    def text(self) -> str:  # what the driver records for this stage
        if self.printed is None:
            described = "\n".join("// " + line for line in self.program.describe().splitlines())
            self.printed = f"{described}\n{self.module}"
        return self.printed

    def __str__(self) -> str:
        return self.text


@dataclass
class KernelsStage:
    """Artifact of the "llvm" stage when compiled kernel by kernel: each distinct kernel's
    lowered module and PTX (kernel_jobs.py), and the PTX of all of them joined."""

    program: GpuProgram  # ptx still empty
    kernels: list[kernel_jobs.KernelResult]
    ptx: str
    assembler: ptxas.Assembler | None = None  # (ptxas.for_cubins) what makes the cubins
    use_cache: bool = True

    @property
    def text(self) -> str:
        described = "\n".join("// " + line for line in self.program.describe().splitlines())
        return f"{described}\n{kernel_jobs.llvm_text(self.kernels)}"

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
    with tuning.session(tuning.load_table(options.arch)):  # measured tiles (gpu/tuning.py)
        program = schedule_module(module, options.limits, options.strategies, "cuda", options.arch)
    return GpuStage(module, program, options, defer_text=True)


def parse_gpu_stage(text: str, options: CudaCodegen) -> GpuStage:
    """A dumped (possibly edited) "gpu" stage back: the module, its host program read again."""
    module = _as_module(text)
    return GpuStage(module, read_scheduled(module, options.arch), options)


# --------------------------------------------------------------------------------------------
# stage "llvm"


def lower_stage(stage: GpuStage) -> GpuStage | KernelsStage:
    """Lower the kernels to NVVM (and on to PTX, kernel by kernel: KernelsStage; a module
    kernel_jobs cannot split is lowered whole). The host function is dropped: it is data in
    `program` now."""
    with kernel_jobs.started_workers(len(stage.program.launches)):  # (they start while the kernels are split)
        return _lower(stage)


def _lower(stage: GpuStage) -> GpuStage | KernelsStage:
    opts = stage.options
    module = stage.module if not stage.defer_text else _kernels_copy(stage.module)  # (rewritten in place)
    with module.context, ir.Location.unknown():
        for op in list(module.body.operations):
            if op.operation.name == "func.func":
                op.operation.erase()
        if not host.kernel_funcs(module):
            return GpuStage(module, stage.program, opts)
        chip, features = opts.arch, opts.ptx_features
        for name, f in host.kernel_funcs(module).items():
            if name.endswith(("_wgmma", "_cwgmma", "_fa3")):  # wgmma / setmaxnreg exist only on sm_90a: the whole
                # module targets it then (it loads on compute capability 9.0 only, as sm_90 does)
                chip, features = opts.accel_arch or chip, opts.accel_ptx or features
                _tensor_maps_as_pointers(f)
                f.attributes["nvvm.minctasm"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1)
                # CTA pairs (kernels/wgmma_gemm.py, cluster 2). (A local-scope print: a plain
                # str() numbers the whole module's values first, 0.3 s per kernel on BEVFormer.)
                if "multicast::cluster" in f.get_asm(use_local_scope=True):
                    f.attributes["nvvm.cluster_dim"] = ir.DenseI32ArrayAttr.get([2, 1, 1])
            host.store_i1_as_bytes(f)
            _align_workgroup_buffers(f)
            if name.endswith(("_igemm", "_sgemm")):  # implicit GEMM (strategies/implicit_gemm.py):
                # given only .maxntid, sm_90's ptxas caps registers near 80 and spills; asking for
                # 1 block per SM lifts the cap to 255 (at 2, 128, full-size tiles with a fused
                # epilogue spilled). An igemm staging only through cp.async (no registers hold a
                # slice in flight) fits 2 blocks per SM in 128 registers without spills: the second
                # block runs while the first waits at its barrier. The exact-f32 sgemm fits 2 in
                # 128 registers too (64 accumulators; checked in tests/test_sgemm.py): the other
                # block hides the late global loads ptxas sinks toward the slice's end.
                sgemm2 = name.endswith("_sgemm") and conv_gemm_plan.sgemm_blocks_per_sm() == 2  # (GAC_SGEMM_CTAS=1 bisects)
                blocks = 2 if sgemm2 or (name.endswith("_igemm") and not _global_vector_loads(f)) else 1
                f.attributes["nvvm.minctasm"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), blocks)
                if name.endswith("_sgemm") and conv_gemm_plan.EARLY_LOADS and "arg_attrs" in f.attributes:
                    # plain ld.global, not ld.global.nc (which noalias + read-only allows): ptxas keeps
                    # those before the slice's barrier (conv_gemm.kernel 4), .nc ones it sinks past it
                    del f.attributes["arg_attrs"]
            if name.endswith("_flash") and (cap := _flash_maxnreg(f)):  # (flash attention)
                f.attributes["nvvm.maxnreg"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), cap)
        lower = (
            f"nvvm-attach-target{{chip={chip} features={features} O={opts.opt_level}}}, "
            "gpu.module(lower-affine, convert-scf-to-cf, expand-strided-metadata, lower-affine, "
            # nvgpu: cp.async (implicit-GEMM and flash-attention staging) -> nvvm
            "convert-nvgpu-to-nvvm, convert-gpu-to-nvvm{use-bare-ptr-memref-call-conv=1}, convert-vector-to-llvm, "
            # math ops libdevice does not cover (trunc, ...) map to LLVM intrinsics NVPTX selects
            "convert-math-to-llvm, canonicalize, cse), "
            "reconcile-unrealized-casts")
        names = list(host.kernel_funcs(module))
        try:
            texts = kernel_jobs.split(module, names)
            assembler = ptxas.for_cubins()  # (the pool assembles each kernel's cubins after its PTX)
            kernels = kernel_jobs.compile_kernels(
                texts, lower, _binary_pipeline(), opts.cache,
                lambda done, n: progress.step(f"stage llvm: {done} of {n} distinct kernels compiled"),
                assembler, True, meanwhile=lambda: _print_and_release(stage) if stage.defer_text else None)
            return KernelsStage(stage.program, kernels, kernel_jobs.join_ptx(kernels, names),
                                assembler, opts.cache)
        except kernel_jobs.NotSplittable as e:
            log.debug("gac cuda: kernels compiled as one module (%s)", e)
        run_passes(module, lower)
    return GpuStage(module, stage.program, opts)


def _print_and_release(stage: GpuStage) -> None:
    """The "gpu" stage's text printed, then its module freed (~0.25 s for BEVFormer-tiny's,
    else paid after the pool when the driver drops the stage): only the text is needed now."""
    stage.printed = stage.text  # (the property prints once)
    stage.module = None  # type: ignore[assignment]


def _kernels_copy(module: ir.Module) -> ir.Module:
    """The module without its host function, copied: what lower_stage rewrites, leaving the
    "gpu" stage's module to be printed later (cloning is C++ only, printing calls back into
    Python for every token)."""
    with module.context, ir.Location.unknown():
        copy = ir.Module.create()
        attributes = module.operation.attributes
        for name in list(attributes):
            copy.operation.attributes[name] = attributes[name]
        at = ir.InsertionPoint(copy.body)
        for op in module.body.operations:
            if op.operation.name != "func.func":
                op.operation.clone(at)
    return copy


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


def _flash_maxnreg(kernel: ir.Operation) -> int | None:
    """A register cap for a flash-attention kernel: 128 for 8-warp blocks (two an SM; given only
    .maxntid, ptxas capped some f32 ones at 80 and spilled); smaller blocks keep ptxas's choice
    (it gave the 4-warp f32x3 D = 64 block 128, where a cap of 255 let it take 173)."""
    threads = math.prod(ir.DenseI32ArrayAttr(kernel.attributes["known_block_size"]))
    return 128 if threads >= 256 else None


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


def _binary_pipeline() -> str:
    toolkit = find_cuda_toolkit()
    return f"gpu-module-to-binary{{format=isa{f' toolkit={toolkit}' if toolkit else ''}}}"


def ptx_stage(stage: GpuStage | KernelsStage) -> GpuProgram:
    program = replace(stage.program)
    if not program.launches:
        program.ptx = ""
        return program
    if isinstance(stage, KernelsStage):
        ptx = stage.ptx
    else:
        module = stage.module  # in place, as in lower_stage
        with module.context:
            run_passes(module, _binary_pipeline())
            binaries = [op for op in module.body.operations if op.operation.name == "gpu.binary"]
            ptx = gpu.ObjectAttr(binaries[0].attributes["objects"][0]).object.decode()
    if isinstance(stage, KernelsStage):
        program.cubins = cubins(stage.kernels, stage.assembler, stage.use_cache)
    if ".extern .func __nv_" in ptx:
        raise CompileError("kernels call libdevice math functions but no CUDA toolkit with "
                           "nvvm/libdevice was found: pip install nvidia-cuda-nvcc-cu12 or set "
                           "CUDA_HOME / GAC_CUDA_TOOLKIT")
    program.ptx = ptx
    return program


def cubins(kernels: list[kernel_jobs.KernelResult], assembler: ptxas.Assembler | None,
           use_cache: bool) -> list[Cubin]:
    """One cubin per kernel, assembled by ptxas from its PTX under its own name (what profilers
    and the autotuner see; the distinct texts compile once, named PLACEHOLDER), in the compile
    pool beside the LLVM jobs (KernelResult.named) or else here in threads (ptxas is a
    subprocess), each cached by its named PTX; none unless every kernel has one (a program
    loads either as SASS or as the joined PTX: a mix would JIT the whole PTX module anyway)."""
    if assembler is None or not kernels:
        return []
    from concurrent.futures import ThreadPoolExecutor

    from gac_torch.backends.cuda.ptx_worker import ptx_arch

    jobs = [(name, k.ptx.replace(kernel_jobs.PLACEHOLDER, name), (k.named or {}).get(name))
            for k in kernels for name in k.names]
    with ThreadPoolExecutor(kernel_jobs.worker_count()) as pool:
        made = list(pool.map(lambda job: _cubin(job[1], assembler, use_cache, job[2]), jobs))
    rejected = [f"{name}: {why}" for (name, _, _), (data, why) in zip(jobs, made) if data is None]
    if rejected:
        log.info("gac cuda: %d kernels without a cubin, the program loads as PTX (%s)", len(rejected), rejected[0])
        return []
    return [Cubin(ptx_arch(ptx) or "", data, (name,)) for (name, ptx, _), (data, _) in zip(jobs, made)]


def _cubin(ptx: str, assembler: ptxas.Assembler, use_cache: bool,
           made: tuple[bytes | None, str] | None = None) -> tuple[bytes | None, str]:
    """`ptx`'s cubin: `made` (assembled in the pool), else from the cache, else by ptxas."""
    import hashlib

    from gac_torch.backends.cuda.ptx_worker import assemble
    from gac_torch.runtime import cache

    key = hashlib.sha256(f"cuda-cubin\0{assembler.version}\0{ptx}".encode()).hexdigest()
    if made is not None:
        data, why = made
    else:
        entry = cache.load(key, quiet=True) if use_cache else None
        if entry is not None and "cubin" in entry.blobs:
            return entry.blobs["cubin"], ""
        data, why = assemble(ptx, assembler.exe)
    if data is not None and use_cache:
        cache.store(key, cache.Entry({}, {"cubin": data}, {}), quiet=True)
    return data, why
