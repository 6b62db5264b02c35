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
import os
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlir import ir
from mlir.dialects import gpu

from gac_torch.backends.cuda import kernel_jobs, kernel_prep, ptxas
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
            self.printed = _described(self.program) + _module_text(self.module)
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
        return f"{_described(self.program)}{kernel_jobs.llvm_text(self.kernels)}"

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
    module = stage.module  # (its kernels move out, or it is rewritten once its text is printed)
    with module.context, ir.Location.unknown():
        funcs = host.kernel_funcs(module)
        names = list(funcs)
        chip, features = opts.arch, opts.ptx_features
        if kernel_prep.needs_accel(names):  # wgmma / setmaxnreg exist only on sm_90a: the whole
            # module targets it then (it loads on compute capability 9.0 only, as sm_90 does)
            chip, features = opts.accel_arch or chip, opts.accel_ptx or features
        lower = (
            f"nvvm-attach-target{{chip={chip} features={features} O={opts.opt_level}}}, "
            "gpu.module(lower-affine, convert-scf-to-cf, expand-strided-metadata, lower-affine, "
            # nvgpu: cp.async (implicit-GEMM and flash-attention staging) -> nvvm
            "convert-nvgpu-to-nvvm, convert-gpu-to-nvvm{use-bare-ptr-memref-call-conv=1}, convert-vector-to-llvm, "
            # math ops libdevice does not cover (trunc, ...) map to LLVM intrinsics NVPTX selects
            "convert-math-to-llvm, canonicalize, cse), "
            "reconcile-unrealized-casts")
        preps = {name: _prep(name) for name in names}
        texts = None
        if funcs:
            try:  # each kernel written once, as the "gpu" stage has it, for its worker, which
                # prepares it for ptxas (kernel_prep.py) and lowers it
                texts, shape = kernel_jobs.split_bytecode(module, names)
            except kernel_jobs.NotSplittable as e:
                log.debug("gac cuda: kernels compiled as one module (%s)", e)
        if texts is not None:
            # (the kernels left the module: freed now, ~0.25 s for BEVFormer-tiny's, not after the pool)
            stage.module = module = funcs = None  # type: ignore[assignment]
            # the stage's text: the distinct kernels printed by other workers beside the pool
            distinct = list(dict.fromkeys(texts.values())) if stage.printed is None else []
            printed = kernel_jobs.print_kernels(distinct) if distinct else None
            assembler = ptxas.for_cubins()  # (the pool assembles each kernel's cubins after its PTX)
            kernels = kernel_jobs.compile_kernels(
                texts, lower, _binary_pipeline(), opts.cache,
                lambda done, n: progress.step(f"stage llvm: {done} of {n} distinct kernels compiled"),
                assembler, True, preps=preps)
            if printed is not None:
                of = dict(zip(distinct, printed()))
                head = f"gpu.func @{kernel_jobs.PLACEHOLDER}("
                stage.printed = _described(stage.program) + shape.text_of(
                    {n: f"gpu.func @{n}(" + of[texts[n]][len(head):] for n in names})
            try:
                return KernelsStage(stage.program, kernels, kernel_jobs.join_ptx(kernels, names),
                                    assembler, opts.cache)
            except kernel_jobs.NotSplittable as e:
                log.debug("gac cuda: kernels compiled as one module (%s)", e)
            module = ir.Module.parse(stage.text)  # (the kernels left the first one)
            funcs = host.kernel_funcs(module)
        if stage.defer_text:  # printed before the rewrites below
            stage.printed = stage.text
        for op in list(module.body.operations):
            if op.operation.name == "func.func":  # the host function: data in `program` now
                op.operation.erase()
        if not funcs:
            return GpuStage(module, stage.program, opts)
        for name, f in funcs.items():
            kernel_prep.prepare(f, preps[name])
        run_passes(module, lower)
    return GpuStage(module, stage.program, opts)


def _prep(name: str) -> kernel_prep.Prep:
    """How kernel `name` is prepared for ptxas (kernel_prep.py): the settings of this process."""
    return kernel_prep.Prep(kind=kernel_prep.kind(name), sgemm_blocks=conv_gemm_plan.sgemm_blocks_per_sm(),
                            early_loads=bool(conv_gemm_plan.EARLY_LOADS))


def _module_text(module: ir.Module) -> str:
    """The module's text as lower_stage makes it (kernel_jobs.Layout: kernels printed apart),
    so the "gpu" stage reads the same printed then or right away (a plain print where the
    module cannot be split)."""
    with module.context:
        try:
            shape, kernels = kernel_jobs.layout(module, list(host.kernel_funcs(module)))
            return shape.text_of({n: kernel_jobs.kernel_text(f, n) for n, f in kernels.items()})
        except kernel_jobs.NotSplittable:
            return str(module)


def _described(program: GpuProgram) -> str:
    return "\n".join("// " + line for line in program.describe().splitlines()) + "\n"


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
        cache.store_later(key, cache.Entry({}, {"cubin": data}, {}), quiet=True)
    return data, why
