"""Compile options: defaults, validation (unknown keys are an error listing the valid ones), and
the resolved form: a frozen, hashable `Options` (part of a cache key), validated once here."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from gac_torch.errors import OptionError

TARGETS = ("cpu", "cuda", "vortex")  # the one list of valid targets

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
    "vortex_config": None,   # vortex: "CORESxWARPSxTHREADS" (e.g. "4x8x8") or "device" (what
                             # the SimX build reports); default 1x4x4 (SimX's default build)
    "allow_tf32": None,      # cuda: f32 matmuls may use TF32; recorded from torch's flags at
                             # compile time (False forbids it; True cannot override torch)
    "allow_tf32_conv": None,  # cuda: f32 convolutions may use TF32; from
                             # torch.backends.cudnn.allow_tf32 (default True) at compile time;
                             # False here or in allow_tf32 forbids it
}


@dataclasses.dataclass(frozen=True)
class Options:
    """Resolved options (see COMMON and TARGET_KEYS for what each means). Read as attributes;
    `opts["name"]` and `opts.get("name")` also work, for callers written against the dict."""

    target: str | None = None
    fallback: bool = True
    min_block_size: int = 1
    dump_dir: str | None = None
    verify: bool = True
    cache: bool | None = None  # None: on unless GAC_CACHE=0 (runtime/cache.py)
    arch: str | None = None  # cuda
    vortex_home: str | None = None  # vortex
    vortex_mode: str | None = None  # vortex
    vortex_config: str | None = None  # vortex
    allow_tf32: bool | None = None  # cuda
    allow_tf32_conv: bool | None = None  # cuda

    def __getitem__(self, key: str) -> Any:
        if key not in _FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in _FIELDS else default

    def replace(self, **changes: Any) -> Options:
        return dataclasses.replace(self, **changes)


_FIELDS = frozenset(f.name for f in dataclasses.fields(Options))


def resolve(options: dict[str, Any] | Options | None, **overrides) -> Options:
    if isinstance(options, Options):
        options = dataclasses.asdict(options)
    opts = dict(COMMON, **TARGET_KEYS)
    given = dict(options or {})
    given.update({k: v for k, v in overrides.items() if v is not None})
    unknown = sorted(set(given) - set(opts))
    if unknown:
        raise OptionError(f"unknown gac option(s) {unknown}; valid options: {sorted(opts)}")
    opts.update(given)
    opts["allow_tf32_conv"] = _allow_tf32_conv(opts["allow_tf32_conv"], opts["allow_tf32"])
    opts["allow_tf32"] = _allow_tf32(opts["allow_tf32"])
    if opts["dump_dir"] is None and os.environ.get("GAC_DUMP_DIR"):
        opts["dump_dir"] = os.environ["GAC_DUMP_DIR"]
    if opts["target"] is not None and opts["target"] not in TARGETS:
        raise OptionError(f"unknown target {opts['target']!r}; valid targets: {', '.join(TARGETS)}")
    if not isinstance(opts["fallback"], bool):
        raise OptionError("option 'fallback' must be True or False")
    if not isinstance(opts["min_block_size"], int) or opts["min_block_size"] < 1:
        raise OptionError("option 'min_block_size' must be a positive integer")
    _check_values(opts)
    return Options(**opts)


# --- option values (issue 12 item 11) -----------------------------------------------------------
VORTEX_MODES = ("simx", "functional")


def _check_values(opts: dict[str, Any]) -> None:
    """Types and values of the other options, so a typo fails here and not deep in a target."""
    if opts["cache"] is not None and not isinstance(opts["cache"], bool):
        raise OptionError(f"option 'cache' must be True, False or None, not {opts['cache']!r}")
    if not isinstance(opts["verify"], bool):
        raise OptionError(f"option 'verify' must be True or False, not {opts['verify']!r}")
    if opts["vortex_mode"] is not None and opts["vortex_mode"] not in VORTEX_MODES:
        raise OptionError(f"option 'vortex_mode' must be one of {', '.join(VORTEX_MODES)}, "
                          f"not {opts['vortex_mode']!r}")
    cfg = opts["vortex_config"]
    if cfg is not None and (not isinstance(cfg, str) or not re.fullmatch(r"device|[1-9]\d*x[1-9]\d*x[1-9]\d*", cfg)):
        raise OptionError(f"option 'vortex_config' must be 'CORESxWARPSxTHREADS' (e.g. '4x8x8') or "
                          f"'device', not {cfg!r}")
    if opts["arch"] is not None:
        from gac_torch.backends.cuda.target import ARCHS  # the cuda target's data

        if opts["arch"] not in ARCHS:
            raise OptionError(f"option 'arch': unknown cuda arch {opts['arch']!r}; known: {', '.join(ARCHS)}")
    if opts["vortex_home"] is not None and not isinstance(opts["vortex_home"], (str, os.PathLike)):
        raise OptionError(f"option 'vortex_home' must be a path, not {type(opts['vortex_home']).__name__}")
    if opts["dump_dir"] is not None:
        opts["dump_dir"] = _writable_dump_dir(opts["dump_dir"], strict=not opts["fallback"])


def _writable_dump_dir(path: Any, strict: bool) -> str | None:
    """The dump folder, created; one that cannot be written is an error in strict mode and a
    warning otherwise (dumps are a debugging aid: the compile goes on without them)."""
    if not isinstance(path, (str, os.PathLike)):
        raise OptionError(f"option 'dump_dir' (or GAC_DUMP_DIR) must be a path, not {type(path).__name__}")
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"no write permission on {path!r}")
    except OSError as e:
        if strict:
            raise OptionError(f"dump_dir {path!r} cannot be written: {e}") from e
        import warnings

        warnings.warn(f"gac: dump_dir {path!r} cannot be written ({e}); compiling without dumps",
                      RuntimeWarning, stacklevel=3)
        return None
    return path


def torch_allows_tf32() -> bool:
    """What torch itself would do for an f32 matmul on CUDA right now."""
    import torch

    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def _allow_tf32(given: Any) -> bool:
    """TF32 only when torch's own flags allow it; an explicit False forbids it regardless."""
    if given is not None and not isinstance(given, bool):
        raise OptionError("option 'allow_tf32' must be True or False")
    return torch_allows_tf32() and given is not False


def torch_allows_tf32_conv() -> bool:
    """What torch itself would do for an f32 convolution on CUDA right now (cuDNN's flag)."""
    import torch

    return bool(torch.backends.cudnn.allow_tf32)


def precision_flags() -> tuple[bool, bool]:
    """torch's flags a compiled graph's numerics depend on (dynamo does not guard cuDNN's)."""
    return torch_allows_tf32(), torch_allows_tf32_conv()


def _allow_tf32_conv(given: Any, given_matmul: Any) -> bool:
    if given is not None and not isinstance(given, bool):
        raise OptionError("option 'allow_tf32_conv' must be True or False")
    return torch_allows_tf32_conv() and given is not False and given_matmul is not False
