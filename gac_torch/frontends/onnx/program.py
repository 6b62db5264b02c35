"""gac_torch.compile(model.onnx | ModelProto): the compiled callable over torch tensors or numpy."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import torch

from gac_torch.frontends.fx import CompiledFx, compile_graph
from gac_torch.frontends.onnx.importer import ImportedGraph, OnnxReport, import_model
from gac_torch.frontends.onnx.load import load_model
from gac_torch.errors import GacInputError


class CompiledOnnx:
    """Call with the model's inputs (positionally or by ONNX name). Returns a tensor, or a tuple
    for several outputs; numpy in -> numpy out. Initializers are bound here, not in the IR."""

    def __init__(self, imported: ImportedGraph, compiled: CompiledFx):
        self.imported = imported
        self.compiled = compiled
        self.report = compiled.report  # ATen level: what gac compiled
        self.onnx_report: OnnxReport = imported.report  # ONNX level: mapped / folded / fallback
        self.input_names = imported.input_names
        self.output_names = imported.output_names
        self.device = torch.device("cuda" if compiled.target == "cuda" else "cpu")
        self._params = [p.to(self.device) for p in imported.params]

    def ir(self, stage: str) -> str:
        return self.compiled.ir(stage)

    @property
    def stages(self) -> list[str]:
        parts = self.compiled.partitions
        return list(next(iter(parts.values())).stages) if parts else []

    def _inputs(
        self, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[list[torch.Tensor], bool]:
        if kwargs:
            unknown = sorted(set(kwargs) - set(self.input_names))
            if unknown:
                raise GacInputError(f"unknown input name(s) {unknown}; inputs: {self.input_names}")
            args = list(args) + [
                kwargs[name] for name in self.input_names[len(args) :] if name in kwargs
            ]
        if len(args) != len(self.input_names):
            raise GacInputError(
                f"expected {len(self.input_names)} inputs {self.input_names}, got {len(args)}"
            )
        as_numpy = any(isinstance(a, np.ndarray) for a in args)
        out = []
        for name, a, (shape, dtype) in zip(self.input_names, args, self.imported.input_specs):
            t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
            if not isinstance(t, torch.Tensor):
                raise GacInputError(
                    f"input {name!r}: expected a tensor or numpy array, got {type(a).__name__}"
                )
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise GacInputError(
                    f"input {name!r}: expected {dtype}{list(shape)}, got {t.dtype}{list(t.shape)}"
                )
            out.append(t.to(self.device) if isinstance(a, np.ndarray) else t)
        return out, as_numpy

    def __call__(self, *args: Any, **kwargs: Any):
        inputs, as_numpy = self._inputs(args, kwargs)
        outs = self.compiled(*inputs, *self._params)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        if as_numpy:
            outs = [o.detach().cpu().numpy() for o in outs]
        return outs[0] if len(outs) == 1 else tuple(outs)


def device_for(target: str | None) -> str:
    return "cuda" if target == "cuda" else "cpu"


def compile_onnx(
    model: str | os.PathLike | onnx.ModelProto,
    options: dict,
    example_inputs: Sequence[Any] | None = None,
) -> CompiledOnnx:
    """options: resolved gac options (options.resolve); example_inputs fix symbolic dims."""
    proto = load_model(model)
    examples = (
        None
        if example_inputs is None
        else [torch.from_numpy(e) if isinstance(e, np.ndarray) else e for e in example_inputs]
    )
    target = options["target"] or "cpu"
    imported = import_model(
        proto, strict=not options["fallback"], device=device_for(target), example_inputs=examples
    )
    return CompiledOnnx(imported, compile_graph(imported.gm, options.replace(target=target)))
