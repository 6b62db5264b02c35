"""The compiled callable of one partition: checks inputs, allocates outputs, runs the executable."""

from __future__ import annotations

from typing import Sequence

import torch

from gac_torch.backends.base import Executable, Signature


class GacInputError(TypeError):
    """A call's inputs do not match what the graph was compiled for."""


class CompiledGraph(torch.nn.Module):
    """Drop-in replacement for an FX submodule. `stages` maps stage name -> text."""

    def __init__(self, name: str, executable: Executable, signature: Signature, device_type: str,
                 stages: dict[str, str], input_names: Sequence[str], tuple_output: bool):
        super().__init__()
        self.name = name
        self.executable = executable
        self.signature = signature
        self.device_type = device_type
        self.stages = stages
        self.input_names = list(input_names)
        self.tuple_output = tuple_output

    def ir(self, stage: str) -> str:
        if stage not in self.stages:
            raise KeyError(f"no stage {stage!r}; stages: {list(self.stages)}")
        return self.stages[stage]

    def check_inputs(self, args: Sequence) -> None:
        if len(args) != len(self.signature.inputs):
            raise GacInputError(f"{self.name}: expected {len(self.signature.inputs)} inputs, got {len(args)}")
        for i, (a, spec) in enumerate(zip(args, self.signature.inputs)):
            what = f"{self.name}: input {i} ({self.input_names[i]})"
            if not isinstance(a, torch.Tensor):
                raise GacInputError(f"{what}: expected a tensor, got {type(a).__name__}")
            if a.dtype != spec.dtype:
                raise GacInputError(f"{what}: expected dtype {spec.dtype}, got {a.dtype}")
            if tuple(a.shape) != spec.shape:
                raise GacInputError(f"{what}: expected shape {list(spec.shape)}, got {list(a.shape)}")
            if a.device.type != self.device_type:
                raise GacInputError(f"{what}: compiled for {self.device_type} tensors, got one on {a.device}")
            if a.layout != torch.strided:
                raise GacInputError(f"{what}: expected a dense (strided) tensor, got {a.layout}")

    def forward(self, *args):
        self.check_inputs(args)
        inputs = [a.contiguous() for a in args]  # the kernels assume dense row-major buffers
        device = inputs[0].device if inputs else torch.device(self.device_type)
        outputs = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in self.signature.outputs]
        if all(o.numel() for o in outputs) and all(i.numel() for i in inputs):
            self.executable.run(inputs, outputs)
        elif any(o.numel() for o in outputs):
            raise GacInputError(f"{self.name}: empty inputs with non-empty outputs are not supported")
        return tuple(outputs) if self.tuple_output else outputs[0]
