"""Targets. Each lives in its own package exposing TARGET; nothing outside asks which it is."""

from __future__ import annotations

import importlib

from gac_torch.backends.base import (
    STAGE_KINDS, SizeSpec, Signature, Stage, Target, TensorSpec, stages_only,
)

from gac_torch.options import TARGETS as TARGET_NAMES  # the one list of valid targets


def get_target(name: str) -> Target:
    if name not in TARGET_NAMES:
        raise ValueError(f"unknown target {name!r}; valid targets: {', '.join(TARGET_NAMES)}")
    return importlib.import_module(f"gac_torch.backends.{name}").TARGET


__all__ = ["get_target", "Target", "Stage", "STAGE_KINDS", "Signature", "TensorSpec", "SizeSpec", "TARGET_NAMES",
           "stages_only"]
