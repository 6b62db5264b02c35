"""The SimX bridge without a SimX: a fake libvortex.so (C, built with gcc here) drives the real
worker process, to check the symbol check at open, which errors are retried, the launch timeout
and that device memory is released when buffers die. Soak tests: functional simulator (CI) and
SimX (marked `simx`)."""

from __future__ import annotations

import gc
import shutil
import struct
import subprocess
import time

import numpy as np
import pytest
import torch

pytest.importorskip("ziglang")
pytest.importorskip("elftools")

import gac_torch  # noqa: E402
from gac_torch.backends.vortex import bridge, runtime  # noqa: E402
from gac_torch.backends.vortex import toolchain as tc  # noqa: E402
from gac_torch.backends.vortex.target import pack_args  # noqa: E402
from gac_torch.errors import TargetUnavailable  # noqa: E402
from parity import Fn  # noqa: E402

# Every function the bridge calls, with just enough behaviour: buffers are malloc'd and their
# live bytes written to $FAKE_VX_LIVE; FAKE_VX_FAIL_LAUNCH makes the launch return an error,
# FAKE_VX_HANG makes vx_queue_finish never return after a launch. -DOMIT_<name> drops a symbol.
FAKE_C = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
typedef struct { uint64_t size; char* mem; } buf_t;
static long live = 0; static int launched = 0;
static void report(void) { const char* p = getenv("FAKE_VX_LIVE"); if (!p) return;
  FILE* f = fopen(p, "w"); if (f) { fprintf(f, "%ld", live); fclose(f); } }
int vx_device_open(uint32_t i, void** d) { *d = (void*)1; return 0; }
int vx_device_release(void* d) { return 0; }
int vx_device_query(void* d, uint32_t cap, uint64_t* v) { *v = cap <= 2 ? 4 : cap == 3 ? 1 : 1 << 20; return 0; }
#ifndef OMIT_vx_device_mpm_query
int vx_device_mpm_query(void* d, uint32_t a, uint32_t csr, uint32_t core, uint64_t* v) { *v = 7; return 0; }
#endif
int vx_queue_create(void* d, void* qi, void** q) { *q = (void*)1; return 0; }
int vx_queue_release(void* q) { return 0; }
int vx_queue_finish(void* q, uint64_t t) {
  if (launched && getenv("FAKE_VX_HANG")) for (;;) sleep(1);
  return 0; }
int vx_buffer_create(void* d, uint64_t size, uint32_t flags, void** b) {
  buf_t* x = malloc(sizeof *x); x->size = size; x->mem = malloc(size ? size : 1); memset(x->mem, 0xAB, size);
  live += (long)size; report(); *b = x; return 0; }
int vx_buffer_address(void* b, uint64_t* a) { *a = (uint64_t)(uintptr_t)((buf_t*)b)->mem & 0xffffffffu; return 0; }
#ifndef OMIT_vx_buffer_release
int vx_buffer_release(void* b) { buf_t* x = b; live -= (long)x->size; report(); free(x->mem); free(x); return 0; }
#endif
int vx_enqueue_write(void* q, void* b, uint64_t off, const void* src, uint64_t n, uint32_t a, void* e, void* f) {
  memcpy(((buf_t*)b)->mem + off, src, n); return 0; }
int vx_enqueue_read(void* q, void* dst, void* b, uint64_t off, uint64_t n, uint32_t a, void* e, void* f) {
  memcpy(dst, ((buf_t*)b)->mem + off, n); return 0; }
int vx_module_load_bytes(void* d, const void* p, size_t n, void** m) { *m = (void*)1; return 0; }
int vx_module_get_kernel(void* m, const char* name, void** k) { *k = (void*)1; return 0; }
int vx_module_release(void* m) { return 0; }
int vx_kernel_release(void* k) { return 0; }
int vx_enqueue_launch(void* q, void* li, uint32_t a, void* e, void* f) {
  launched = 1; return getenv("FAKE_VX_FAIL_LAUNCH") ? 5 : 0; }
const char* vx_result_string(int r) { return r == 5 ? "fake: invalid launch" : "fake error"; }
"""

VXBIN = struct.pack("<QQ", 0x8000_0000, 0x8000_0010) + bytes(16)     # no symbol table: "main"


def fake_home(tmp_path, omit=()):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the fake libvortex.so")
    lib = tmp_path / "lib"
    lib.mkdir()
    (tmp_path / "fake.c").write_text(FAKE_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", *[f"-DOMIT_{n}" for n in omit],
                    "-o", str(lib / "libvortex.so"), str(tmp_path / "fake.c")], check=True)
    (lib / "libvortex-simx.so").write_bytes(b"")      # find_vortex only checks it is there
    return tmp_path


@pytest.fixture
def starts(monkeypatch):
    """Counts SimX worker processes started (and the devices the runtime caches are dropped)."""
    count = [0]
    real = bridge.subprocess.Popen

    def popen(*a, **kw):
        count[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(bridge.subprocess, "Popen", popen)
    for dev in list(runtime._DEVICES.values()):
        runtime._drop_device(dev)
    yield count
    for dev in list(runtime._DEVICES.values()):
        runtime._drop_device(dev)


def _compile_simx(home):
    x = torch.randn(7, generator=torch.Generator().manual_seed(0))
    return gac_torch.compile(Fn(lambda t: t * 2 + 1), (x,), target="vortex",
                             options={"vortex_mode": "simx", "vortex_home": str(home),
                                      "fallback": False}), x


# --- 1. the runtime is checked at open ---------------------------------------------------------
@pytest.mark.parametrize("omit", [("vx_device_mpm_query",),
                                  ("vx_device_mpm_query", "vx_buffer_release")])
def test_missing_symbols_fail_at_open(tmp_path, starts, omit):
    home = fake_home(tmp_path, omit)
    with pytest.raises(bridge.VortexApiMismatch) as e:
        bridge.SimxDevice(home)
    msg = str(e.value)
    assert all(n in msg for n in omit) and "vortex2.h" in msg and "3.0" in msg
    assert isinstance(e.value, TargetUnavailable) and not bridge.is_retryable(e.value)
    # through the target (which defers the error to the call): one worker start, no restarts
    starts[0] = 0
    with pytest.raises(TargetUnavailable, match=omit[0]):
        compiled, x = _compile_simx(home)
        compiled(x)
    assert starts[0] == 1


def test_symbol_table_matches_the_worker():
    """Every vx_* function simx_worker.py calls is in bridge.RUNTIME_SYMBOLS, and vice versa."""
    import re
    from pathlib import Path
    src = Path(bridge.__file__).with_name("simx_worker.py").read_text()
    assert set(re.findall(r"lib\.(vx_\w+)", src)) == set(bridge.RUNTIME_SYMBOLS)


def test_complete_fake_runtime_opens(tmp_path, starts):
    with bridge.SimxDevice(fake_home(tmp_path)) as dev:
        assert (dev.config.cores, dev.config.warps, dev.config.threads) == (1, 4, 4)
        assert dev.read(dev.alloc(24)) == bytes(24)     # the fake hands out 0xAB bytes
        buf = dev.upload(np.arange(5, dtype=np.float32))
        np.testing.assert_array_equal(dev.download(buf, np.float32), np.arange(5, dtype=np.float32))


# --- 2. only timeouts and dead workers are retried ---------------------------------------------
def test_runtime_error_is_not_retried(tmp_path, starts, monkeypatch):
    home = fake_home(tmp_path)
    compiled, x = _compile_simx(home)
    compiled(x)                                    # the fake runs the graph (no results to check)
    assert runtime.last_counters(compiled)["simx_restarts"] == 0
    monkeypatch.setenv("FAKE_VX_FAIL_LAUNCH", "1")
    for dev in list(runtime._DEVICES.values()):    # a fresh worker sees the variable
        runtime._drop_device(dev)
    starts[0] = 0
    with pytest.raises(bridge.SimxRuntimeError, match="fake: invalid launch") as e:
        compiled(x)
    assert not bridge.is_retryable(e.value)
    assert starts[0] == 1                          # no restart for a deterministic error


def test_timeout_is_retried(tmp_path, starts, monkeypatch):
    home = fake_home(tmp_path)
    compiled, x = _compile_simx(home)
    monkeypatch.setenv("FAKE_VX_HANG", "1")
    monkeypatch.setenv(runtime.SIMX_TIMEOUT_ENV, "0.5")
    for dev in list(runtime._DEVICES.values()):
        runtime._drop_device(dev)
    starts[0] = 0
    with pytest.raises(bridge.SimxTimeout, match="did not finish `launch`") as e:
        compiled(x)
    assert bridge.is_retryable(e.value)
    assert starts[0] == 1 + runtime.SIMX_RETRIES


def test_error_classes():
    assert bridge.is_retryable(bridge.SimxTimeout("t")) and bridge.is_retryable(bridge.SimxWorkerDied("d"))
    for e in (bridge.SimxRuntimeError("r"), bridge.VortexApiMismatch("m"), ValueError("v"),
              bridge.SimxError("generic")):
        assert not bridge.is_retryable(e)


# --- 3. the launch timeout scales with the work ------------------------------------------------
def test_launch_timeout_scales_with_work():
    small = bridge.launch_timeout(threads=16, lanes=4, code_words=200)
    big = bridge.launch_timeout(threads=16 * 1024, lanes=4, code_words=200)
    assert bridge.TIMEOUT_BASE_S <= small < big <= bridge.TIMEOUT_MAX_S
    assert big - bridge.TIMEOUT_BASE_S == pytest.approx(1024 * (small - bridge.TIMEOUT_BASE_S))
    # measured count of a 54 s BEVFormer launch (~3.8 M warp-instructions at 70 k/s): > 120 s
    seen = bridge.launch_timeout(16 * 1024, 4, 200, known_instructions=3_800_000)
    assert seen == pytest.approx(bridge.TIMEOUT_BASE_S + 3_800_000 / bridge.SIMX_SLOW_RATE)
    assert seen > 54 * 5
    assert bridge.launch_timeout(10**9, 4, 10**6) == bridge.TIMEOUT_MAX_S


def test_device_launch_timeout_learns(tmp_path, starts):
    with bridge.SimxDevice(fake_home(tmp_path)) as dev:
        m = dev.load_module(VXBIN)
        guess = dev.launch_timeout("main", 64, 16)
        assert guess == bridge.launch_timeout(1024, 4, 4)
        dev.launch(m, "main", b"", grid=64, block=16)          # the fake reports 7 instructions
        assert dev.launch_timeout("main", 64, 16) == bridge.launch_timeout(1024, 4, 4, 7)
        assert dev.launch_timeout("main", 128, 16) == bridge.launch_timeout(2048, 4, 4)


# --- 4. device memory is released when buffers die ---------------------------------------------
def test_fake_runtime_releases_dropped_buffers(tmp_path, starts, monkeypatch):
    live = tmp_path / "live"
    monkeypatch.setenv("FAKE_VX_LIVE", str(live))
    with bridge.SimxDevice(fake_home(tmp_path)) as dev:
        keep = dev.alloc(100)
        for _ in range(50):
            bufs = [dev.alloc(256), dev.alloc(1000)]
            dev.write(bufs[0], bytes(range(256)))
            del bufs
        small = dev.alloc(8)                        # its request carries the queued releases
        assert int(live.read_text()) == 108
        assert dev.allocated_bytes == 108
        dev.free(keep)
        assert int(live.read_text()) == 8 and small.size == 8


VECADD_C = r"""
#include "vx_gac.h"
void vecadd(const float* a, const float* b, float* c, int n) {
  unsigned i = vx_block_id_x() * vx_block_dim_x() + vx_thread_id_x();
  int t = vx_split(i < (unsigned)n);
  if (i < (unsigned)n) c[i] = a[i] + b[i];
  vx_join(t);
}
"""
P4 = ("ptr", "ptr", "ptr", "i32")


@pytest.fixture(scope="module")
def vecadd():
    return tc.build(c=[VECADD_C], kernels=[tc.KernelSpec("vecadd", P4)])


def soak(dev, vxbin, launches=1000, n=6):
    """`launches` launches, each on fresh buffers that are dropped (not freed) afterwards."""
    m = dev.load_module(vxbin)
    rng = np.random.default_rng(0)
    before = None
    for i in range(launches):
        a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        A, B, C = dev.upload(a), dev.upload(b), dev.alloc(4 * n)
        dev.launch(m, "vecadd", pack_args(P4, [A.address, B.address, C.address, n]), grid=2, block=4)
        if i % 97 == 0:
            np.testing.assert_allclose(dev.download(C, np.float32), a + b, rtol=1e-6)
        del A, B, C
        if i == 9:
            before = dev.allocated_bytes, getattr(dev, "heap_bytes", None)
    gc.collect()
    dev.free(dev.alloc(4))                            # flushes the queued releases
    return before, (dev.allocated_bytes, getattr(dev, "heap_bytes", None))


def test_soak_functional_memory_is_flat(vecadd):
    dev = bridge.FunctionalDevice()
    t0 = time.perf_counter()
    before, after = soak(dev, vecadd.vxbin)
    print(f"\n[soak functional] 1000 launches in {time.perf_counter() - t0:.1f} s: "
          f"allocated {before[0]} -> {after[0]} B, heap {before[1]} -> {after[1]} B")
    assert after[0] <= before[0] and after[1] == before[1]


def test_dropped_executable_releases_its_buffers(monkeypatch):
    monkeypatch.delenv("VORTEX_HOME", raising=False)
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(1))
    dev = runtime.device("functional", None)
    compiled = gac_torch.compile(Fn(lambda t: torch.tanh(t) * 2), (x,), target="vortex",
                                 options={"vortex_mode": "functional", "fallback": False})
    torch.testing.assert_close(compiled(x), torch.tanh(x) * 2, rtol=1e-5, atol=1e-5)
    base = dev.allocated_bytes
    assert base >= 2 * x.numel() * 4
    heap = dev.heap_bytes
    for _ in range(3):
        c = gac_torch.compile(Fn(lambda t: torch.tanh(t) * 2), (x,), target="vortex",
                              options={"vortex_mode": "functional", "fallback": False})
        c(x)
        del c
        gc.collect()
    dev.free(dev.alloc(4))
    assert dev.allocated_bytes == base
    assert dev.heap_bytes <= heap + 2 * (x.numel() * 4 + 64) + 64   # the second copy's blocks, reused
    del compiled


@pytest.mark.simx
def test_soak_simx_memory_is_flat(vecadd):
    if not bridge.simx_available():
        pytest.skip("SimX not available: set VORTEX_HOME")
    with bridge.SimxDevice() as dev:
        t0 = time.perf_counter()
        before, after = soak(dev, vecadd.vxbin)
        print(f"\n[soak simx] 1000 launches in {time.perf_counter() - t0:.1f} s: "
              f"allocated {before[0]} -> {after[0]} B")
        assert after[0] <= before[0]


def test_functional_reused_memory_is_zeroed():
    """A freed block is reused, zeroed: results must not depend on which graph ran before."""
    dev = bridge.FunctionalDevice()
    a = dev.upload(np.arange(1, 17, dtype=np.float32))
    addr = a.address
    del a
    b = dev.alloc(64)
    assert b.address == addr and dev.heap_bytes == 64
    assert dev.read(b) == bytes(64)
