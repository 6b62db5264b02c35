"""Vortex RISC-V GPU target. Upper half: `TARGET` (backend.py: linalg -> gpu -> llvm -> vxbin,
run through runtime.py; `last_counters(compiled)` gives the last call's instructions/cycles).
Lower half: C / LLVM IR -> .vxbin (toolchain), a functional simulator (funcsim) and one device
API over it and the real SimX runtime (bridge).

Exports resolve lazily so importing the package needs neither ziglang nor pyelftools."""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "build": "toolchain", "KernelSpec": "toolchain", "Program": "toolchain",
    "ToolchainError": "toolchain", "compile_object": "toolchain",
    "elf_to_vxbin": "vxbin", "read_vxbin": "vxbin",
    "FunctionalSimulator": "funcsim", "SimError": "funcsim", "disassemble": "funcsim",
    "FunctionalDevice": "bridge", "SimxDevice": "bridge", "DeviceBuffer": "bridge",
    "VortexDevice": "bridge", "SimxError": "bridge", "simx_available": "bridge",
    "VortexConfig": "target", "DEFAULT_CONFIG": "target", "HELPERS": "target",
    "pack_args": "target", "arg_offsets": "target",
    "TARGET": "backend", "compile_flags": "backend", "last_counters": "runtime",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
