"""gac_torch.compile(ExportedProgram | nn.Module): torch.export -> core ATen -> gac."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from gac_torch.backends import get_target
from gac_torch.errors import GacInputError
from gac_torch.frontends.decompose import decompose_program
from gac_torch.frontends.export_semantics import ExportSemantics
from gac_torch.frontends.fx import CompiledFx, compile_graph, compile_once_or_reason
from gac_torch.frontends.specialize import ShapeSpecializing
from gac_torch.frontends.torch_state import tracing
from gac_torch.legalize import decompositions
from gac_torch.legalize.sizes import size_expr
from gac_torch.passes.partition import GraphReport
from gac_torch.runtime import artifact, cache
from gac_torch.runtime.compiled import is_host_scalar
from gac_torch.runtime.sizes import bind_all


def _lifted_value(ep: ExportedProgram, spec) -> torch.Tensor:
    if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
        if spec.target in ep.state_dict:
            return ep.state_dict[spec.target]
        return ep.constants[spec.target]
    if spec.kind == InputKind.CONSTANT_TENSOR:
        return ep.constants[spec.target]
    raise TypeError(f"unsupported exported input kind {spec.kind}")


class SpecializedFx:
    """A program whose symbolic sizes gac compiles per shape (specialization_reason): the
    CompiledFx interface over the most recent specialization."""

    def __init__(self, gm, options: dict, reason: str):
        self.target = options["target"]
        self.dynamic = False
        self.reason = reason
        self.specializing = ShapeSpecializing(gm, lambda g: compile_graph(g, options), reason=reason)

    def __call__(self, *args):
        return self.specializing(*args)

    def _latest(self) -> CompiledFx:
        if self.specializing.latest is None:
            raise KeyError(f"compiled per input shape ({self.reason}): call the program first")
        return self.specializing.latest

    @property
    def report(self):
        return self._latest().report

    @property
    def partitions(self):
        return self._latest().partitions

    def ir(self, stage: str) -> str:
        return self._latest().ir(stage)


class CompiledProgram:
    """A compiled ExportedProgram: call it like the original module. Inputs with export `Dim`s
    take any size in the Dim's range; `dynamic` says whether one compilation serves them all.
    Mutations of inputs and buffers, view outputs and autograd behave as eager's
    (export_semantics.py)."""

    def __init__(self, ep: ExportedProgram, compiled: CompiledFx | SpecializedFx,
                 semantics: ExportSemantics | None = None):
        self.exported_program = ep
        self.compiled = compiled
        # from the functional graph before compile_graph rewrote it (its eager copy is what a
        # backward recomputes); ep's graph serves only where it is still eager ATen
        self.semantics = semantics or ExportSemantics(ep, ep.graph_module)
        self.dynamic = compiled.dynamic
        specs = ep.graph_signature.input_specs
        self._lifted = [(i, _lifted_value(ep, s)) for i, s in enumerate(specs) if s.kind != InputKind.USER_INPUT]
        self._user_positions = [i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT]
        self._user_names = [s.arg.name for s in specs if s.kind == InputKind.USER_INPUT]
        placeholders = [n for n in ep.graph_module.graph.nodes if n.op == "placeholder"]
        self._user_meta = [placeholders[i].meta.get("val") for i in self._user_positions]
        self._n_inputs = len(specs)
        self._device = get_target(compiled.target).device_type
        self._on_device = False  # parameters move to the target's device on the first call
        # is_Integer, not is_finite: torch's int_oo calls itself finite (an upper bound of
        # int_oo appears e.g. for the stride symbols of a non-contiguous example input).
        self._ranges = {sym: (int(r.lower) if r.lower.is_Integer else 0,
                              int(r.upper) if r.upper.is_Integer else None)
                        for sym, r in ep.range_constraints.items()}
        self._sizes_ok: set[tuple] = set()  # input sizes already checked
        self.user_program = ep  # the caller's program (compile_exported sets it): run on aliased inputs
        self._mutated_user = [k for k, i in enumerate(self._user_positions) if i in self.semantics.mutated_inputs]

    @property
    def report(self):
        return self.compiled.report

    def ir(self, stage: str) -> str:
        return self.compiled.ir(stage)

    @property
    def stages(self) -> list[str]:
        return list(next(iter(self.compiled.partitions.values())).stages) if self.compiled.partitions else []

    def _check_shape(self, name: str, got: torch.Tensor, want: torch.Tensor, pairs: list) -> None:
        """Static dims must match; symbolic ones are collected for bind_all (`pairs`)."""
        expected = [s if isinstance(s, int) else size_expr(s) for s in want.shape]
        shown = "[" + ", ".join(map(str, expected)) + "]"
        if got.dim() != len(expected) or any(isinstance(s, int) and s != n for s, n in zip(expected, got.shape)):
            raise GacInputError(f"input {name!r}: expected shape {shown}, got {list(got.shape)}")
        pairs += [(s, int(n)) for s, n in zip(expected, got.shape) if not isinstance(s, int)]

    def _check_sizes(self, pairs: list) -> None:
        """The inputs agree on every size symbol, and each is in its exported range (sympy work:
        done once per distinct input sizes)."""
        key = tuple(n for _, n in pairs)
        if key in self._sizes_ok:
            return
        sizes, errors = bind_all(pairs)
        if errors:
            raise GacInputError(f"inputs disagree on their sizes: {errors[0]}")
        for sym, n in sizes.items():
            lo, hi = self._ranges.get(sym, (0, None))
            if n < lo or (hi is not None and n > hi):
                raise GacInputError(f"size {sym} = {n} is outside the exported range "
                                    f"[{lo}, {hi if hi is not None else 'inf'}]")
        if len(self._sizes_ok) < 256:
            self._sizes_ok.add(key)

    def _check(self, flat: Sequence[Any]) -> None:
        pairs: list = []
        if len(flat) != len(self._user_meta):
            raise GacInputError(f"expected {len(self._user_meta)} inputs, got {len(flat)}")
        for name, got, want in zip(self._user_names, flat, self._user_meta):
            if not isinstance(want, torch.Tensor):
                continue
            if not isinstance(got, torch.Tensor):
                raise GacInputError(f"input {name!r}: expected a tensor, got {type(got).__name__}")
            if got.dtype != want.dtype:
                raise GacInputError(f"input {name!r}: expected dtype {want.dtype}, got {got.dtype}")
            self._check_shape(name, got, want, pairs)
            if got.device.type != self._device and not is_host_scalar(got):
                raise GacInputError(f"input {name!r}: compiled for {self._device} tensors, got one on {got.device}")
        if pairs:
            self._check_sizes(pairs)

    def __call__(self, *args, **kwargs):
        if not self._on_device:
            get_target(self.compiled.target).check_available()  # e.g. cuda without a GPU: say so
            self._lifted = [(i, t.to(self._device)) for i, t in self._lifted]
            self._on_device = True
        flat, _ = pytree.tree_flatten((args, kwargs))
        self._check(flat)
        if self._mutated_user and _mutated_input_aliases(flat, self._mutated_user):
            # The functional graph reads every input before any write; eager's in-place write
            # into a storage another input views changes what that input reads.
            warnings.warn("gac: an input the program mutates shares memory with another input; "
                          "running the exported program eagerly (torch.export's graph assumes "
                          "distinct inputs)", stacklevel=2)
            return self.user_program.module()(*args, **kwargs)
        full: list[Any] = [None] * self._n_inputs
        for i, t in self._lifted:
            full[i] = t
        for i, t in zip(self._user_positions, flat):
            full[i] = t
        user = self.semantics.run(self.compiled, full)
        return pytree.tree_unflatten(user, self.exported_program.call_spec.out_spec)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' element ranges in one storage intersect (conservative: the span
    from the lowest to the highest element of each)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        lo = t.storage_offset() * t.element_size()
        extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
        return lo, lo + (extent + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _mutated_input_aliases(flat: Sequence[Any], mutated: list[int]) -> bool:
    tensors = [(k, t) for k, t in enumerate(flat) if isinstance(t, torch.Tensor)]
    return any(k != j and _overlap(flat[k], t) for k in mutated for j, t in tensors)


def _device_of(ep: ExportedProgram) -> str:
    for n in ep.graph_module.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor):
            return v.device.type
    return "cpu"


def device_with_index(device: str) -> torch.device:
    """"cuda" -> cuda:<current>: a tensor moved to "cuda" reports cuda:0, and export's metadata
    asserts (`_assert_tensor_metadata(device=...)`) compare the two ("Expected: cuda, Got: cuda:0")."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return d


def _from_cache(user_ep: ExportedProgram, hit) -> CompiledProgram:
    """A cached program (runtime/artifact.py) bound to the caller's parameters and buffers."""
    manifest, saved_ep, partitions = hit
    r = manifest["report"]
    report = GraphReport(r["total"], r["compiled"], r["partitions"],
                         Counter({(op, why): n for op, why, n in r["unsupported"]}))
    compiled = CompiledProgram(saved_ep, CompiledFx(saved_ep.graph_module, report, partitions, manifest["target"],
                                                    dynamic=bool(manifest.get("dynamic"))))
    specs = saved_ep.graph_signature.input_specs
    compiled._lifted = [(i, user_ep.state_dict.get(specs[i].target, t)
                         if specs[i].kind in (InputKind.PARAMETER, InputKind.BUFFER) else t)
                        for i, t in compiled._lifted]
    return compiled


def compile_exported(ep: ExportedProgram, options) -> CompiledProgram:
    target = options["target"] or _device_of(ep)
    options = options.replace(target=target)
    key = None
    if cache.enabled(options):  # the whole program, before torch's decompositions
        key = artifact.program_key(ep, options)
        hit = artifact.cached_program(key, options, ep)
        if hit is not None:
            compiled = _from_cache(ep, hit)
            compiled.user_program = ep
            return compiled
    compiled = _compile_exported(ep, options)
    compiled.user_program = ep
    if key is not None and isinstance(compiled.compiled, CompiledFx):
        artifact.remember_program(key, compiled)
    return compiled


def _compile_exported(ep: ExportedProgram, options) -> CompiledProgram:
    target = options["target"]
    device = get_target(target).device_type
    with tracing():  # torch's tracing is not thread-safe; gac's compile below is
        if device != _device_of(ep) and (device != "cuda" or torch.cuda.is_available()):
            # A program exported on the CPU, compiled for a GPU: re-home its constants and device
            # arguments so that eager fallback nodes and compiled partitions agree.
            from torch.export.passes import move_to_device_pass
            ep = move_to_device_pass(ep, device_with_index(device))
        ep = decompose_program(ep, decompositions())  # (torch's run_decompositions, faster)
    gm = ep.graph_module
    semantics = ExportSemantics(ep, gm)  # before compile_graph rewrites gm
    compiled, reason = compile_once_or_reason(gm, options)
    return CompiledProgram(ep, compiled if compiled is not None else SpecializedFx(gm, options, reason),
                           semantics)


def export_module(model: torch.nn.Module, example_inputs: Sequence[Any]) -> ExportedProgram:
    with tracing():
        return torch.export.export(model, tuple(example_inputs))
