"""GAC-Torch: a PyTorch backend built on MLIR.

    torch.compile(model, backend="gac")          # registered by entry point; no import needed
    compiled = gac_torch.compile(exported_program, target="cpu")
    compiled = gac_torch.compile("model.onnx", target="cpu")   # or an onnx.ModelProto
    gac_torch.explain(model, *example_inputs)    # what compiles, what falls back, and why
    gac_torch.compile_stage_file("dump/fused_0.linalg", target="cuda")  # resume from a dump
    gac_torch.debug.bisect(model, example_inputs) # the first op whose compiled output is wrong
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from gac_torch.errors import (
    CompileError, GacCompilerError, GacCompilerWarning, GacError, GacInputError,
    GacUnsupportedError, MissingDependency, OnnxLoadError, OptionError, StaticShapesOnly, TargetUnavailable,
)
from gac_torch.runtime import cache  # gac_torch.cache.clear(); GAC_CACHE=0 disables it
from gac_torch.runtime.progress import last_report, register_with_torch, reports

register_with_torch()  # torch._logging.set_logs(gac=logging.INFO); TORCH_LOGS=gac_torch
cache.register_with_torch_artifacts()  # torch.compiler.save_cache_artifacts() carries gac's entries

__version__ = "0.1.0"


def compile(program, example_inputs: Sequence[Any] | None = None, *, target: str | None = None,
            options: dict | None = None):
    """Compiles a torch.export ExportedProgram (or an nn.Module with example inputs, exported
    first), or an ONNX model (a path or onnx.ModelProto; example_inputs then fix symbolic dims).
    Returns a callable; `.ir(stage)` shows the gac / linalg / target stages. A program exported
    with `Dim`s accepts any sizes in their ranges: compiled once when its target and ops take
    run-time sizes (`.dynamic`), else once per input shape."""
    from gac_torch.frontends.export import compile_exported, export_module
    from gac_torch.options import resolve

    opts = resolve(options, target=target)
    if isinstance(program, (str, os.PathLike)) or type(program).__name__ == "ModelProto":
        if str(program).endswith(".pt2"):
            program = torch.export.load(program)  # a torch.export archive, not ONNX
            return compile_exported(program, opts)
        try:
            from gac_torch.frontends.onnx import compile_onnx
        except ImportError as e:
            raise ImportError(f"compiling ONNX models needs {e.name or 'onnx'}: "
                              "pip install 'gac-torch[onnx]'") from e

        return compile_onnx(program, opts, example_inputs)
    if isinstance(program, torch.export.ExportedProgram):
        ep = program
    elif isinstance(program, torch.nn.Module):
        if example_inputs is None:
            raise TypeError("gac_torch.compile(nn.Module) needs example_inputs (a tuple of tensors)")
        ep = export_module(program, example_inputs)
    else:
        raise TypeError("gac_torch.compile takes an ExportedProgram, an nn.Module or an ONNX model, "
                        f"got {type(program).__name__}")
    return compile_exported(ep, opts)


def explain(model, *example_inputs, **example_kwargs):
    """Which ATen ops gac compiles and which fall back (with reasons), without compiling.

    Exports the model (ExportedProgram accepted as is), decomposes to core ATen and asks the
    registry about every node. Returns a GraphReport; str() gives the summary line."""
    from gac_torch.frontends.decompose import decompose_program
    from gac_torch.frontends.torch_state import tracing
    from gac_torch.legalize import decompositions
    from gac_torch.passes.partition import analyze, drop_metadata_asserts, partition

    with tracing():
        ep = model if isinstance(model, torch.export.ExportedProgram) else torch.export.export(
            model, tuple(example_inputs), example_kwargs or None)
        ep = decompose_program(ep, decompositions())
    gm = ep.graph_module
    drop_metadata_asserts(gm)  # as compile does, so the partition count is compile's
    gm.graph.eliminate_dead_code()
    decisions, report = analyze(gm)
    report.partitions = len(partition(gm, decisions)[1])
    return report


def compile_stage_file(path: str | os.PathLike, *, target: str | None = None,
                       options: dict | None = None):
    """Resume a compile from a dumped stage file (`GAC_DUMP_DIR`, `gac-torch compile`), e.g. an
    edited `fused_0.linalg`: its extension names the stage; every later stage of `target` runs.
    Returns (the text of each stage, the last artifact); nothing is loaded on a device."""
    from gac_torch.backends import get_target
    from gac_torch.driver import compile_from_stage
    from gac_torch.options import resolve

    opts = resolve(options, target=target)
    opts = opts.for_target(opts.target or "cpu")
    stage = os.path.basename(os.fspath(path)).rsplit(".", 1)[-1]
    with open(path) as f:
        text = f.read()
    return compile_from_stage(text, stage, get_target(opts.target), opts)


def save(compiled, path: str) -> None:
    """Writes a program compiled from torch.export to one file (runtime/artifact.py)."""
    from gac_torch.runtime.artifact import save as _save

    _save(compiled, path)


def load(path: str, target: str | None = None, options: dict | None = None):
    """Loads what save() wrote: runs without MLIR and without re-exporting."""
    from gac_torch.runtime.artifact import load as _load

    return _load(path, target, options)


def backend(gm, example_inputs, options: dict | None = None, **kwargs):
    """The dynamo backend (also registered as backend="gac")."""
    from gac_torch.frontends.dynamo import gac_backend

    return gac_backend(gm, example_inputs, options=options, **kwargs)


def __getattr__(name: str):
    if name == "debug":  # gac_torch.debug.bisect(...): imported on first use
        import importlib

        return importlib.import_module("gac_torch.debug")
    raise AttributeError(f"module 'gac_torch' has no attribute {name!r}")


__all__ = ["compile", "compile_stage_file", "explain", "save", "load", "backend", "cache", "reports",
           "last_report", "debug", "__version__",
           "GacError", "OptionError", "GacInputError", "GacUnsupportedError", "StaticShapesOnly",
           "CompileError", "GacCompilerError", "GacCompilerWarning", "TargetUnavailable",
           "MissingDependency", "OnnxLoadError"]
