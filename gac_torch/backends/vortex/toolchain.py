"""C / LLVM IR -> rv32imf ELF -> .vxbin for Vortex, with PyPI `ziglang` (clang 22, ld.lld).

Pipeline per source (why three steps: see simt_ir.py):
  1. clang -O2 -emit-llvm        C or IR (helpers inlined) -> optimized IR
  2. simt_ir.make_simt_safe      float selects / branchy float intrinsics -> integer selects
  3. clang -O2 -disable-llvm-optzns -c   codegen only, so step 2 is not folded back
then ld.lld with our start-up code, per-kernel entry stubs and linker script, plus zig's
compiler_rt (i64 division, soft double, memcpy...) built once for rv32imf/ilp32f and cached.

Kernel ABI. Every kernel is entered through a stub `__vx_kentry_<name>` (the VXSYMTAB entry);
the stub sets sp from mhartid on *every* CTA (a warp reused by the KMU skips the start-up
prologue, and lanes that were inactive in its first CTA would otherwise have no stack), then:
  * params=None: calls `void name(const void* args)` with a0 = the argument blob;
  * params=("ptr", "i32", "f32", ...): loads each field of the blob (layout: target.arg_offsets)
    into the ilp32f argument registers/stack and calls `void name(ptr, i32, float, ...)`.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from . import simt_ir, target
from .target import CSR, arg_offsets
from .vxbin import elf_to_vxbin, read_vxbin
from gac_torch.errors import CompileError

__all__ = ["KernelSpec", "Program", "ToolchainError", "build", "compile_object", "link",
           "startup_asm", "linker_script", "cache_dir"]

_BASE_FLAGS = [f"--target={target.TRIPLE}", f"-march={target.MARCH}", f"-mabi={target.MABI}",
               "-ffreestanding", "-fno-builtin", "-fno-exceptions", "-fno-unwind-tables",
               "-fno-asynchronous-unwind-tables", "-ffunction-sections", "-fdata-sections",
               "-Wno-override-module"]


class ToolchainError(CompileError):
    pass


@dataclass(frozen=True)
class KernelSpec:
    """A kernel to expose. `params` None: `void name(const void* args_blob)`."""
    name: str
    params: tuple[str, ...] | None = None


@dataclass
class Program:
    vxbin: bytes
    elf: bytes
    kernels: dict[str, int] = field(default_factory=dict)    # name -> entry-stub PC
    specs: dict[str, KernelSpec] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    root = os.environ.get("GAC_CACHE_DIR") or os.path.join(Path.home(), ".cache", "gac_torch")
    d = Path(root) / "vortex"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _zig_dir() -> Path:
    import ziglang  # noqa: PLC0415 (optional dependency: pip install ziglang)
    return Path(ziglang.__file__).parent


def _run(args: Sequence[str], *, stdin: bytes | None = None, what: str) -> bytes:
    try:
        p = subprocess.run([sys.executable, "-m", "ziglang", *args], input=stdin,
                           capture_output=True, check=False)
    except FileNotFoundError as e:  # pragma: no cover
        raise ToolchainError(f"{what}: cannot run ziglang ({e}); pip install ziglang") from e
    if p.returncode != 0:
        err = p.stderr.decode(errors="replace").strip()
        if "No module named ziglang" in err:
            raise ToolchainError("the Vortex toolchain needs PyPI `ziglang`: pip install ziglang")
        raise ToolchainError(f"{what} failed:\n{err}")
    return p.stdout


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def compiler_rt() -> Path:
    """zig's compiler_rt as one rv32imf/ilp32f object (built once, ~10 s, then cached)."""
    ver = _run(["version"], what="zig version").decode().strip()
    path = cache_dir() / f"compiler_rt-{ver}-rv32imf-ilp32f.o"
    if not path.exists():
        with tempfile.TemporaryDirectory() as td:
            out = Path(td) / "crt.o"
            _run(["build-obj", str(_zig_dir() / "lib" / "compiler_rt.zig"),
                  "-target", "riscv32-freestanding-eabihf", "-mcpu=generic_rv32+m+f+zicond",
                  "-OReleaseSmall", "-fno-stack-check", "-ffunction-sections", "-fdata-sections",
                  "-fstrip", f"-femit-bin={out}"], what="building compiler_rt")
            _atomic_write(path, out.read_bytes())
    return path


def header_dir() -> Path:
    """A directory holding `vx_gac.h` (generated from target.HELPERS)."""
    d = cache_dir() / "include"
    d.mkdir(exist_ok=True)
    text = simt_ir.c_header().encode()
    h = d / "vx_gac.h"
    if not h.exists() or h.read_bytes() != text:
        _atomic_write(h, text)
    return d


# ----------------------------------------------------------------------------------------------
def compile_object(source: str, lang: str, *, opt: str = "-O2", cflags: Sequence[str] = (),
                   simt_safe: bool = True, serialize_libm: bool = True) -> tuple[bytes, str]:
    """Compile C (`lang="c"`) or LLVM IR text (`lang="ir"`) to an ELF object.

    Returns (object bytes, the IR that was code-generated) — the IR is handy for dumps."""
    if lang == "ir":
        try:
            source = simt_ir.inline_helpers(source)
        except ValueError as e:
            raise ToolchainError(str(e)) from e
        inputs = ["-x", "ir", "-"]
    elif lang == "c":
        inputs = ["-x", "c", "-std=gnu11", "-fconvergent-functions", "-nostdlibinc",
                  "-isystem", str(_zig_dir() / "lib" / "include"), "-I", str(header_dir()), "-"]
    else:
        raise ValueError(f"lang must be 'c' or 'ir', not {lang!r}")
    ir = _run(["clang", *_BASE_FLAGS, opt, *cflags, "-S", "-emit-llvm", "-o", "-", *inputs],
              stdin=source.encode(), what=f"compiling {lang} to LLVM IR").decode()
    if simt_safe:
        ir = simt_ir.make_simt_safe(ir, serialize_libm=serialize_libm)
    obj = _run(["clang", *_BASE_FLAGS, opt, "-Xclang", "-disable-llvm-optzns", "-c", "-o", "-",
                "-x", "ir", "-"], stdin=ir.encode(), what="code generation")
    return obj, ir


def device_runtime() -> bytes:
    """Object with the lane-serialising libm wrappers (simt_ir.device_runtime_c), cached."""
    src = simt_ir.device_runtime_c()
    key = hashlib.sha256((src + _version_tag()).encode()).hexdigest()[:24]
    path = cache_dir() / f"device_rt-{key}.o"
    if not path.exists():
        _atomic_write(path, compile_object(src, "c", serialize_libm=False)[0])
    return path.read_bytes()


def assemble(asm: str) -> bytes:
    return _run(["clang", *_BASE_FLAGS, "-c", "-o", "-", "-x", "assembler", "-"],
                stdin=asm.encode(), what="assembling start-up code")


# ----------------------------------------------------------------------------------------------
def startup_asm(kernels: Sequence[KernelSpec]) -> str:
    """Start-up (at STARTUP_ADDR) + one entry stub per kernel.

    The 5 instructions from `__vx_dispatch` to `tmc x0` are the KMU's dispatch window: a warp
    reused for the next CTA restarts at (its PC after `tmc x0`) - 20, i.e. at `__vx_dispatch`."""
    insn = target.vx_insn
    sp_from_hart = [f"csrr t0, {CSR['mhartid']:#x}", f"slli t0, t0, {target.STACK_LOG2_SIZE}",
                    f"li t2, {target.STACK_BASE_ADDR:#x}", "sub sp, t2, t0"]
    lines = ['.section .vx_start, "ax"', ".option norvc", ".option norelax",
             ".globl __vx_cta_entry", ".type __vx_cta_entry, @function", "__vx_cta_entry:",
             *sp_from_hart,
             "__vx_dispatch:",
             f"csrr s11, {CSR['cta_entry']:#x}",
             f"csrr a0, {CSR['mscratch']:#x}",
             "jalr ra, 0(s11)",
             "__vx_kernel_return:",
             insn(7),              # wsync
             insn(0),              # tmc x0: retire the warp
             '.section .vx_entry, "ax"']
    for k in kernels:
        if not re.fullmatch(r"[A-Za-z_][\w.$]*", k.name):
            raise ToolchainError(f"bad kernel name {k.name!r}")
        lines += [f".globl __vx_kentry_{k.name}", f".type __vx_kentry_{k.name}, @function",
                  f"__vx_kentry_{k.name}:", *sp_from_hart]
        if k.params is None:
            lines.append(f"tail {k.name}")
        else:
            lines += _unpack_args(k.params)
            lines += [f"call {k.name}", "j __vx_kernel_return"]
    return "\n".join("    " + ln if not ln.endswith(":") else ln for ln in lines) + "\n"


def _unpack_args(params: Sequence[str]) -> list[str]:
    """Load blob fields (a0) into ilp32f argument registers; overflow goes to the stack."""
    offs, _size = arg_offsets(params)
    regs: list[str] = []
    stack: list[tuple[int, int]] = []   # (blob offset, stack offset) of 4-byte words
    n_int = n_fp = sp_off = 0
    for kind, off in zip(params, offs):
        if kind == "f32" and n_fp < 8:
            regs.append(f"flw fa{n_fp}, {off}(t1)")
            n_fp += 1
            continue
        words = 2 if kind == "i64" else 1      # "ptr" is a u64 field but an rv32 pointer
        for w in range(words):
            if n_int < 8:
                regs.append(f"lw a{n_int}, {off + 4 * w}(t1)")
                n_int += 1
            else:
                if kind == "i64" and w == 0 and sp_off % 8:
                    sp_off += 4
                stack.append((off + 4 * w, sp_off))
                sp_off += 4
    frame = (sp_off + 15) & ~15
    out = ["mv t1, a0"]
    if frame:
        out.append(f"addi sp, sp, -{frame}")
        for boff, soff in stack:
            out += [f"lw t2, {boff}(t1)", f"sw t2, {soff}(sp)"]
    return out + regs


def linker_script() -> str:
    return f"""OUTPUT_ARCH(riscv)
ENTRY(__vx_cta_entry)
SECTIONS
{{
  . = {target.STARTUP_ADDR:#x};
  .text : {{ KEEP(*(.vx_start)) KEEP(*(.vx_entry)) *(.text .text.*) }}
  .rodata : ALIGN(16) {{ *(.rodata .rodata.* .srodata .srodata.*) }}
  .data : ALIGN(64) {{ *(.data .data.* .sdata .sdata.*) }}
  . = ALIGN(64);
  _edata = .;
  .bss (NOLOAD) : {{ *(.bss .bss.* .sbss .sbss.* COMMON) }}
  . = ALIGN(64);
  _end = .;
  /DISCARD/ : {{ *(.comment) *(.note .note.*) *(.eh_frame*) *(.riscv.attributes) }}
}}
"""


def link(objects: Iterable[bytes]) -> bytes:
    with tempfile.TemporaryDirectory() as td:
        paths = []
        for i, obj in enumerate(objects):
            p = Path(td) / f"in{i}.o"
            p.write_bytes(obj)
            paths.append(str(p))
        (Path(td) / "link.ld").write_text(linker_script())
        out = Path(td) / "out.elf"
        try:
            _run(["ld.lld", "-m", "elf32lriscv", "-T", str(Path(td) / "link.ld"), "--gc-sections",
                  "--no-relax", "-o", str(out), *paths, str(compiler_rt())], what="linking")
        except ToolchainError as e:
            if "undefined symbol" in str(e):
                raise ToolchainError(f"{e}\nThere is no libc/libm on the device: only compiler_rt "
                                     "(integer/soft-double helpers, memcpy/memset) and the vx_* "
                                     "helpers (target.HELPERS) are available; expand math ops "
                                     "(e.g. MLIR math-polynomial-approximation) before lowering.") from e
            raise
        return out.read_bytes()


# ----------------------------------------------------------------------------------------------
def build(*, c: Sequence[str] = (), ir: Sequence[str] = (),
          kernels: Sequence[str | KernelSpec], opt: str = "-O2", cflags: Sequence[str] = (),
          simt_safe: bool = True, use_cache: bool = True) -> Program:
    """Compile C sources and/or LLVM IR modules and link them into one .vxbin.

    `kernels` lists the entry points (names, or KernelSpec with a typed parameter list)."""
    specs = [k if isinstance(k, KernelSpec) else KernelSpec(k) for k in kernels]
    if not specs:
        raise ToolchainError("no kernels given")
    key = hashlib.sha256(repr((list(c), list(ir), specs, opt, list(cflags), simt_safe,
                               linker_script(), simt_ir.c_header(), _version_tag())).encode())
    cached = cache_dir() / "programs" / f"{key.hexdigest()[:32]}.elf"
    if use_cache and cached.exists():
        elf = cached.read_bytes()
    else:
        objs = [assemble(startup_asm(specs)), device_runtime()]
        objs += [compile_object(s, "c", opt=opt, cflags=cflags, simt_safe=simt_safe)[0] for s in c]
        objs += [compile_object(s, "ir", opt=opt, cflags=cflags, simt_safe=simt_safe)[0] for s in ir]
        elf = link(objs)
        if use_cache:
            cached.parent.mkdir(exist_ok=True)
            _atomic_write(cached, elf)
    vx = elf_to_vxbin(elf)
    return Program(vxbin=vx, elf=elf, kernels=read_vxbin(vx).kernels,
                   specs={k.name: k for k in specs})


def _version_tag() -> str:
    from . import simt_ir as s  # noqa: PLC0415
    return hashlib.sha256(Path(__file__).read_bytes() + Path(s.__file__).read_bytes()
                          + Path(target.__file__).read_bytes()).hexdigest()[:16]
