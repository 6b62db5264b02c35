"""The "gpu" stage both GPU targets run: schedule the linalg module (schedule.py) and read the
host function that is left into data (host.py)."""

from __future__ import annotations

from collections.abc import Sequence

from mlir import ir

from gac_torch.errors import CompileError, GacUnsupportedError, StaticShapesOnly
from gac_torch.backends.gpu.host import annotate_noalias, arg_spec, count_inputs, read_host_program
from gac_torch.backends.gpu.irutil import func_block, main_func, run_passes
from gac_torch.backends.gpu.program import GpuProgram
from gac_torch.backends.gpu.schedule import map_to_gpu
from gac_torch.backends.gpu.strategy import GpuLimits, Strategy


def schedule_module(module: ir.Module, limits: GpuLimits, strategies: Sequence[Strategy],
                    target: str, arch: str) -> GpuProgram:
    """Rewrite `module` (the linalg stage, in its own context) in place into host code + one
    outlined kernel per op, and return the host program (device code still empty). A graph with
    run-time sizes the schedule handles for static shapes only raises StaticShapesOnly; a launch
    list that would lose or clobber a value fails the compile."""
    with module.context, ir.Location.unknown():
        fn = main_func(module)
        args = [arg_spec(a.type) for a in func_block(fn).arguments]
        dynamic = any(a.elem == "index" or -1 in a.shape for a in args)
        n_inputs = count_inputs(fn)
        try:
            map_to_gpu(module, limits, strategies, n_inputs)
            if dynamic:  # views' run-time metadata as index math over their allocations' sizes
                run_passes(module, "func.func(expand-strided-metadata, lower-affine, canonicalize, cse)")
            annotate_noalias(module)
            program = read_host_program(module, args, arch, dynamic)
        except GacUnsupportedError as e:
            if dynamic:  # what the mapping handles for static shapes only
                raise StaticShapesOnly(f"{target} mapping: {e}") from e
            raise
    _check(program, n_inputs, target)
    return program


def read_scheduled(module: ir.Module, arch: str) -> GpuProgram:
    """The host program of an already scheduled module (a dumped "gpu" stage), read again.
    (Its dataflow is not checked again: the module no longer says which arguments are outputs.)"""
    with module.context, ir.Location.unknown():
        fn = main_func(module)
        args = [arg_spec(a.type) for a in func_block(fn).arguments]
        dynamic = any(a.elem == "index" or -1 in a.shape for a in args)
        return read_host_program(module, args, arch, dynamic)


def _check(program: GpuProgram, n_inputs: int, target: str) -> None:
    errors = program.dataflow_errors(n_inputs)
    if errors:  # a wrong program must not run: fail the compile, naming what is wrong
        raise CompileError(f"{target} target: the compiled launch list violates its dataflow "
                           "invariants (a compiler bug):\n  " + "\n  ".join(errors)
                           + "\n" + program.describe())
