"""A kernel template's text -> the template parsed and folded (`canonicalize, cse`), as MLIR
bytecode: the work strategy._parse does per distinct template, done in a worker process
(fold_pool.py) while the scheduler goes on with the next ops. Run as a script:

    python fold_worker.py      # jobs on stdin, results on stdout: u64 length | JSON, each

It imports only the MLIR bindings (no torch, no gac_torch), so a worker starts in a fraction of
a second; one single-threaded MLIR context serves all its jobs.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import sys
import traceback

from mlir import ir, passmanager

FOLD = "builtin.module(canonicalize, cse)"  # (strategy._parse's pipeline: keep them the same)


def fold(text: str, ctx: ir.Context) -> bytes:
    module = ir.Module.parse(text, ctx)
    passmanager.PassManager.parse(FOLD, ctx).run(module.operation)
    buf = io.BytesIO()
    module.operation.write_bytecode(buf)
    return buf.getvalue()


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
    ctx = ir.Context()
    ctx.enable_multithreading(False)
    while (job := read_message(stdin)) is not None:
        if job.get("exit"):  # (tests: a worker that dies mid-compile)
            sys.exit(int(job["exit"]))
        try:
            write_message(stdout, {"bytecode": base64.b64encode(fold(job["text"], ctx)).decode()})
        except Exception as e:  # noqa: BLE001  (reported to the parent, which raises it)
            write_message(stdout, {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})


if __name__ == "__main__":
    main()
