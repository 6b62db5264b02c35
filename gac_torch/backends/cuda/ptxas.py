"""Assemble PTX with ptxas: to validate it without a GPU (CI has none), and to ship cubins.

ptxas comes from the `nvidia-cuda-nvcc-cu12` wheel (dev extra), $CUDA_HOME/bin or PATH.
`for_cubins()` is the ptxas that compiles kernels to SASS ahead of time (kernel_jobs.py), by
default where a GPU is visible (GAC_CUBIN=1: always, GAC_CUBIN=0: never); without one programs
carry PTX only and the driver JIT-compiles it at the first call.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
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


@dataclass(frozen=True)
class Assembler:
    exe: str
    version: str  # "12.9.86": part of every cubin's cache key


@functools.lru_cache(maxsize=1)
def _version(exe: str) -> str | None:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else None


def for_cubins() -> Assembler | None:
    """The ptxas that assembles kernels ahead of time, or None (PTX only): GAC_CUBIN=0; no GPU
    visible and no GAC_CUBIN=1 (nothing would load the cubins: offline compiles, CI, stay as
    quick as before); no ptxas found, or one whose version it does not tell."""
    setting = os.environ.get("GAC_CUBIN", "").strip().lower()
    if setting in ("0", "false", "off", "no"):
        return None
    if not setting:
        import torch

        if not torch.cuda.is_available():
            return None
    exe = find_ptxas()
    version = _version(exe) if exe else None
    return Assembler(exe, version) if exe and version else None


def cubin_key() -> str | None:
    """What a cached partition's cubins depend on besides the arch: the ptxas version."""
    a = for_cubins()
    return a.version if a else None


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
