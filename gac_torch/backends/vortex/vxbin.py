"""The .vxbin container Vortex's runtime loads (vx_module_load_bytes), written and read here.

Layout (little-endian):
  u64 min_vma        lowest PT_LOAD address (where every warp starts)
  u64 max_vma        max(end of every PT_LOAD incl. BSS, `_end`); the loader zero-fills the rest
  flat image         the allocated, non-NOBITS sections at (addr - min_vma), zero-padded to
                     `_edata - min_vma` (what `objcopy -O binary` + padding gives)
  footer             names back to back (no NULs), N x <IHHQ {name_off, name_len, 0, pc},
                     u32 N, b"VXSYMTAB"; one entry per ELF symbol `__vx_kentry_<name>`.
Without a footer the runtime exposes one kernel "main" at min_vma, whose launch hangs in KMU
mode, so we refuse to write a .vxbin with no kernel entries.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass, field

from elftools.elf.constants import SH_FLAGS
from elftools.elf.elffile import ELFFile

MAGIC = b"VXSYMTAB"
ENTRY_PREFIX = "__vx_kentry_"
_ENTRY = struct.Struct("<IHHQ")


@dataclass
class VxBin:
    min_vma: int
    max_vma: int
    image: bytes                                   # loaded at min_vma; BSS up to max_vma
    kernels: dict[str, int] = field(default_factory=dict)


def _symbols(elf: ELFFile) -> dict[str, int]:
    tab = elf.get_section_by_name(".symtab")
    if tab is None:
        raise ValueError("ELF has no .symtab (was it stripped?)")
    return {s.name: s["st_value"] for s in tab.iter_symbols() if s.name}


def elf_to_vxbin(elf_bytes: bytes) -> bytes:
    elf = ELFFile(io.BytesIO(elf_bytes))
    if elf["e_machine"] != "EM_RISCV" or elf.elfclass != 32:
        raise ValueError("expected a 32-bit RISC-V ELF")
    loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD" and s["p_memsz"]]
    if not loads:
        raise ValueError("ELF has no loadable segment")
    min_vma = min(s["p_vaddr"] for s in loads)
    max_vma = max(s["p_vaddr"] + s["p_memsz"] for s in loads)
    syms = _symbols(elf)

    # objcopy -O binary: every allocated section with contents, at its address
    image = bytearray()
    for sec in elf.iter_sections():
        if not sec["sh_flags"] & SH_FLAGS.SHF_ALLOC or sec["sh_type"] == "SHT_NOBITS":
            continue
        if not sec["sh_size"]:
            continue
        off = sec["sh_addr"] - min_vma
        if len(image) < off:
            image.extend(bytes(off - len(image)))
        image[off:off + sec["sh_size"]] = sec.data()
    edata = syms.get("_edata", min_vma + len(image))
    if len(image) < edata - min_vma:
        image.extend(bytes(edata - min_vma - len(image)))
    max_vma = max(max_vma, syms.get("_end", max_vma), min_vma + len(image))

    kernels = {n[len(ENTRY_PREFIX):]: pc for n, pc in sorted(syms.items(), key=lambda kv: kv[1])
               if n.startswith(ENTRY_PREFIX)}
    if not kernels:
        raise ValueError(f"no `{ENTRY_PREFIX}<name>` symbol: the launch would hang in KMU mode")
    return struct.pack("<QQ", min_vma, max_vma) + bytes(image) + _footer(kernels)


def _footer(kernels: dict[str, int]) -> bytes:
    names, entries = bytearray(), bytearray()
    for name, pc in kernels.items():
        raw = name.encode()
        entries += _ENTRY.pack(len(names), len(raw), 0, pc)
        names += raw
    return bytes(names + entries) + struct.pack("<I", len(kernels)) + MAGIC


def read_vxbin(data: bytes) -> VxBin:
    """Parse a .vxbin the way the runtime's Module::load_bytes does."""
    if len(data) < 16:
        raise ValueError("truncated .vxbin")
    min_vma, max_vma = struct.unpack_from("<QQ", data, 0)
    if max_vma <= min_vma:
        raise ValueError("bad .vxbin header (max_vma <= min_vma)")
    kernels: dict[str, int] = {}
    footer = 0
    if len(data) >= 28 and data[-8:] == MAGIC:
        (n,) = struct.unpack_from("<I", data, len(data) - 12)
        start = len(data) - 12 - n * _ENTRY.size
        entries = [_ENTRY.unpack_from(data, start + i * _ENTRY.size) for i in range(n)]
        blob = max((off + ln for off, ln, _, _ in entries), default=0)
        footer = 12 + n * _ENTRY.size + blob
        strings = len(data) - footer
        for off, ln, _pad, pc in entries:
            kernels[data[strings + off:strings + off + ln].decode()] = pc
    image = data[16:len(data) - footer]
    if len(image) > max_vma - min_vma:
        raise ValueError(".vxbin image is larger than its VMA range")
    if not kernels:
        kernels["main"] = min_vma     # the runtime's fallback (hangs in KMU mode)
    return VxBin(min_vma, max_vma, bytes(image), kernels)
