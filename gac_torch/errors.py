"""Every error gac_torch raises on purpose derives from GacError (exported from gac_torch), so
`except gac_torch.GacError` catches what gac reports and lets real bugs through. Each also keeps
the standard base a caller would expect (ValueError for bad options, TypeError for bad inputs).
This module imports nothing, so any layer can use it."""

from __future__ import annotations


class GacError(Exception):
    """Base of every error gac_torch raises on purpose."""


class OptionError(GacError, ValueError):
    """An unknown or invalid compile option (the message lists the valid ones)."""


class GacInputError(GacError, TypeError):
    """A compiled program was called with inputs that do not match what it was compiled for."""


class GacUnsupportedError(GacError, RuntimeError):
    """gac cannot compile this: an op, a dtype, a shape or a layout it has no lowering or
    schedule for (with fallback, that part of the graph runs eagerly instead)."""


class GacCompilerError(GacUnsupportedError):
    """A partition of supported ops failed to compile (a gac bug): raised in strict mode and when
    GAC_STRICT_INTERNAL=1 (the test suite); otherwise a GacCompilerWarning, and it runs eagerly."""


class GacCompilerWarning(RuntimeWarning):
    """A partition fell back to eager because gac failed to compile it (a gac bug)."""


class StaticShapesOnly(GacError):
    """A target cannot compile this graph with its sizes left to run time (it can for concrete
    shapes): the front-ends then compile it once per shape, with this as the reason."""


class CompileError(GacError, RuntimeError):
    """A compile failed for a reason that is not the graph's: a compiler invariant (a bug), or a
    missing tool (CUDA toolkit, LLVM translation)."""


class TargetUnavailable(GacError, RuntimeError):
    """The target cannot run on this machine (no GPU, no Vortex runtime, ...)."""


class MissingDependency(GacError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class OnnxLoadError(GacError, ValueError):
    """An ONNX model that cannot be read, checked or shape-inferred."""


__all__ = ["GacError", "OptionError", "GacInputError", "GacUnsupportedError", "GacCompilerError",
           "GacCompilerWarning", "StaticShapesOnly",
           "CompileError", "TargetUnavailable", "MissingDependency", "OnnxLoadError"]
