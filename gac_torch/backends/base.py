"""What every target provides: a stage table and a loader.

A compiled graph travels the stages `gac -> linalg -> <target stages...>`. The first two are shared
(passes/ and lowering/); each target appends its own (cpu: `llvm`; cuda: `gpu`, `llvm`, `ptx`;
vortex: `gpu`, `llvm`, `vxbin`). A stage is a named function artifact -> artifact with a declared
kind (an MLIR module, text, bytes); the driver records the text of every stage so
`compiled.ir(stage)` and `GAC_DUMP_DIR` can show it, and a stage that can `parse` its dumped text
back is one a compile can resume from (`gac_torch.compile_stage_file`, `gac-torch compile
fused_0.linalg`).

The `linalg` stage ABI that every target receives (built by lowering/):

    func.func @main(%in0: memref<...>, ..., %out0: memref<...>, ...) attributes {llvm.emit_c_interface}
      %t0 = bufferization.to_tensor %in0 restrict : memref<...> to tensor<...>
      ... linalg / tensor / arith / math on tensors ...
      bufferization.materialize_in_destination %r0 in restrict writable %out0
      return

Inputs and outputs are dense, contiguous (identity layout); outputs are allocated by the runtime
(torch) on the target's device and written in place. A graph with sizes known only at run time
(targets with `dynamic_shapes`) has `?` dims in its memref types, and takes one `index` argument
per size input (a SymInt placeholder), in placeholder order among the inputs; the runtime binds
the sizes from the actual tensors and computes the output shapes (see runtime/compiled.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from gac_torch.errors import MissingDependency


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple  # ints; a sympy expression over size symbols where known only at run time
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"

    @property
    def static(self) -> bool:
        return all(isinstance(s, int) for s in self.shape)


@dataclass(frozen=True)
class SizeSpec:
    """A size passed as a scalar argument (a SymInt graph input): its sympy expression."""

    expr: Any

    def __str__(self) -> str:
        return f"size {self.expr}"


@dataclass(frozen=True)
class Signature:
    inputs: tuple  # TensorSpec | SizeSpec, in argument order
    outputs: tuple[TensorSpec, ...]

    @property
    def dynamic(self) -> bool:
        return any(not isinstance(s, TensorSpec) or not s.static for s in self.inputs + self.outputs)


STAGE_KINDS = ("mlir", "text", "bytes")


@dataclass
class Stage:
    """One step of a target's pipeline; `name` is also the dump file's extension. `kind`: what
    its dump holds (an MLIR module, other text such as PTX or LLVM IR, or bytes). `parse`: its
    dumped text -> the artifact the next stage takes (None: a compile cannot resume here)."""

    name: str
    run: Callable[[Any], Any]
    kind: str = "mlir"
    parse: Callable[[str], Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in STAGE_KINDS:
            raise ValueError(f"stage {self.name}: kind {self.kind!r} is not one of {STAGE_KINDS}")


class Executable(Protocol):
    """A loaded program: reads `inputs`, writes `outputs` (both already on the target's device).

    It may also have the per-call fast paths CompiledGraph prefers (runtime/compiled.py):
    `call(args)` -> the outputs, checking what it relies on as it reads the arguments, or None
    to decline; `call_guarded(args)`, the same for arguments whose dtypes, shapes, dense strides
    and device torch's guards hold (only pointers read). cuda has both."""

    def run(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None: ...


@dataclass
class Target:
    """A target is mostly data: its name, where its tensors live, its stages and its loader."""

    name: str
    device_type: str  # torch device type of the tensors the executable reads and writes
    stages: Callable[[dict], list[Stage]]  # options -> stages after "linalg"
    load: Callable[[Any, Signature, dict], Executable]  # last artifact -> executable
    check_available: Callable[[], None] = lambda: None  # raises TargetUnavailable with a fix
    dynamic_shapes: bool = False  # compiles graphs with run-time sizes (else: one per shape)
    channels_last: bool = False  # 2-D convs on NHWC activations (passes/channels_last.py) by default
    # The on-disk cache and saved artifacts (runtime/cache.py): `pack(artifact, options,
    # required)` turns the last artifact into plain data (JSON-able meta, named blobs), or None
    # when not worth caching (never when `required`); `unpack` that data into an executable
    # without MLIR; `cache_key` names what else decides the code (e.g. cuda's arch).
    pack: Callable[..., tuple[dict, dict[str, bytes]] | None] | None = None
    unpack: Callable[[dict, dict[str, bytes], Signature, dict], Executable] | None = None
    cache_key: Callable[[dict], dict] = lambda options: {}
    # options["autotune"]: tune(build, signature, options) measures the variants `build()`
    # compiles and records the fastest tiles (backends/gpu/tuning.py); None: nothing to tune
    tune: Callable[[Callable[[], Executable], Signature, dict], None] | None = None
    # Python modules compiling for this target needs, and the extra that installs them.
    requires: tuple[str, ...] = ()
    extra: str = ""

    def check_requirements(self) -> None:
        """Raises MissingDependency naming the extra, rather than every partition falling back."""
        import importlib.util

        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            raise MissingDependency(f"target {self.name} needs {', '.join(missing)}: "
                                    f"pip install 'gac-torch[{self.extra}]'")


def stages_only(target: Target) -> Target:
    """The target's compiler without its device: "loading" hands back the last stage's artifact
    (e.g. the GpuProgram), so PTX can be produced and inspected on a machine without a GPU."""
    return dataclasses.replace(target, load=lambda artifact, signature, options: artifact,
                               check_available=lambda: None, pack=None, unpack=None)

