"""Assemble PTX with ptxas to validate it without a GPU (CI has none).

ptxas comes from the `nvidia-cuda-nvcc-cu12` wheel (dev extra), $CUDA_HOME/bin or PATH.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PtxasResult:
    ok: bool
    arch: str
    log: str  # ptxas's verbose output: registers, shared memory, spills per kernel


def find_ptxas() -> str | None:
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) / "cuda_nvcc" for p in (spec.submodule_search_locations or [])] if spec else []
    roots += [Path(os.environ[k]) for k in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(k)]
    for root in roots:
        exe = root / "bin" / "ptxas"
        if exe.is_file() and os.access(exe, os.X_OK):
            return str(exe)
    return shutil.which("ptxas")


def assemble(ptx: str, arch: str, ptxas: str | None = None) -> PtxasResult:
    """Run `ptxas -arch=<arch> -v` on `ptx`; ok is False (with the error log) if it rejects it."""
    exe = ptxas or find_ptxas()
    if exe is None:
        raise FileNotFoundError("ptxas not found: pip install nvidia-cuda-nvcc-cu12")
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "k.ptx", Path(d) / "k.cubin"
        src.write_text(ptx)
        proc = subprocess.run([exe, f"-arch={arch}", "-v", "-o", str(out), str(src)],
                              capture_output=True, text=True)
    return PtxasResult(proc.returncode == 0, arch, proc.stdout + proc.stderr)
