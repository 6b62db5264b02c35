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
}
# Target-specific keys (validated here so a typo fails early, whatever the target).
TARGET_KEYS = {
    "arch": None,            # cuda: "sm_80", "sm_90", ...; default: the device's
    "vortex_home": None,     # vortex: a Vortex build with runtime/libvortex.so
    "vortex_mode": None,     # vortex: "simx" | "functional"; default: simx when available
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
    if opts["dump_dir"] is None and os.environ.get("GAC_DUMP_DIR"):
        opts["dump_dir"] = os.environ["GAC_DUMP_DIR"]
    if opts["target"] is not None and opts["target"] not in ("cpu", "cuda", "vortex"):
        raise OptionError(f"unknown target {opts['target']!r}; valid targets: cpu, cuda, vortex")
    if not isinstance(opts["fallback"], bool):
        raise OptionError("option 'fallback' must be True or False")
    if not isinstance(opts["min_block_size"], int) or opts["min_block_size"] < 1:
        raise OptionError("option 'min_block_size' must be a positive integer")
    return opts
