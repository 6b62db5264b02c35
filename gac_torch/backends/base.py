"""What every target provides: a stage table and a loader.

A compiled graph travels the stages `gac -> linalg -> <target stages...>`. The first two are shared
(passes/ and lowering/); each target appends its own (e.g. cpu: `llvm`; cuda: `gpu`, `ptx`;
vortex: `llvm`, `elf`, `vxbin`). A stage is a function artifact -> artifact; the driver records the
text of every stage so `compiled.ir(stage)` and `GAC_DUMP_DIR` can show it.

The `linalg` stage ABI that every target receives (built by lowering/):

    func.func @main(%in0: memref<...>, ..., %out0: memref<...>, ...) attributes {llvm.emit_c_interface}
      %t0 = bufferization.to_tensor %in0 restrict : memref<...> to tensor<...>
      ... linalg / tensor / arith / math on tensors ...
      bufferization.materialize_in_destination %r0 in restrict writable %out0
      return

Inputs and outputs are dense, contiguous (identity layout), statically shaped; outputs are
allocated by the runtime (torch) on the target's device and written in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass
class Stage:
    """One step of a target's pipeline; `name` is also the dump file's extension."""

    name: str
    run: Callable[[Any], Any]


class Executable(Protocol):
    """A loaded program: reads `inputs`, writes `outputs` (both already on the target's device)."""

    def run(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None: ...


@dataclass
class Target:
    """A target is mostly data: its name, where its tensors live, its stages and its loader."""

    name: str
    device_type: str  # torch device type of the tensors the executable reads and writes
    stages: Callable[[dict], list[Stage]]  # options -> stages after "linalg"
    load: Callable[[Any, Signature, dict], Executable]  # last artifact -> executable
    check_available: Callable[[], None] = lambda: None  # raises TargetUnavailable with a fix
    options: dict[str, Any] = field(default_factory=dict)  # target-specific option defaults


class TargetUnavailable(RuntimeError):
    """The target cannot run on this machine (no GPU, no Vortex runtime, ...)."""
