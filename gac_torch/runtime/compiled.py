"""The compiled callable of one partition: checks inputs, allocates outputs, runs the executable."""

from __future__ import annotations

import contextlib
import os
from typing import Sequence

import sympy
import torch

from gac_torch.backends.base import Executable, Signature, SizeSpec
from gac_torch.errors import GacInputError
from gac_torch.runtime.sizes import bind_all

_profiler = torch.autograd.profiler  # (its _is_profiler_enabled flag is read per call)


class CompiledGraph(torch.nn.Module):
    """Drop-in replacement for an FX submodule. `stages` maps stage name -> text.

    With run-time sizes (signature.dynamic) each call binds the size symbols from its inputs'
    sizes (runtime/sizes.py), checks that every input agrees with them, and evaluates the output
    shapes; the executable receives the size arguments as ints, in
    their places among the input tensors."""

    def __init__(self, name: str, executable: Executable, signature: Signature, device_type: str,
                 stages: dict[str, str], input_names: Sequence[str], tuple_output: bool,
                 fx_graph: str = ""):
        super().__init__()
        self.fx_graph = fx_graph  # the ATen partition it was compiled from (text)
        self.name = name
        self.signature = signature
        self.device_type = device_type
        self.stages = stages
        self.input_names = list(input_names)
        self.tuple_output = tuple_output
        self._shapes: dict[tuple, list] = {}  # input shapes -> output shapes (run-time sizes)
        # The per-call fast path (static shapes, no statically empty output): the executable's
        # `call(args)`, which checks what it relies on and returns the outputs, or None to
        # decline (then check_inputs names what is wrong, and `run` takes what is merely unusual)
        self._range = f"gac:{name}"
        empty_out = any(isinstance(d, int) and d == 0 for s in signature.outputs for d in s.shape)
        self._fast = not signature.dynamic and not empty_out
        self._donate: dict[int, int] = {}  # output k -> input i written in place (`donate`)
        self.executable = executable  # (sets _call)
        # NVTX ranges only where a tool listens (nsys/ncu inject a library through this
        # variable; without one every range call is a no-op that still costs host time)
        self._nvtx = device_type == "cuda" and bool(os.environ.get("NVTX_INJECTION64_PATH"))

    def donate(self, wanted: dict[int, int]) -> dict[int, int]:
        """Computes output k into input i's own buffer and returns that input as output k, for
        the pairs of `wanted` ({k: i}) that the compiled program proves safe (its `in_place`:
        one elementwise kernel is all that reads the input and writes the output, element for
        element). For a caller that would copy output k into input i anyway (AOTAutograd's
        input mutations: frontends/dynamo.py); that copy is then a copy onto itself, which
        torch skips. Such a partition is called through `_forward` (the executable's `run`
        with those inputs as outputs), not the fast paths. Returns the pairs taken."""
        n, exe = len(self.signature.inputs), self._executable
        program = getattr(exe, "program", None)
        safe = set(getattr(program, "in_place", ())) if hasattr(exe, "run") and program is not None else set()
        self._donate = {k: i for k, i in wanted.items() if (i, n + k) in safe}
        if self._donate:
            # `run` with the inputs as those outputs (the fast `call` paths allocate their own)
            self._call = self._guarded = None
            if hasattr(exe, "donate"):  # (vortex: the kernels get the input's device buffer)
                exe.donate = dict(self._donate)
        return self._donate

    @property
    def executable(self) -> Executable:
        return self._executable

    @executable.setter
    def executable(self, executable: Executable) -> None:  # (a replaced one is called, not the old)
        self._executable = executable
        self._donate = {}  # (a donation holds for the executable it was set on: `donate`)
        self._call = getattr(executable, "call", None) if self._fast else None
        self._guarded = getattr(executable, "call_guarded", None) if self._fast else None

    def ir(self, stage: str) -> str:
        if stage not in self.stages:
            raise KeyError(f"no stage {stage!r}; stages: {list(self.stages)}")
        return self.stages[stage]

    def check_inputs(self, args: Sequence) -> list[tuple[int, ...]]:
        """Raises GacInputError on a mismatch; returns the output shapes for these inputs."""
        if len(args) != len(self.signature.inputs):
            raise GacInputError(f"{self.name}: expected {len(self.signature.inputs)} inputs, got {len(args)}")
        for i, (a, spec) in enumerate(zip(args, self.signature.inputs)):
            what = f"{self.name}: input {i} ({self.input_names[i]})"
            if isinstance(spec, SizeSpec):
                if not isinstance(a, (int, torch.SymInt)) or isinstance(a, bool):
                    raise GacInputError(f"{what}: expected a size (int), got {type(a).__name__}")
                continue
            if not isinstance(a, torch.Tensor):
                raise GacInputError(f"{what}: expected a tensor, got {type(a).__name__}")
            if a.dtype != spec.dtype:
                raise GacInputError(f"{what}: expected dtype {spec.dtype}, got {a.dtype}")
            if a.dim() != len(spec.shape) or any(
                    isinstance(s, int) and s != n for s, n in zip(spec.shape, a.shape)):
                raise GacInputError(f"{what}: expected shape {list(spec.shape)}, got {list(a.shape)}")
            if a.device.type != self.device_type and not is_host_scalar(a):
                raise GacInputError(f"{what}: compiled for {self.device_type} tensors, got one on {a.device}")
            if a.layout != torch.strided:
                raise GacInputError(f"{what}: expected a dense (strided) tensor, got {a.layout}")
        if not self.signature.dynamic:
            return [s.shape for s in self.signature.outputs]
        key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else int(a) for a in args)
        if key not in self._shapes:
            sizes = self._bind(args)
            shapes = [tuple(_evaluate(d, sizes) for d in s.shape) for s in self.signature.outputs]
            if len(self._shapes) >= 64:
                self._shapes.clear()
            self._shapes[key] = shapes
        return self._shapes[key]

    def _bind(self, args: Sequence) -> dict:
        """The size symbols' values for these inputs; raises if the inputs disagree."""
        pairs = []
        for a, spec in zip(args, self.signature.inputs):
            if isinstance(spec, SizeSpec):
                pairs.append((spec.expr, int(a)))
            else:
                pairs += [(s, int(n)) for s, n in zip(spec.shape, a.shape) if not isinstance(s, int)]
        sizes, errors = bind_all(pairs)
        if errors:
            raise GacInputError(f"{self.name}: inputs disagree on their sizes: {errors[0]}")
        return sizes

    def boxed(self, args: Sequence) -> Sequence:
        """The call with its arguments as one sequence, returning every output in a sequence
        (AOTAutograd's boxed convention: what torch.compile calls when this partition is the whole
        graph, frontends/dynamo.py). Per call: the executable's `call` and nothing else, unless
        a profiler or an NVTX tool listens."""
        if _profiler._is_profiler_enabled or self._nvtx:
            with _ranges(self._range, self._nvtx):
                return self._outputs(args)
        call = self._call
        if call is not None:
            outs = call(args)
            if outs is not None:
                return outs
        return self._forward(args)

    boxed._boxed_call = True  # (AOTAutograd then calls it without wrapping)

    def call_args(self, *args) -> Sequence:
        """boxed, with the arguments as they come (what dynamo calls without AOTAutograd)."""
        return self.boxed(args)

    def call_guarded(self, *args) -> Sequence:
        """call_args for arguments whose dtypes, shapes, dense strides and device torch's
        guards have checked (dynamo's, frontends/dynamo.py): the executable's `call_guarded`,
        which reads only their pointers; anything it declines takes the checked path."""
        guarded = self._guarded
        if guarded is not None and not (_profiler._is_profiler_enabled or self._nvtx):
            outs = guarded(args)
            if outs is not None:
                return outs
        return self.boxed(args)

    def forward(self, *args):
        outs = self.boxed(args)
        return tuple(outs) if self.tuple_output else outs[0]

    # Called from the partitioned GraphModule's code once per call: straight to forward, without
    # nn.Module.__call__'s hook dispatch (nothing hooks a compiled partition).
    __call__ = forward

    def _outputs(self, args: Sequence) -> Sequence:
        if self._call is not None:
            outs = self._call(args)
            if outs is not None:
                return outs
        return self._forward(args)

    def _forward(self, args: Sequence) -> list:
        """Every call the executable's `call` declines (or that it lacks): the inputs checked,
        host scalars moved and strided inputs made dense, fresh outputs, `run`."""
        out_shapes = self.check_inputs(args)
        # dense row-major buffers on the target's device; size arguments as ints
        device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == self.device_type),
                      torch.device(self.device_type))
        inputs = [(a.to(device) if is_host_scalar(a) and a.device != device else a.contiguous())
                  if isinstance(a, torch.Tensor) else int(a) for a in args]
        donate = self._donate  # (an input made dense above is a copy: that output is fresh)
        outputs = [args[donate[k]] if k in donate and inputs[donate[k]] is args[donate[k]]
                   else torch.empty(shape, dtype=s.dtype, device=device)
                   for k, (shape, s) in enumerate(zip(out_shapes, self.signature.outputs))]
        # Statically empty outputs are made here, not by the program (legalize/context.py);
        # empty inputs still run it (a reduction over an empty dim gives its identity).
        live = [o for o, s in zip(outputs, self.signature.outputs)
                if not any(isinstance(d, int) and d == 0 for d in s.shape)]
        if any(o.numel() for o in live):
            self.executable.run(inputs, live)
        return outputs


@contextlib.contextmanager
def _ranges(name: str, nvtx: bool):
    """A torch.profiler range per partition (only while profiling), and an NVTX range where
    an NVTX tool is attached."""
    with torch.profiler.record_function(name) if torch.autograd.profiler._is_profiler_enabled \
            else contextlib.nullcontext():
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()


def is_host_scalar(t: torch.Tensor) -> bool:
    """A 0-d CPU tensor: eager accepts it next to device tensors (as a scalar), so do we."""
    return t.dim() == 0 and t.device.type == "cpu"


def _evaluate(expr, sizes: dict) -> int:
    if isinstance(expr, int):
        return expr
    value = expr.xreplace({k: sympy.Integer(v) for k, v in sizes.items()})
    if not value.is_number:
        raise GacInputError(f"size {expr} depends on sizes no input gives ({sorted(map(str, value.free_symbols))})")
    return int(value)
