"""The "llvm" and "ptx" stages kernel by kernel: each distinct kernel compiled once, in parallel.

Lowering a whole model's `gpu.module` to NVVM and then to PTX is one long serial MLIR/LLVM job
(BEVFormer-tiny: ~80 s of a 2-core machine's 160 s cold compile). Kernels are independent, so:
  1. split: one module per kernel (MLIR bytecode: split_bytecode), its name replaced by a
     placeholder, so that kernels that differ only in name (ResNet's repeated blocks) have the
     same bytes; each worker prepares its kernel for ptxas itself (kernel_prep.py), so writing
     it is all the parent does per kernel, and other workers print the distinct kernels for the
     "gpu" stage's text (print_kernels) meanwhile;
  2. dedupe: compile each distinct module (and prep) once (its sha256 is its address); the on-disk cache
     (runtime/cache.py, `GAC_CACHE`) keeps each kernel's result, so a later compile that shares
     kernels (another model, an edited graph) skips them too;
  3. compile the rest in a pool of worker processes (ptx_worker.py; MLIR holds the GIL, so
     threads would not run in parallel), `GAC_COMPILE_WORKERS` of them (default: the CPUs this
     process may use), largest first;
  4. join: one PTX module with every kernel (renamed back), module-level declarations once.
Given a ptxas, each worker can also assemble its kernel's PTX into a cubin (the kernel still
named PLACEHOLDER), or (`per_name`, what the cuda pipeline asks for: profilers and the autotuner
tell kernels by name) one cubin per kernel sharing the text, under its own name, right after its
PTX (once per name length: ptx_worker.assemble_named): ptxas then runs in the pool beside the
other kernels' LLVM, not after it.
A module that cannot be split (unexpected attributes, a name clash in the join) is compiled
whole, as before, to PTX only.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mlir import ir, passmanager

from gac_torch.backends.cuda import ptx_worker
from gac_torch.backends.cuda.ptxas import Assembler
from gac_torch.errors import CompileError, GacError, GacUnsupportedError

log = logging.getLogger("gac_torch")

PLACEHOLDER = "__gac_kernel__"  # a kernel's name while compiled: no PTX token contains it
KEY_FORMAT = 1
# a worker takes ~0.3 s of CPU to start: a program with less than this much kernel text (a few
# large kernels) compiles in-process
MIN_POOL_BYTES = 1_000_000
# a program of this many kernels starts its workers before it splits its module (started_workers)
PRESTART_KERNELS = 64
BYTECODE_DENSITY = 5  # about as many bytes of kernel text as one of its MLIR bytecode
PRINTERS = 2  # worker processes printing the kernels for the "gpu" stage's text (print_kernels)


@dataclass
class KernelResult:
    names: list[str]  # the kernels sharing this text (first: the one shown in the llvm stage)
    llvm: str  # the lowered module, placeholder name
    ptx: str  # placeholder name
    cubin: bytes | None = None  # its SASS (kernel named PLACEHOLDER); None: PTX only
    named: dict[str, tuple[bytes | None, str]] | None = None  # per_name: per kernel name, its
    # cubin (None: ptxas's complaint); None where not assembled in the pool (pipeline.cubins does)
    cut: tuple | None = field(default=None, repr=False, compare=False)  # (_cut: its PTX's items)

    def renamed(self, field: str, name: str) -> str:
        return getattr(self, field).replace(PLACEHOLDER, name)


class NotSplittable(GacError):
    """The module is compiled whole instead (the reason is logged at DEBUG)."""


# -- 1. split ---------------------------------------------------------------------------------

@dataclass
class Layout:
    """A split module's text without its kernels' (text_of puts them in): the other top-level
    ops printed (None: the gpu.module), and the gpu.module's ops in order, shared ops printed,
    kernels by name."""

    tops: list[str | None]
    name: str  # the gpu.module's
    body: list[tuple[bool, str]]  # (a kernel?, its name or the op's text)

    def text_of(self, kernels: dict[str, str]) -> str:
        """The module's text given each kernel's (its local-scope print)."""
        gm = "gpu.module @%s {\n%s\n}" % (self.name, "\n".join(kernels[x] if k else x for k, x in self.body))
        return "module attributes {gpu.container_module} {\n%s\n}\n" % "\n".join(
            gm if t is None else t for t in self.tops)


def layout(module: ir.Module, kernel_names: list[str]) -> tuple[Layout, dict[str, ir.Operation]]:
    """(the module's Layout, its kernels by name); raises NotSplittable."""
    if set(module.operation.attributes) - {"gpu.container_module"}:
        raise NotSplittable("module attributes")
    gpu_modules = [op.operation for op in module.body.operations if op.operation.name == "gpu.module"]
    if len(gpu_modules) != 1 or set(gpu_modules[0].attributes) != {"sym_name"}:
        raise NotSplittable("not one plain gpu.module")
    gm = gpu_modules[0]
    wanted, kernels, body = set(kernel_names), {}, []
    for op in gm.regions[0].blocks[0].operations:
        op = op.operation
        sym = ir.StringAttr(op.attributes["sym_name"]).value if "sym_name" in op.attributes else None
        if sym in wanted:
            kernels[sym] = op
            body.append((True, sym))
        else:
            body.append((False, op.get_asm(use_local_scope=True)))
    if set(kernels) != wanted:
        raise NotSplittable("kernels missing from the gpu.module")
    tops = [None if op.operation == gm else op.operation.get_asm(use_local_scope=True)
            for op in module.body.operations]
    return Layout(tops, ir.StringAttr(gm.attributes["sym_name"]).value, body), kernels


def kernel_text(f: ir.Operation, name: str) -> str:
    """A kernel's local-scope print (each print would else name the whole module), as `name`."""
    text = f.get_asm(use_local_scope=True)
    head = f"gpu.func @{ir.StringAttr(f.attributes['sym_name']).value}("
    if not text.startswith(head):
        raise NotSplittable(f"kernel {name} prints as {text[:40]!r}")
    return f"gpu.func @{name}(" + text[len(head):]


def split_bytecode(module: ir.Module, kernel_names: list[str]) -> tuple[dict[str, bytes], Layout]:
    """(per kernel name, a module holding just that kernel (as PLACEHOLDER) and the gpu.module's
    other ops, as MLIR bytecode; the module's Layout). Bytecode is written ~5x faster than text
    is printed (BEVFormer-tiny's kernels: ~2 s of printing); print_kernels prints them. Debug
    locations are dropped first (they would tell repeated kernels apart; the text shows none).
    The kernels move out of `module`, which is left for the caller to drop."""
    shape, kernels = layout(module, kernel_names)
    passmanager.PassManager.parse("builtin.module(strip-debuginfo)", module.context).run(module.operation)
    shared = "".join(x + "\n" for k, x in shape.body if not k)
    carrier = ir.Module.parse("module attributes {gpu.container_module} {\n  gpu.module @%s {\n%s  }\n}\n"
                              % (shape.name, shared), module.context)
    at = ir.InsertionPoint(next(op.operation for op in carrier.body.operations).regions[0].blocks[0])
    placeholder = ir.StringAttr.get(PLACEHOLDER, module.context)
    out = {}
    for sym in kernel_names:  # each in turn the carrier's one kernel, written, then dropped
        f = kernels[sym]
        f.detach_from_parent()
        at.insert(f)
        f.attributes["sym_name"] = placeholder
        out[sym] = _bytecode(carrier)
        f.detach_from_parent()
    return out, shape


def _bytecode(module: ir.Module) -> bytes:
    buf = io.BytesIO()
    module.operation.write_bytecode(buf)
    return buf.getvalue()


# -- 2. dedupe + cache ------------------------------------------------------------------------

def job_key(text: str | bytes, lower: str, binary: str, ptxas: Assembler | None = None,
            prep: dict | None = None) -> str:
    from gac_torch.runtime.cache import versions

    raw = text if isinstance(text, bytes) else text.encode()
    data = {"format": KEY_FORMAT, "kind": "cuda-kernel", "text": hashlib.sha256(raw).hexdigest(),
            "lower": lower, "binary": binary, "ptxas": ptxas.version if ptxas else None,
            "prep": prep, "versions": versions()}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def compile_kernels(texts: dict[str, str] | dict[str, bytes], lower: str, binary: str, use_cache: bool,
                    on_progress=None, ptxas: Assembler | None = None, per_name: bool = False,
                    meanwhile=None, preps: dict[str, dict] | None = None) -> list[KernelResult]:
    """Every kernel of `texts` compiled (each distinct text once, prepared first by the worker
    when `preps` names how: kernel_prep.py, each distinct (text, prep) once; with `ptxas`, to a cubin
    too, or with `per_name` to one per kernel name where the pool compiles it: KernelResult.named,
    not kept in this cache); in the kernels' order. `meanwhile()` runs in the calling thread
    once the workers have their jobs (run_jobs)."""
    from gac_torch.runtime import cache

    by_key: dict[str, KernelResult] = {}
    todo: dict[str, str | bytes] = {}  # key -> text
    prep_of: dict[str, dict | None] = {}  # key -> prep
    for name, text in texts.items():
        prep = preps.get(name) if preps else None
        key = job_key(text, lower, binary, None if per_name else ptxas, prep)
        if key in by_key:
            by_key[key].names.append(name)
            continue
        entry = cache.load(key, quiet=True) if use_cache else None
        if entry is not None and "ptx" in entry.meta and "llvm" in entry.stages:
            by_key[key] = KernelResult([name], entry.stages["llvm"], entry.meta["ptx"], entry.blobs.get("cubin"))
        else:
            by_key[key] = KernelResult([name], "", "")
            todo[key], prep_of[key] = text, prep
    log.debug("gac cuda: %d kernels, %d distinct, %d to compile", len(texts), len(by_key), len(todo))
    order = sorted(todo, key=lambda k: -len(todo[k]))  # largest first: the pool ends together
    exe = ptxas.exe if ptxas else None
    names = [by_key[k].names for k in order] if per_name and exe else None
    rejected = {}  # (then the program loads as PTX: the driver's JIT may know a newer ISA)
    handled: set[int] = set()

    def finished(j: int, result: tuple) -> None:
        """Kernel j's result, taken while the pool still compiles the others: kept in the cache,
        its PTX cut into items for join_ptx."""
        handled.add(j)
        key, r = order[j], by_key[order[j]]
        r.llvm, r.ptx, r.cubin, why, r.named = result
        if why:
            rejected[j] = f"{r.names[0]}: {why}"
        if use_cache:  # (written behind the compile: cache.store_later)
            cache.store_later(key, cache.Entry({"ptx": r.ptx}, {"cubin": r.cubin} if r.cubin else {},
                                               {"llvm": r.llvm}), quiet=True)
        try:
            _cut(r)
        except NotSplittable:  # (join_ptx raises it)
            pass

    results = run_jobs([todo[k] for k in order], lower, binary, on_progress, exe, names, finished,
                       meanwhile=meanwhile, preps=[prep_of[k] for k in order] if preps else None)
    for j, result in enumerate(results):
        if j not in handled:
            finished(j, result)
    if rejected:
        first = rejected[min(rejected)]
        log.info("gac cuda: %d kernels without a cubin, the program loads as PTX (%s)", len(rejected), first)
    if use_cache and todo:
        cache.evict_later()  # once for the batch
    return list(by_key.values())


# -- 3. the pool ------------------------------------------------------------------------------

def worker_count() -> int:
    given = os.environ.get("GAC_COMPILE_WORKERS", "").strip()
    if given:
        if not given.isdigit():
            raise ValueError(f"GAC_COMPILE_WORKERS={given!r}: expected a number of processes (1: in-process)")
        return max(1, int(given))
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


_no_pool: list[bool] = []  # set once a worker process could not start: in-process from then on
_spare: list[subprocess.Popen] = []  # workers started ahead (started_workers): run_jobs takes them


def _worker() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(Path(ptx_worker.__file__))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _end(proc: subprocess.Popen) -> None:
    proc.stdin.close()  # (the worker's loop ends; closing twice is harmless)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    proc.stdout.close()


@contextlib.contextmanager
def started_workers(kernels: int):
    """The pool's workers (and print_kernels') start (each a Python interpreter importing the MLIR
    bindings, ~0.3 s) while the caller prepares and splits a program of `kernels` kernels, so
    run_jobs finds them ready; those it did not take are ended on exit. A small program starts none (it may
    well compile in-process: MIN_POOL_BYTES)."""
    n = 0 if _no_pool or kernels < PRESTART_KERNELS else min(worker_count(), kernels)
    try:
        for _ in range(n + PRINTERS if n > 1 else 0):  # (+ the "gpu" stage's printers: print_kernels)
            _spare.append(_worker())
    except OSError:
        pass  # (run_jobs finds out and says so)
    try:
        yield
    finally:
        left = []  # (e.g. every kernel was in the cache): told to end, reaped off this thread
        while (proc := _take_spare()) is not None:
            proc.stdin.close()
            left.append(proc)
        if left:
            threading.Thread(target=lambda: [_end(p) for p in left], daemon=True).start()


def _take_spare() -> subprocess.Popen | None:
    try:
        return _spare.pop()
    except IndexError:  # (none, or another thread's run_jobs took the last)
        return None


def pooled(texts) -> bool:
    """Is there enough kernel text (or bytecode: ~5x denser) to pay for worker processes?"""
    return sum(len(t) * (BYTECODE_DENSITY if isinstance(t, bytes) else 1) for t in texts) >= MIN_POOL_BYTES


def print_kernels(datas: list[bytes]) -> Callable[[], list[str]]:
    """A function returning each kernel module's (split_bytecode) kernel printed as kernel_text
    does (named PLACEHOLDER): by up to PRINTERS worker processes beside the pool (a whole
    model's kernels: ~2 s of printing), or here, when the pool compiles in-process."""
    if _no_pool or worker_count() <= 1 or not pooled(datas):
        return lambda: ptx_worker.print_kernels(datas)
    order = sorted(range(len(datas)), key=lambda i: -len(datas[i]))
    shares = [order[k::PRINTERS] for k in range(min(PRINTERS, len(datas)))]  # (dealt largest first)
    got: dict[int, str] = {}

    def run(share: list[int]) -> None:
        try:
            proc = _take_spare() or _worker()
        except OSError:
            return
        try:
            ptx_worker.write_message(proc.stdin, {"print": [base64.b64encode(datas[i]).decode() for i in share]})
            reply = ptx_worker.read_message(proc.stdout)
            if reply is not None and "texts" in reply:
                got.update(zip(share, reply["texts"]))
        except (OSError, ValueError) as e:  # (then printed by the caller)
            log.debug("gac cuda: a print worker failed: %s", e)
        finally:
            _end(proc)

    threads = [threading.Thread(target=run, args=(share,), daemon=True) for share in shares]
    for t in threads:
        t.start()

    def wait() -> list[str]:
        for t in threads:
            t.join()
        if len(got) < len(datas):
            return ptx_worker.print_kernels(datas)
        return [got[i] for i in range(len(datas))]

    return wait


def run_jobs(texts: list[str], lower: str, binary: str, on_progress=None, ptxas: str | None = None,
             names: list[list[str]] | None = None, on_result=None, meanwhile=None,
             preps: list[dict | None] | None = None) -> list[tuple[str, str, bytes | None, str, dict | None]]:
    """(llvm, ptx, cubin, ptxas's complaint, named cubins) per text (ptx_worker.compile_kernel):
    in-process for a few, else in min(workers, len) worker processes. `names` (per text, with a
    `ptxas`): the workers assemble the PTX under each name (ptx_worker.assemble_named); in-process
    they do not (named None: pipeline.cubins runs ptxas in threads then). `on_result(i, result)`
    runs in the calling thread as each result arrives (while the workers compile the rest);
    `meanwhile()` once, right after the workers got their jobs (other work of the caller's).
    `preps` (per text): how the worker prepares the kernel first (kernel_prep.py)."""
    n = 1 if _no_pool else min(worker_count(), len(texts))
    results: list = [None] * len(texts)
    if n <= 1 or not pooled(texts):
        if meanwhile:
            meanwhile()
        for i, text in enumerate(texts):
            try:
                results[i] = (*ptx_worker.compile_kernel(text, lower, binary, None if names else ptxas,
                                                         preps[i] if preps else None), None)
            except Exception as e:
                if type(e).__name__ == "I1Unsupported":  # (kernel_prep: what the schedule cannot run)
                    raise GacUnsupportedError(str(e)) from e
                raise CompileError(f"cuda kernel lowering failed: {e}") from e
            if on_result:
                on_result(i, results[i])
            if on_progress:
                on_progress(i + 1, len(texts))
        return results
    jobs: queue.Queue = queue.Queue()
    for i, text in enumerate(texts):
        jobs.put(i)
    errors: list[BaseException] = []
    done = [0]
    arrived: queue.SimpleQueue = queue.SimpleQueue()  # indices of results not yet handed to on_result

    def serve() -> None:
        try:
            proc = _take_spare() or _worker()
        except OSError as e:  # no worker (e.g. an embedded interpreter): in-process, said once
            errors.append(e)
            return
        try:
            while not errors:
                try:
                    i = jobs.get_nowait()
                except queue.Empty:
                    return
                source = ({"bytecode": base64.b64encode(texts[i]).decode()} if isinstance(texts[i], bytes)
                          else {"text": texts[i]})
                ptx_worker.write_message(proc.stdin, {**source, "lower": lower, "binary": binary,
                                                      "ptxas": ptxas, "names": names[i] if names else None,
                                                      "placeholder": PLACEHOLDER,
                                                      "prep": preps[i] if preps else None})
                reply = ptx_worker.read_message(proc.stdout)
                if reply is None:
                    raise CompileError(f"a cuda compile worker exited (code {proc.poll()})")
                if "error" in reply:
                    log.debug("gac cuda worker: %s", reply.get("trace"))
                    if reply.get("unsupported"):
                        raise GacUnsupportedError(reply["error"].split(": ", 1)[-1])
                    raise CompileError(f"cuda kernel lowering failed: {reply['error']}")
                cubin = base64.b64decode(reply["cubin"]) if reply.get("cubin") else None
                named = {n: (base64.b64decode(c) if c else None, w)
                         for n, (c, w) in reply["named"].items()} if reply.get("named") else None
                results[i] = (reply["llvm"], reply["ptx"], cubin, reply.get("ptxas_error", ""), named)
                arrived.put(i)
                done[0] += 1
        except BaseException as e:  # noqa: BLE001  (re-raised in the calling thread)
            errors.append(e)
        finally:
            _end(proc)

    threads = [threading.Thread(target=serve, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    if meanwhile:
        meanwhile()
    shown = -1

    def hand_over() -> None:
        while on_result and not errors and not arrived.empty():
            i = arrived.get()
            on_result(i, results[i])

    while alive := [t for t in threads if t.is_alive()]:
        alive[0].join(0.05 if on_result else 0.25)
        hand_over()
        if on_progress and done[0] != shown:
            shown = done[0]
            on_progress(shown, len(texts))
    hand_over()
    if errors and isinstance(errors[0], OSError):
        log.warning("gac cuda: no compile worker process (%s); compiling kernels in-process", errors[0])
        _no_pool.append(True)
        return run_jobs(texts, lower, binary, on_progress, ptxas, names, on_result, preps=preps)  # (meanwhile: ran)
    if errors:
        raise errors[0]
    return results


# -- 4. join ----------------------------------------------------------------------------------

_LABEL = re.compile(r"\$L__BB\d+_")
_SYMBOL = re.compile(r"^(?:\.\w+(?:\s+\d+)?\s+)*(?:\([^)]*\)\s*)?([A-Za-z_$%][\w$]*)")


def _items(ptx: str) -> tuple[str, list[str]]:
    """(header up to .address_size, the module-level items: declarations and functions, each
    with the comment lines before it)."""
    lines = ptx.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith(".address_size")), None)
    if at is None:
        raise NotSplittable("PTX without .address_size")
    items, cur, depth = [], [], 0
    for line in lines[at + 1:]:
        if not cur and not line.strip():
            continue
        cur.append(line)
        code = line.split("//", 1)[0]
        depth += code.count("{") + code.count("(") - code.count("}") - code.count(")")
        if depth == 0 and code.rstrip().endswith((";", "}")):
            items.append("\n".join(cur))
            cur = []
    if cur and any(line.split("//", 1)[0].strip() for line in cur):
        raise NotSplittable("PTX item without an end")
    return "\n".join(lines[:at + 1]), items


def _code(item: str) -> str:
    """An item without comments, blank lines and its function's block label numbers."""
    return _LABEL.sub("$L__BB_", "\n".join(line.split("//", 1)[0].rstrip() for line in item.splitlines()
                                         if line.split("//", 1)[0].strip()))


def _symbol(item: str) -> str | None:
    for line in item.splitlines():
        code = line.split("//", 1)[0].strip()
        if code:
            m = _SYMBOL.match(code)
            return m.group(1) if m else None
    return None


def _cut(r: KernelResult) -> tuple[str, list[tuple[str, str, str | None]]]:
    """(header, (item, its code, its symbol) per item) of r's PTX, cut once per distinct kernel
    (with its placeholder name; each kernel sharing it renames: the placeholder, an identifier,
    neither moves a cut nor a comment); compile_kernels cuts each as it arrives from the pool."""
    if r.cut is None or r.cut[0] is not r.ptx:
        head, items = _items(r.ptx)
        r.cut = r.ptx, (head, [(item, _code(item), _symbol(item)) for item in items])
    return r.cut[1]


def join_ptx(results: list[KernelResult], order: list[str]) -> str:
    """One PTX module: the header, then every item of every kernel's PTX (in `order`) once.
    A definition (a body or an initializer) seen again is dropped when it differs only in its
    block labels (numbered per function in a module: `$L__BB<function>_<block>`, local to the
    function); two different definitions of one symbol raise NotSplittable."""
    of = {name: r for r in results for name in r.names}
    header, seen, out, owner = None, set(), [], {}
    for name in order:
        r = of[name]
        head = _cut(r)[0].replace(PLACEHOLDER, name)
        if header is None:
            header = head
        elif head != header:
            raise NotSplittable("kernels compiled for different PTX targets")
        for item, code, sym in _cut(r)[1]:
            item, code = item.replace(PLACEHOLDER, name), code.replace(PLACEHOLDER, name)
            if code in seen:
                continue
            sym = sym.replace(PLACEHOLDER, name) if sym is not None else None
            if sym is not None and "{" in code and owner.setdefault(sym, code) != code:
                raise NotSplittable(f"PTX symbol {sym} defined differently by two kernels")
            seen.add(code)
            out.append(item)
    return (header or "") + "\n\n" + "\n\n".join(out) + "\n"


def llvm_text(results: list[KernelResult]) -> str:
    """The "llvm" stage: each distinct kernel's lowered module once, named by its first kernel."""
    parts = []
    for r in results:
        also = f" (also: {', '.join(r.names[1:])})" if len(r.names) > 1 else ""
        parts.append(f"// kernel {r.names[0]}{also}\n{r.renamed('llvm', r.names[0])}")
    return "\n".join(parts)
