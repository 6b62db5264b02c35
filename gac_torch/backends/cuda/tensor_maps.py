"""TMA descriptors (KernelLaunch arguments of type TensorMapArg): encoded on the host by the
driver's cuTensorMapEncodeTiled (no GPU work) and uploaded, per pointer set, into one device buffer
that the runtime's argument table points into (runtime.py). The driver module and its error check
are the runtime's (a stub in the cpu tests), passed in."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gac_torch.backends.gpu.program import KernelLaunch, TensorMapArg

_TMA_DTYPE = {"f16": "FLOAT16", "bf16": "BFLOAT16", "f32": "FLOAT32"}
_TMA_ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4}
TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap); 64-byte alignment required


def encode(d: Any, check: Callable, a: TensorMapArg, base: int) -> bytes:
    """The CUtensorMap for `a` over the buffer at device address `base`."""
    swz = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}[a.swizzle]
    tmap = check(d.cuTensorMapEncodeTiled(
        getattr(d.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{_TMA_DTYPE[a.elem]}"), len(a.dims),
        base + a.offset * _TMA_ITEMSIZE[a.elem], [d.cuuint64_t(x) for x in a.dims],
        [d.cuuint64_t(x) for x in a.strides], [d.cuuint32_t(x) for x in a.box],
        [d.cuuint32_t(1)] * len(a.dims), d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(d.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swz}"),
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    if hasattr(tmap, "getPtr"):
        return ctypes.string_at(int(tmap.getPtr()), TENSOR_MAP_BYTES)
    return struct.pack(f"<{TENSOR_MAP_BYTES // 8}Q", *(int(x) for x in tmap.opaque))


def upload(d: Any, check: Callable, launches: Sequence[KernelLaunch], arg_ptrs: Sequence[int],
           temp_ptrs: Sequence[int], device: torch.device
           ) -> tuple[torch.Tensor | None, dict[tuple[int, int], int]]:
    """Every TMA descriptor of the launch list for one pointer set, in one device buffer (the
    caller keeps it alive as long as the argument table pointing into it)."""
    where = [(i, j, a) for i, k in enumerate(launches) for j, a in enumerate(k.args)
             if isinstance(a, TensorMapArg)]
    if not where:
        return None, {}
    blob = b"".join(encode(d, check, a, arg_ptrs[a.buffer.index] if a.buffer.kind == "arg"
                           else temp_ptrs[a.buffer.index]) for _, _, a in where)
    buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
    base = buf.data_ptr()
    return buf, {(i, j): base + n * TENSOR_MAP_BYTES for n, (i, j, _) in enumerate(where)}
