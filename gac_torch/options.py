"""Compile options: defaults, validation (unknown keys are an error listing the valid ones)."""

from __future__ import annotations

import os
from typing import Any

COMMON = {
    "target": None,          # "cpu" | "cuda" | "vortex"; None: cuda for CUDA inputs, else cpu
    "fallback": True,        # False: raise one error listing every unsupported op
    "min_block_size": 1,     # smallest number of ATen nodes worth a compiled partition
    "dump_dir": None,        # write FX graph, gac and every stage here (also GAC_DUMP_DIR)
    "verify": True,          # run gac-verify on every module
    "cache": None,           # False: no on-disk compile cache; None: on unless GAC_CACHE=0
}
# Target-specific keys (validated here so a typo fails early, whatever the target).
TARGET_KEYS = {
    "arch": None,            # cuda: "sm_80", "sm_90", ...; default: the device's
    "vortex_home": None,     # vortex: a Vortex build with runtime/libvortex.so
    "vortex_mode": None,     # vortex: "simx" | "functional"; default: simx when available
    "allow_tf32": None,      # cuda: f32 matmuls may use TF32; recorded from torch's flags at
                             # compile time (False forbids it; True cannot override torch)
}


class OptionError(ValueError):
    pass


def resolve(options: dict[str, Any] | None, **overrides) -> dict[str, Any]:
    opts = dict(COMMON, **TARGET_KEYS)
    given = dict(options or {})
    given.update({k: v for k, v in overrides.items() if v is not None})
    unknown = sorted(set(given) - set(opts))
    if unknown:
        raise OptionError(f"unknown gac option(s) {unknown}; valid options: {sorted(opts)}")
    opts.update(given)
    opts["allow_tf32"] = _allow_tf32(opts["allow_tf32"])
    if opts["dump_dir"] is None and os.environ.get("GAC_DUMP_DIR"):
        opts["dump_dir"] = os.environ["GAC_DUMP_DIR"]
    if opts["target"] is not None and opts["target"] not in ("cpu", "cuda", "vortex"):
        raise OptionError(f"unknown target {opts['target']!r}; valid targets: cpu, cuda, vortex")
    if not isinstance(opts["fallback"], bool):
        raise OptionError("option 'fallback' must be True or False")
    if not isinstance(opts["min_block_size"], int) or opts["min_block_size"] < 1:
        raise OptionError("option 'min_block_size' must be a positive integer")
    return opts


def torch_allows_tf32() -> bool:
    """What torch itself would do for an f32 matmul on CUDA right now."""
    import torch

    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def _allow_tf32(given: Any) -> bool:
    """TF32 only when torch's own flags allow it; an explicit False forbids it regardless."""
    if given is not None and not isinstance(given, bool):
        raise OptionError("option 'allow_tf32' must be True or False")
    return torch_allows_tf32() and given is not False
