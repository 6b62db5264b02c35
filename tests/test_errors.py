"""Errors: every exception class gac_torch defines derives from gac_torch.GacError (and is found
here by reading the source, so a new one cannot be missed); the public ones are exported."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

import gac_torch

PKG = Path(gac_torch.__file__).parent
# loaded by the cuda compile workers without gac_torch (and torch), so it cannot derive from
# GacError: its error becomes a GacUnsupportedError at both boundaries (gpu/host.py in process,
# cuda/kernel_jobs.py from a worker; test_cuda_compile_jobs checks both)
STANDALONE = {"backends/gpu/i1_bytes.py"}


def _exception_classes() -> list[type]:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path.relative_to(PKG).as_posix() in STANDALONE:
            continue
        tree = ast.parse(path.read_text())
        names = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.bases]
        if not names:
            continue
        module = importlib.import_module("gac_torch." + ".".join(path.relative_to(PKG).with_suffix("").parts)
                                         .removesuffix(".__init__"))
        found += [c for c in (getattr(module, n) for n in names)
                  if isinstance(c, type) and issubclass(c, BaseException)]
    return found


def test_every_exception_class_is_a_gac_error() -> None:
    classes = _exception_classes()
    assert len(classes) >= 15, classes  # the walk sees the package's errors
    # warnings (e.g. GacCompilerWarning) are not errors
    assert [c.__qualname__ for c in classes
            if not issubclass(c, (gac_torch.GacError, Warning))] == []


@pytest.mark.unit
def test_public_errors_are_exported() -> None:
    for name in ("GacError", "OptionError", "GacInputError", "GacUnsupportedError", "StaticShapesOnly",
                 "CompileError", "TargetUnavailable", "OnnxLoadError"):
        assert issubclass(getattr(gac_torch, name), gac_torch.GacError), name
    assert issubclass(gac_torch.OptionError, ValueError) and issubclass(gac_torch.GacInputError, TypeError)


@pytest.mark.unit
def test_an_error_reaches_the_user_as_a_gac_error() -> None:
    with pytest.raises(gac_torch.GacError, match="valid targets"):
        gac_torch.compile(torch.nn.ReLU(), (torch.randn(3),), target="tpu")
