"""Compile options: one frozen, hashable dataclass per target, validated once, when it is made.

    torch.compile(model, backend="gac", options={"target": "cuda", "arch": "sm_80"})
    gac_torch.compile(ep, target="cpu", options={"fallback": False})

`resolve(user_dict, target=...)` turns what a user gives (a dict, `GAC_DUMP_DIR`) into the
target's class: `CpuOptions`, `CudaOptions` or `VortexOptions` (the common `Options` fields plus
the target's own, each documented in its `doc`). A key no target knows is an OptionError listing
the valid ones. A key of another target is an OptionError naming it and its target when the user
named the target. When the target is left to the inputs' device (target=None), `resolve` returns
`UnboundOptions`: the common fields, with the target keys checked and kept aside until the
front-end knows the device and calls `for_target(name)`; a key of another target is then a
warning and ignored, so one options dict serves a model whether it runs on cpu or on cuda.

The resolved object is part of every cache key (runtime/cache.py: `key_fields`); fields with
`in_key=False` say where things go or how they run, not what is compiled.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from typing import Any, ClassVar

from gac_torch.errors import OptionError


def _field(default: Any, doc: str, in_key: bool = True) -> Any:
    return dataclasses.field(default=default, metadata={"doc": doc, "in_key": in_key})


@dataclasses.dataclass(frozen=True)
class Options:
    """The fields every target takes. Read as attributes; `opts["name"]` and `opts.get("name")`
    also work, for callers written against the dict."""

    TARGET: ClassVar[str | None] = None  # the target a subclass is for

    target: str | None = _field(None, '"cpu" | "cuda" | "vortex"; None: cuda for CUDA inputs, else cpu')
    fallback: bool = _field(True, "False: raise one error listing every unsupported op")
    min_block_size: int = _field(1, "smallest number of ATen nodes worth a compiled partition")
    dump_dir: str | None = _field(None, "write the FX graph, gac and every stage here (also GAC_DUMP_DIR)",
                                  in_key=False)
    verify: bool = _field(True, "run gac-verify (shapes and dtypes) on every module")
    channels_last: bool | None = _field(None, "2-D convolutions on N H W C activations, converted only "
                                              "where the graph needs NCHW (passes/channels_last.py); "
                                              "None: the target's choice (cuda: on)")
    cache: bool | None = _field(None, "False: no on-disk compile cache; None: on unless GAC_CACHE=0",
                                in_key=False)
    autotune: bool = _field(False, "measure the tile candidates of each kernel on the device at compile "
                                   "time and remember the fastest (cuda; torch.compile's mode="
                                   "'max-autotune'); the table's digest is in the cache key", in_key=False)

    def __post_init__(self) -> None:
        if self.target is not None and self.target not in TARGETS:
            raise OptionError(f"unknown target {self.target!r}; valid targets: {', '.join(TARGETS)}")
        if self.target != self.TARGET:
            raise OptionError(f"{type(self).__name__} is for target {self.TARGET}, not {self.target}")
        _check_bool("fallback", self.fallback)
        _check_bool("verify", self.verify)
        if not isinstance(self.min_block_size, int) or isinstance(self.min_block_size, bool) \
                or self.min_block_size < 1:
            raise OptionError("option 'min_block_size' must be a positive integer")
        _check_bool("cache", self.cache, none=True)
        _check_bool("channels_last", self.channels_last, none=True)
        _check_bool("autotune", self.autotune)
        if self.dump_dir is not None and not isinstance(self.dump_dir, str):
            raise OptionError(f"option 'dump_dir' (or GAC_DUMP_DIR) must be a path, not "
                              f"{type(self.dump_dir).__name__}")

    def __getitem__(self, key: str) -> Any:
        if key not in _names(type(self)):
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in _names(type(self)) else default

    def replace(self, **changes: Any) -> Options:
        """A copy with `changes` (validated again); another target: `for_target`."""
        if changes.get("target", self.target) != self.target:
            return self.for_target(changes.pop("target")).replace(**changes)
        return dataclasses.replace(self, **changes)

    def for_target(self, name: str) -> Options:
        """These options for target `name` (the front-end's choice when the user made none)."""
        if name == self.target:
            return self
        raise OptionError(f"options resolved for target {self.target} cannot compile for {name}")

    @classmethod
    def _from_given(cls, common: dict[str, Any], given: dict[str, Any]) -> Options:
        """Made from the common fields and this target's keys as the user gave them (None:
        default); a target resolves what depends on the moment here (e.g. torch's TF32 flags)."""
        return cls(**common, **given)


@dataclasses.dataclass(frozen=True)
class CpuOptions(Options):
    """cpu: the common fields only (the ExecutionEngine reference target)."""

    TARGET: ClassVar[str | None] = "cpu"


@dataclasses.dataclass(frozen=True)
class CudaOptions(Options):
    TARGET: ClassVar[str | None] = "cuda"

    arch: str = _field("", '"sm_80", "sm_90", ... (default: the visible GPU\'s, else sm_90)')
    allow_tf32: bool = _field(False, "f32 matmuls may use TF32: from torch's flags at compile time "
                                     "(False forbids it; True cannot override torch)")
    allow_tf32_conv: bool = _field(False, "f32 convolutions may use TF32: from "
                                          "torch.backends.cudnn.allow_tf32 at compile time; False "
                                          "here or in allow_tf32 forbids it")
    cuda_graphs: bool | None = _field(None, "replay repeated calls as CUDA graphs where safe; None: on "
                                            "unless GAC_CUDA_GRAPHS=0 (backends/cuda/runtime.py)",
                                      in_key=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        from gac_torch.backends.cuda.target import ARCHS  # the cuda target's data

        if self.arch not in ARCHS:
            raise OptionError(f"option 'arch': unknown cuda arch {self.arch!r}; known: {', '.join(ARCHS)}")
        _check_bool("allow_tf32", self.allow_tf32)
        _check_bool("allow_tf32_conv", self.allow_tf32_conv)
        _check_bool("cuda_graphs", self.cuda_graphs, none=True)

    @classmethod
    def _from_given(cls, common: dict[str, Any], given: dict[str, Any]) -> Options:
        from gac_torch.backends.cuda.target import default_arch

        tf32, conv = given.get("allow_tf32"), given.get("allow_tf32_conv")
        _check_bool("allow_tf32", tf32, none=True)
        _check_bool("allow_tf32_conv", conv, none=True)
        return cls(**common, **dict(given, arch=given.get("arch") or default_arch(),
                                    allow_tf32=torch_allows_tf32() and tf32 is not False,
                                    allow_tf32_conv=torch_allows_tf32_conv() and conv is not False
                                    and tf32 is not False))


VORTEX_MODES = ("simx", "functional")


@dataclasses.dataclass(frozen=True)
class VortexOptions(Options):
    TARGET: ClassVar[str | None] = "vortex"

    vortex_home: str | None = _field(None, "a Vortex build with runtime/libvortex.so (else VORTEX_HOME)",
                                     in_key=False)
    vortex_mode: str | None = _field(None, '"simx" | "functional"; default: simx when a build is given',
                                     in_key=False)
    vortex_config: str | None = _field(None, '"CORESxWARPSxTHREADS" (e.g. "4x8x8") or "device" (what the '
                                             "SimX build reports); default 1x4x4 (SimX's default build)")
    vortex_tcu: bool | None = _field(None, "f16/bf16 matmuls on the tensor-core unit (WMMA; needs a SimX built "
                                           "with it); default: GAC_VORTEX_TCU=1 turns it on")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vortex_mode is not None and self.vortex_mode not in VORTEX_MODES:
            raise OptionError(f"option 'vortex_mode' must be one of {', '.join(VORTEX_MODES)}, "
                              f"not {self.vortex_mode!r}")
        cfg = self.vortex_config
        if cfg is not None and (not isinstance(cfg, str) or not re.fullmatch(r"device|[1-9]\d*x[1-9]\d*x[1-9]\d*", cfg)):
            raise OptionError(f"option 'vortex_config' must be 'CORESxWARPSxTHREADS' (e.g. '4x8x8') or "
                              f"'device', not {cfg!r}")
        _check_bool("vortex_tcu", self.vortex_tcu, none=True)
        if self.vortex_home is not None and not isinstance(self.vortex_home, str):
            raise OptionError(f"option 'vortex_home' must be a path, not {type(self.vortex_home).__name__}")

    @classmethod
    def _from_given(cls, common: dict[str, Any], given: dict[str, Any]) -> Options:
        home = given.get("vortex_home")
        if isinstance(home, os.PathLike):
            home = os.fspath(home)
        return cls(**common, **dict(given, vortex_home=home))


# The one list of valid targets, and each target's options.
BY_TARGET: dict[str, type[Options]] = {"cpu": CpuOptions, "cuda": CudaOptions, "vortex": VortexOptions}
TARGETS = tuple(BY_TARGET)


@dataclasses.dataclass(frozen=True)
class UnboundOptions(Options):
    """Options before the target is known (target=None): the target keys the user gave, checked,
    wait in `given` for `for_target`."""

    given: tuple[tuple[str, Any], ...] = _field((), "target keys given before the target is known")

    def for_target(self, name: str) -> Options:
        if name not in BY_TARGET:
            raise OptionError(f"unknown target {name!r}; valid targets: {', '.join(TARGETS)}")
        cls = BY_TARGET[name]
        own = _target_names(cls)
        foreign = sorted(k for k, _ in self.given if k not in own)
        if foreign:
            warnings.warn(f"gac: option(s) {foreign} are for target {_owner(foreign[0])}, not {name} "
                          "(the target the inputs' device chose): ignored", UserWarning, stacklevel=3)
        common = {f: getattr(self, f) for f in _names(Options)}
        return cls._from_given(dict(common, target=name), {k: v for k, v in self.given if k in own})


def _names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _target_names(cls: type[Options]) -> frozenset[str]:
    return _names(cls) - _names(Options)


def _owner(key: str) -> str:
    return next(t for t, cls in BY_TARGET.items() if key in _target_names(cls))


def valid_options() -> dict[str, str]:
    """Every option a user may give -> what it means (the targets' own say whose they are)."""
    out = {f.name: f.metadata["doc"] for f in dataclasses.fields(Options)}
    for t, cls in BY_TARGET.items():
        out.update({f.name: f"{t}: {f.metadata['doc']}" for f in dataclasses.fields(cls)
                    if f.name in _target_names(cls)})
    return out


def resolve(options: dict[str, Any] | Options | None, **overrides: Any) -> Options:
    """What the user gave -> the target's options (UnboundOptions while the target is None).
    `overrides` (e.g. target=) win over the dict unless None. Resolved Options pass through."""
    if isinstance(options, Options):
        target = overrides.pop("target", None)
        opts = options.for_target(target) if target else options
        changes = {k: v for k, v in overrides.items() if v is not None}
        return opts.replace(**changes) if changes else opts
    given = dict(options or {})
    given.update({k: v for k, v in overrides.items() if v is not None})
    valid = valid_options()
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise OptionError(f"unknown gac option(s) {unknown}; valid options: {sorted(valid)}")
    common = {k: given[k] for k in _names(Options) if k in given}
    dump_dir = common.pop("dump_dir", None) or os.environ.get("GAC_DUMP_DIR") or None
    opts = _bind(common, {k: v for k, v in given.items() if k not in _names(Options) and v is not None})
    if dump_dir is None:
        return opts
    return dataclasses.replace(opts, dump_dir=_writable_dump_dir(dump_dir, strict=not opts.fallback))


def _bind(common: dict[str, Any], target_keys: dict[str, Any]) -> Options:
    """The target's class, or UnboundOptions; every target key is checked now, whichever target
    runs, so that a typo fails before tracing."""
    target = common.get("target")
    if target is not None and target not in BY_TARGET:
        raise OptionError(f"unknown target {target!r}; valid targets: {', '.join(TARGETS)}")
    for t, cls in BY_TARGET.items():
        own = {k: v for k, v in target_keys.items() if k in _target_names(cls)}
        if not own:
            continue
        if target is not None and t != target:
            raise OptionError(f"option(s) {sorted(own)} are for target {t}, not {target}; target {target} "
                              f"takes: {sorted(_names(BY_TARGET[target]))}")
        made = cls._from_given(dict(common, target=t), own)
        if target is not None:
            return made
    if target is not None:
        return BY_TARGET[target]._from_given(common, {})
    return UnboundOptions(**common, given=tuple(sorted(target_keys.items())))


def key_fields(options: Options) -> dict[str, Any]:
    """The fields that decide what is compiled (part of a cache key), as plain data."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.metadata["in_key"]}


def _check_bool(name: str, value: Any, none: bool = False) -> None:
    if not isinstance(value, bool) and not (none and value is None):
        raise OptionError(f"option {name!r} must be True{', False or None' if none else ' or False'}, "
                          f"not {value!r}")


def _writable_dump_dir(path: Any, strict: bool) -> str | None:
    """The dump folder, created; one that cannot be written is an error in strict mode and a
    warning otherwise (dumps are a debugging aid: the compile goes on without them)."""
    if path is None:
        return None
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
        warnings.warn(f"gac: dump_dir {path!r} cannot be written ({e}); compiling without dumps",
                      RuntimeWarning, stacklevel=3)
        return None
    return path


def torch_allows_tf32() -> bool:
    """What torch itself would do for an f32 matmul on CUDA right now."""
    import torch

    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def torch_allows_tf32_conv() -> bool:
    """What torch itself would do for an f32 convolution on CUDA right now (cuDNN's flag)."""
    import torch

    return bool(torch.backends.cudnn.allow_tf32)


def precision_flags() -> tuple[bool, bool]:
    """torch's flags a compiled graph's numerics depend on (dynamo does not guard cuDNN's):
    torch_allows_tf32() and torch_allows_tf32_conv(), read straight from torch's C getters
    (what those properties return), since a compiled graph reads them on every call."""
    import torch

    c = torch._C
    return (c._get_cublas_allow_tf32() or c._get_float32_matmul_precision() != "highest",
            c._get_cudnn_allow_tf32())
