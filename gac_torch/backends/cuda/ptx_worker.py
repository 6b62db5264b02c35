"""One CUDA kernel's module text -> (its NVVM/LLVM-dialect text, its PTX, its cubin or None).
The kernel arrives as the "gpu" stage printed it and is first prepared for ptxas here
(kernel_prep.py: launch-bound attributes, ABI rewrites), so the parent prints each kernel once.

The work of the "llvm" and "ptx" stages for one kernel (kernel_jobs.py splits a program's
`gpu.module` into one module per distinct kernel), and, given a ptxas, the PTX assembled into
SASS ahead of time (else the driver JIT-compiles every kernel at the first call: BEVFormer-tiny,
572 kernels, 12.8 s). Run in-process, or as a worker process:

    python ptx_worker.py      # jobs on stdin, results on stdout: u64 length | JSON, each

It imports only the MLIR bindings and kernel_prep.py (no torch, no gac_torch), so a worker starts
in a fraction of a second; each job gets a fresh single-threaded MLIR context (the pool is the parallelism).
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
import tempfile
import traceback

from mlir import ir, passmanager
from mlir.dialects import gpu

if __package__:
    from gac_torch.backends.cuda import kernel_prep
    from gac_torch.backends.gpu.fold_worker import read_message, write_message
else:  # a worker process (run as a script): its folder is on sys.path, gac_torch is not imported
    import kernel_prep

    _framing = kernel_prep.sibling("fold_worker")  # (the jobs' framing, shared with the fold pool)
    read_message, write_message = _framing.read_message, _framing.write_message


def compile_kernel(text: str | bytes, lower: str, binary: str, ptxas: str | None = None,
                   prep: kernel_prep.Prep | None = None) -> tuple[str, str, bytes | None, str]:
    """Parses `text` (a module holding one gpu.module; or its bytecode), prepares its kernel (kernel_prep.py,
    given `prep`), runs the `lower` pipeline (its text is the "llvm" stage), then `binary`
    (gpu-module-to-binary{format=isa}); returns both texts and,
    with a `ptxas`, the cubin and ptxas's complaint (cubin None where ptxas rejects the PTX,
    e.g. an older ptxas: the driver JIT then takes the PTX)."""
    ctx = ir.Context()
    ctx.enable_multithreading(False)
    module = ir.Module.parse(text, ctx)
    if prep is not None:
        kernel_prep.prepare_module(module, prep)
    with ctx:
        passmanager.PassManager.parse(f"builtin.module({lower})", ctx).run(module.operation)
        llvm = str(module)
        passmanager.PassManager.parse(f"builtin.module({binary})", ctx).run(module.operation)
        binaries = [op for op in module.body.operations if op.operation.name == "gpu.binary"]
        ptx = gpu.ObjectAttr(binaries[0].attributes["objects"][0]).object.decode()
    cubin, error = assemble(ptx, ptxas) if ptxas else (None, "")
    return llvm, ptx, cubin, error


def print_kernels(datas: list[bytes]) -> list[str]:
    """The gpu.func of each kernel module (MLIR bytecode, kernel_jobs.split_bytecode) printed with
    local scope: the kernels' part of the "gpu" stage's text (kernel_jobs.print_kernels)."""
    ctx = ir.Context()
    ctx.enable_multithreading(False)
    out = []
    for data in datas:
        module = ir.Module.parse(data, ctx)
        gm = next(op.operation for op in module.body.operations if op.operation.name == "gpu.module")
        f = next(op.operation for op in gm.regions[0].blocks[0].operations if op.operation.name == "gpu.func")
        out.append(f.get_asm(use_local_scope=True))
    return out


def assemble_named(ptx: str, ptxas: str, names: list[str], placeholder: str) -> dict[str, list]:
    """Per name: [cubin or None, ptxas's complaint] of the PTX with `placeholder` renamed to it
    (what the cuda pipeline loads: one cubin per kernel name; kernel_jobs.py). ptxas runs once
    per name length: a cubin holds its kernel's name only as strings (symbol, section and
    parameter names), so another name of the same length gives the same bytes with the name
    replaced (equal to ptxas's own for all 347 such kernels of BEVFormer-tiny; tests/test_cuda_cubin.py)."""
    out: dict[str, list] = {}
    first: dict[int, str] = {}  # name length -> the name ptxas assembled
    for name in names:
        done = first.setdefault(len(name), name)
        if done == name:
            out[name] = list(assemble(ptx.replace(placeholder, name), ptxas))
        else:
            data, why = out[done]
            out[name] = [data.replace(done.encode(), name.encode()) if data is not None else None, why]
    return out


_TARGET = re.compile(r"^\.target\s+(sm_\w+)", re.MULTILINE)


def ptx_arch(ptx: str) -> str | None:
    """The arch the PTX names (`.target sm_90a`): what its cubin must be assembled for."""
    m = _TARGET.search(ptx)
    return m.group(1) if m else None


def assemble(ptx: str, ptxas: str) -> tuple[bytes | None, str]:
    """`ptxas -arch=<the PTX's target>` (-O3 by default, as the driver's JIT): (cubin, "") or
    (None, why)."""
    arch = ptx_arch(ptx)
    if arch is None:
        return None, "PTX without .target"
    with tempfile.TemporaryDirectory(prefix="gac-ptxas-") as d:
        src, out = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, f"-arch={arch}", "-o", out, src], capture_output=True, text=True)
        if proc.returncode != 0:
            return None, f"ptxas -arch={arch}: {proc.stderr.strip()[:500]}"
        with open(out, "rb") as f:
            return f.read(), ""


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but results on the pipe
    while (job := read_message(stdin)) is not None:
        try:
            if "print" in job:
                write_message(stdout, {"texts": print_kernels([base64.b64decode(d) for d in job["print"]])})
                continue
            names = job.get("names")
            text = job["text"] if "text" in job else base64.b64decode(job["bytecode"])
            llvm, ptx, cubin, why = compile_kernel(text, job["lower"], job["binary"],
                                                   None if names else job.get("ptxas"), job.get("prep"))
            named = assemble_named(ptx, job["ptxas"], names, job["placeholder"]) if names else None
            write_message(stdout, {"llvm": llvm, "ptx": ptx, "ptxas_error": why,
                                   "cubin": base64.b64encode(cubin).decode() if cubin else None,
                                   "named": {n: [base64.b64encode(c).decode() if c else None, w]
                                             for n, (c, w) in named.items()} if named else None})
        except Exception as e:  # noqa: BLE001  (reported to the parent, which raises it)
            write_message(stdout, {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(),
                                   "unsupported": type(e).__name__ == "I1Unsupported"})


if __name__ == "__main__":
    main()
