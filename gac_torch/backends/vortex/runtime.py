"""Run a VortexProgram on SimX or the functional simulator, over torch tensors on the host.

Per call: inputs are copied to device buffers, the kernels are launched in order (grid, block,
lmem_size from the program), outputs are copied back into the torch tensors. Device buffers
(one per argument plus one workspace laid out by the static memory plan) are allocated once per
executable and released when the executable dies (bridge: a DeviceBuffer frees its device
memory when dropped; releases are batched into the device's next request). One device per
(mode, VORTEX_HOME) is shared by every executable of the process;
only one module is resident at a time (every image links at 0x80000000), so an executable
reloads its .vxbin when another one ran in between.

Counters of the last call: `executable.last_counters` (also `vortex.last_counters(compiled)`):
summed `instructions` (warp instructions), `cycles` (SimX; None on the functional simulator),
`divergent_branches` (functional: must be 0), `simx_restarts` (see SIMX_RETRIES: only a
timeout or a dead worker is retried, bridge.is_retryable) and
`kernels`, one entry per launch.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch

from gac_torch.backends.base import Signature
from gac_torch.errors import TargetUnavailable
from gac_torch.backends.gpu.program import BufferRef
from gac_torch.backends.vortex.bridge import (
    DeviceBuffer,
    FunctionalDevice,
    SimxDevice,
    SimxError,
    VortexDevice,
    VortexNotFound,
    find_vortex,
    is_retryable,
)
from gac_torch.backends.vortex.pipeline import VortexProgram
from gac_torch.backends.vortex.target import DEFAULT_CONFIG, VortexConfig, pack_args

MODES = ("simx", "functional")
_DEVICES: dict[tuple[str, str], VortexDevice] = {}
_RESIDENT: dict[int, int] = {}          # id(device) -> id(executable) whose module is loaded
# SimX (the build here) now and then never reports a launch as finished — at random, about once
# per 100-200 launches issued after an idle gap; the simulated kernel had completed. A launch
# that exceeds its timeout (bridge.launch_timeout: scales with the work) kills the worker; the
# call is then rerun on a fresh SimX.
SIMX_TIMEOUT_ENV = "GAC_VORTEX_SIMX_TIMEOUT"   # fixed seconds per device request (overrides scaling)
SIMX_RETRIES = 2
TCU_ENV = "GAC_VORTEX_TCU"    # "1": option vortex_tcu's default (code switch: in the cache key)
_SUMMED = ("instructions", "thread_instructions", "divergent_branches", "divergent_splits",
           "barriers", "ctas")


def resolve_mode(options: dict) -> tuple[str, str | None]:
    """(mode, vortex_home): default simx when a Vortex build is given or in VORTEX_HOME."""
    home = options.get("vortex_home") or os.environ.get("VORTEX_HOME") or None
    mode = options.get("vortex_mode") or ("simx" if home else "functional")
    if mode not in MODES:
        raise ValueError(f"option 'vortex_mode' must be one of {MODES}, not {mode!r}")
    return mode, home


def resolve_config(options: dict, mode: str, vortex_home: str | None) -> VortexConfig:
    """The device configuration the code is compiled for (option `vortex_config`): None, the
    SimX default build 1x4x4; "device", what the device reports (opens SimX); "CxWxT", that
    one. The functional simulator runs whichever is asked for; a SimX build only its own
    (VortexExecutable checks)."""
    text = options.get("vortex_config")
    tcu = options.get("vortex_tcu")
    if tcu is None:
        tcu = os.environ.get(TCU_ENV, "").lower() in ("1", "true", "on")
    cfg = DEFAULT_CONFIG
    if text == "device" and mode == "simx":
        cfg = device(mode, vortex_home).config
    elif text and text != "device":
        cores, warps, threads = (int(x) for x in text.split("x"))
        cfg = dataclasses.replace(DEFAULT_CONFIG, cores=cores, warps=warps, threads=threads)
    return dataclasses.replace(cfg, tcu=bool(tcu))


def device(mode: str, vortex_home: str | None, config: VortexConfig = DEFAULT_CONFIG) -> VortexDevice:
    """One device per (mode, home) for SimX, per configuration for the functional simulator."""
    key = (mode, str(vortex_home or "")) if mode == "simx" else (mode, "", config)
    dev = _DEVICES.get(key)
    if dev is None:
        if mode == "simx":
            try:
                find_vortex(vortex_home)
            except VortexNotFound as e:
                raise TargetUnavailable(f"vortex_mode='simx': {e}; or pass "
                                        "options={'vortex_mode': 'functional'}") from e
            fixed = os.environ.get(SIMX_TIMEOUT_ENV)
            dev = SimxDevice(vortex_home, timeout=float(fixed) if fixed else None)
        else:
            dev = FunctionalDevice(config)
        _DEVICES[key] = dev
    return dev


def _drop_device(dev: VortexDevice) -> None:
    for key, d in list(_DEVICES.items()):
        if d is dev:
            del _DEVICES[key]
    _RESIDENT.pop(id(dev), None)
    try:
        dev.close()
    except (SimxError, OSError):
        pass


@atexit.register
def _close_devices() -> None:
    for dev in _DEVICES.values():
        dev.close()
    _DEVICES.clear()


class VortexExecutable:
    def __init__(self, program: VortexProgram, signature: Signature, mode: str,
                 vortex_home: str | None, config: VortexConfig = DEFAULT_CONFIG) -> None:
        specs = list(signature.inputs) + list(signature.outputs)
        for i, (s, a) in enumerate(zip(specs, program.args)):
            if tuple(s.shape) != a.shape or s.dtype.itemsize != a.itemsize:
                raise ValueError(f"buffer {i}: signature {s} does not match compiled {a.elem}{list(a.shape)}")
        self.program, self.signature, self.mode, self.vortex_home = program, signature, mode, vortex_home
        self.config = config
        self.device = device(mode, vortex_home, config)
        cfg = self.device.config
        if (cfg.cores, cfg.warps, cfg.threads) != (config.cores, config.warps, config.threads):
            raise TargetUnavailable(
                f"compiled for vortex_config {config.cores}x{config.warps}x{config.threads}, but the "
                f"SimX build at {vortex_home or '$VORTEX_HOME'} is {cfg.cores}x{cfg.warps}x{cfg.threads} "
                "(fixed when SimX is built; vortex_config='device' compiles for it)")
        if config.tcu and not cfg.tcu:
            raise TargetUnavailable(
                f"compiled with vortex_tcu (WMMA), but the SimX build at {vortex_home or '$VORTEX_HOME'} "
                "has no tensor-core unit (build SimX with CONFIGS=-DVX_CFG_EXT_TCU_ENABLE, or turn "
                f"vortex_tcu / {TCU_ENV} off)")
        for k in program.launches:
            threads = k.block[0] * k.block[1] * k.block[2]
            if k.shared_mem and threads > cfg.warps * cfg.threads:
                raise TargetUnavailable(
                    f"kernel {k.kernel} needs {threads} threads per CTA (it synchronises), the "
                    f"device has {cfg.warps} warps x {cfg.threads} threads per core")
        self.last_counters: dict[str, Any] | None = None
        self.donate: dict[int, int] = {}  # output k -> input i: k's kernels use i's device buffer
        self._module: int | None = None
        self._bufs: list[DeviceBuffer] = []
        self._workspace: DeviceBuffer | None = None

    def _prepare(self) -> None:
        dev = device(self.mode, self.vortex_home, self.config)
        if dev is not self.device:                  # the previous SimX was restarted
            self.device, self._bufs, self._workspace, self._module = dev, [], None, None
        if not self._bufs:
            self._bufs = [dev.alloc(max(4, a.itemsize * _numel(a.shape))) for a in self.program.args]
            size = self.program.plan.workspace_size
            self._workspace = dev.alloc(size) if size else None
        if _RESIDENT.get(id(dev)) != id(self) or self._module is None:
            self._module = dev.load_module(self.program.vxbin)
            _RESIDENT[id(dev)] = id(self)

    def run(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        if not self.program.launches:
            self.last_counters = _total([])
            return
        for attempt in range(SIMX_RETRIES + 1):
            try:
                self.last_counters = dict(self._run_once(inputs, outputs), simx_restarts=attempt)
                return
            except SimxError as e:
                if self.mode != "simx" or attempt == SIMX_RETRIES or not is_retryable(e):
                    raise
                _drop_device(self.device)

    def _run_once(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> dict[str, Any]:
        prog = self.program
        self._prepare()
        dev, n_in = self.device, len(inputs)
        for t, buf in zip(inputs, self._bufs):
            dev.write(buf, _host_bytes(t))
        temps = [self._workspace.address + prog.plan.offsets[t.name]    # type: ignore[union-attr]
                 for t in prog.temps]
        per_launch = []
        alias = {n_in + k: i for k, i in self.donate.items()}  # (the kernel reads and writes one buffer)
        for k in prog.launches:
            kinds = prog.kernels[k.kernel].params
            values = [(self._bufs[alias.get(a.index, a.index)].address if a.kind == "arg" else temps[a.index])
                      if isinstance(a, BufferRef) else a.value for a in k.args]
            c = dev.launch(self._module, k.kernel, pack_args(kinds, values),  # type: ignore[arg-type]
                           grid=k.grid, block=k.block, lmem_size=k.shared_mem)
            per_launch.append(dict(c, kernel=k.kernel, lmem=k.shared_mem, grid=k.grid,
                                   block=k.block))
        for t, buf in zip(outputs, [self._bufs[alias.get(n_in + k, n_in + k)] for k in range(len(outputs))]):
            data = dev.read(buf, t.numel() * t.element_size())
            t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(t.dtype).view(t.shape))
        return _total(per_launch)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _host_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a contiguous tensor (bool is one byte per element, as the kernels expect)."""
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _total(per_launch: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: sum(c.get(k) or 0 for c in per_launch) for k in _SUMMED}
    cycles = [c.get("cycles") for c in per_launch]
    out["cycles"] = sum(cycles) if cycles and None not in cycles else None  # type: ignore[arg-type]
    out["launches"] = len(per_launch)
    out["kernels"] = per_launch
    return out


def last_counters(compiled: Any) -> dict[str, Any]:
    """Counters of the last call of a compiled program (gac_torch.compile's result, a
    torch.compile'd graph's CompiledFx, or one partition), summed over its vortex partitions."""
    parts = getattr(getattr(compiled, "compiled", compiled), "partitions", None)
    graphs = list(parts.values()) if parts is not None else [compiled]
    per = [g.executable.last_counters for g in graphs
           if getattr(g.executable, "last_counters", None) is not None]
    if not per:
        raise ValueError("no vortex partition of this program has run yet")
    return dict(_total([k for c in per for k in c["kernels"]]),
                simx_restarts=sum(c.get("simx_restarts", 0) for c in per))
