"""The cpu reference target: linalg -> loops -> LLVM, run by the MLIR ExecutionEngine."""

from gac_torch.backends.cpu.target import TARGET

__all__ = ["TARGET"]
