"""One CUDA kernel's module text -> (its NVVM/LLVM-dialect text, its PTX).

The work of the "llvm" and "ptx" stages for one kernel (kernel_jobs.py splits a program's
`gpu.module` into one module per distinct kernel). Run in-process, or as a worker process:

    python ptx_worker.py      # jobs on stdin, results on stdout: u64 length | JSON, each

It imports only the MLIR bindings (no torch, no gac_torch), so a worker starts in a fraction of a
second; each job gets a fresh single-threaded MLIR context (the pool is the parallelism).
"""

from __future__ import annotations

import json
import struct
import sys
import traceback

from mlir import ir, passmanager
from mlir.dialects import gpu


def compile_kernel(text: str, lower: str, binary: str) -> tuple[str, str]:
    """Parses `text` (a module holding one gpu.module), runs the `lower` pipeline (its text is
    the "llvm" stage), then `binary` (gpu-module-to-binary{format=isa}); returns both texts."""
    ctx = ir.Context()
    ctx.enable_multithreading(False)
    module = ir.Module.parse(text, ctx)
    with ctx:
        passmanager.PassManager.parse(f"builtin.module({lower})", ctx).run(module.operation)
        llvm = str(module)
        passmanager.PassManager.parse(f"builtin.module({binary})", ctx).run(module.operation)
        binaries = [op for op in module.body.operations if op.operation.name == "gpu.binary"]
        ptx = gpu.ObjectAttr(binaries[0].attributes["objects"][0]).object.decode()
    return llvm, ptx


def read_message(stream) -> dict | None:
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    return json.loads(stream.read(n))


def write_message(stream, message: dict) -> None:
    data = json.dumps(message).encode()
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but results on the pipe
    while (job := read_message(stdin)) is not None:
        try:
            llvm, ptx = compile_kernel(job["text"], job["lower"], job["binary"])
            write_message(stdout, {"llvm": llvm, "ptx": ptx})
        except Exception as e:  # noqa: BLE001  (reported to the parent, which raises it)
            write_message(stdout, {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})


if __name__ == "__main__":
    main()
