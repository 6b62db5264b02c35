"""Options: one frozen, hashable dataclass per target, validated once, part of the cache key; the
user surface (dicts to torch.compile / gac_torch.compile, GAC_DUMP_DIR) as before."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import gac_torch
from gac_torch.options import (
    BY_TARGET, TARGETS, CpuOptions, CudaOptions, Options, UnboundOptions, VortexOptions, key_fields, resolve,
    valid_options,
)
from gac_torch.runtime import cache

unit = pytest.mark.unit  # all but the torch.compile test: no compile


@unit
def test_each_target_has_its_class_frozen_and_hashable() -> None:
    assert TARGETS == ("cpu", "cuda", "vortex") and set(BY_TARGET) == set(TARGETS)
    a, b = resolve({"fallback": False}, target="cuda"), resolve({"fallback": False, "target": "cuda"})
    assert type(a) is CudaOptions and a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a["target"] == a.target == "cuda" and a.get("nope", 7) == 7
    assert type(resolve({}, target="cpu")) is CpuOptions and type(resolve({}, target="vortex")) is VortexOptions
    assert not hasattr(resolve({}, target="cpu"), "arch")  # cpu has no cuda field
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.fallback = True  # type: ignore[misc]
    with pytest.raises(KeyError):
        a["falback"]
    with pytest.raises(gac_torch.OptionError, match="valid targets: " + ", ".join(TARGETS)):
        resolve({"target": "tpu"})


@unit
def test_every_field_is_documented_and_listed_once() -> None:
    docs = valid_options()
    for cls in (Options, *BY_TARGET.values()):
        for f in dataclasses.fields(cls):
            assert f.metadata["doc"] and f.name in docs
    with pytest.raises(gac_torch.OptionError, match="valid options: .*'arch'.*'vortex_mode'"):
        resolve({"falback": False})


@unit
def test_resolved_options_are_validated_once_and_pass_through() -> None:
    a = resolve({"arch": "sm_80"}, target="cuda")
    assert resolve(a) is a and resolve(a, target="cuda") is a
    assert resolve(a, fallback=False).fallback is False
    with pytest.raises(gac_torch.OptionError, match="cuda cannot compile for cpu"):
        a.replace(target="cpu")
    with pytest.raises(gac_torch.OptionError, match="unknown cuda arch"):
        a.replace(arch="sm_1")  # a copy is validated too


@unit
def test_an_option_of_another_named_target_is_an_error_naming_it() -> None:
    with pytest.raises(gac_torch.OptionError, match=r"\['arch'\] are for target cuda, not cpu"):
        resolve({"arch": "sm_90"}, target="cpu")
    with pytest.raises(gac_torch.OptionError, match=r"\['vortex_mode'\] are for target vortex, not cuda"):
        resolve({"target": "cuda", "vortex_mode": "simx"})
    assert type(resolve({"arch": None}, target="cpu")) is CpuOptions  # None: the default, not given


@unit
def test_target_left_to_the_device_keeps_target_keys_checked_and_warns_on_another() -> None:
    with pytest.raises(gac_torch.OptionError, match="unknown cuda arch"):
        resolve({"arch": "sm_1"})  # checked before the target is known
    u = resolve({"arch": "sm_80", "fallback": False})
    assert type(u) is UnboundOptions and hash(u) == hash(resolve({"fallback": False, "arch": "sm_80"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = u.for_target("cuda")
    assert type(c) is CudaOptions and c.arch == "sm_80" and c.fallback is False
    with pytest.warns(UserWarning, match=r"\['arch'\] are for target cuda, not cpu"):
        p = u.for_target("cpu")
    assert p == resolve({"fallback": False}, target="cpu")


def test_cuda_only_option_for_a_cpu_model_under_torch_compile_warns_and_runs() -> None:
    torch._dynamo.reset()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="for target cuda, not cpu"):
        y = torch.compile(lambda t: t * 2 + 1, backend="gac", options={"arch": "sm_80"})(x)
    torch.testing.assert_close(y, x * 2 + 1)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="OptionError: .*for target cuda, not cpu"):
        torch.compile(lambda t: t + 1, backend="gac", options={"target": "cpu", "arch": "sm_80"})(x)


@unit
def test_cache_key_holds_what_decides_the_code_only(tmp_path) -> None:
    base = resolve({}, target="cuda")
    k = lambda o: cache.cache_key("module", "sig", o, o.target)
    assert k(base) == k(base.replace(dump_dir=str(tmp_path), cache=True))  # where, not what
    assert k(base) != k(base.replace(arch="sm_80")) != k(base.replace(allow_tf32_conv=not base.allow_tf32_conv))
    assert k(base) != k(base.replace(fallback=False))
    v = resolve({}, target="vortex")
    assert k(v) == k(v.replace(vortex_mode="functional", vortex_home=str(tmp_path)))  # how it runs
    assert "vortex_mode" not in key_fields(v) and "arch" in key_fields(base)
    assert k(resolve({}, target="cpu")) != k(base)


@unit
def test_dump_dir_from_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GAC_DUMP_DIR", str(tmp_path / "d"))
    assert resolve({}, target="cpu").dump_dir == str(tmp_path / "d") and (tmp_path / "d").is_dir()
    assert resolve({"dump_dir": str(tmp_path / "e")}).dump_dir == str(tmp_path / "e")
