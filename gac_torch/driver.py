"""The driver: one FX partition -> gac -> linalg -> the target's stages -> a loaded executable."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.fx as fx
from mlir import ir

from gac_torch.backends import SizeSpec, Signature, Target, TensorSpec
from gac_torch.errors import TargetUnavailable
from gac_torch.ir.dialect import make_context
from gac_torch.ir.verifier import verify_gac
from gac_torch.legalize import build_module
from gac_torch.legalize.context import is_empty_output
from gac_torch.legalize.sizes import size_expr
from gac_torch.passes.attention import fuse_attention
from gac_torch.passes.channels_last import channels_last
from gac_torch.passes.concat_sum import split_concat_sum
from gac_torch.passes.dce import gac_dce
from gac_torch.passes.fusion import annotate_kernels
from gac_torch.lowering import lower_to_linalg
from gac_torch.runtime import cache, progress
from gac_torch.runtime.compiled import CompiledGraph

log = logging.getLogger("gac_torch")


_NO_TEXT = object()


def stage_text(artifact: Any) -> str:
    if isinstance(artifact, ir.Module):
        return str(artifact)
    if isinstance(artifact, bytes):
        return artifact.decode(errors="replace")
    if isinstance(artifact, str):
        return artifact
    # (repr only without a text: as getattr's default it was made every time, ~0.4 s per
    # BEVFormer-tiny cuda compile for its three stages, the PTX program's repr above all)
    text = getattr(artifact, "text", _NO_TEXT)
    return repr(artifact) if text is _NO_TEXT else text


class _Unavailable:
    def __init__(self, error: TargetUnavailable, in_place: tuple = ()):
        self.error = error
        self.in_place = in_place  # (what CompiledGraph.donate would take: offline tests)

    def run(self, inputs, outputs) -> None:
        raise TargetUnavailable(str(self.error))


def _spec(node: fx.Node) -> TensorSpec | SizeSpec:
    v = node.meta["val"]
    if isinstance(v, torch.SymInt):
        return SizeSpec(size_expr(v))
    dims = tuple(s if isinstance(s, int) else size_expr(s) for s in v.shape)
    return TensorSpec(tuple(int(d) if getattr(d, "is_Integer", False) else d for d in dims), v.dtype)


def _specs(nodes) -> tuple:
    return tuple(_spec(n) for n in nodes)


def _run_stages(module: ir.Module, target: Target, options: dict):
    """gac -> linalg -> the target's stages: (last artifact, stage texts, binary stages)."""
    stages: dict[str, str] = {}
    binaries: dict[str, bytes] = {}  # stages whose artifact carries a binary (e.g. .vxbin)
    progress.step("stage linalg")
    with progress.timed("lower_to_linalg"):
        artifact: Any = lower_to_linalg(module)
    with progress.timed("annotate_kernels"):
        annotate_kernels(module, artifact)
    with progress.timed("gac and linalg texts"):
        stages["gac"] = str(module)  # with the fusion groups (gac.kernel) annotate_kernels added
        stages["linalg"] = str(artifact)
    deferred = {}  # stage name -> an artifact the next stages leave as it is: printed at the end
    with progress.timed("target stages (imports)"):
        target_stages = target.stages(options)
    for stage in target_stages:
        progress.step(f"stage {stage.name}")
        artifact = stage.run(artifact)
        if getattr(artifact, "defer_text", False):
            stages[stage.name], deferred[stage.name] = "", artifact  # (the stages' order kept)
        else:
            with progress.timed("stage text"):
                stages[stage.name] = stage_text(artifact)
        if isinstance(getattr(artifact, "binary", None), bytes):
            binaries[stage.name] = artifact.binary
    for name, done in deferred.items():
        with progress.timed(f"{name} stage text"):
            stages[name] = stage_text(done)
    return artifact, stages, binaries


def _load(target: Target, artifact: Any, signature: Signature, options: dict):
    try:
        target.check_available()
        return target.load(artifact, signature, options)
    except TargetUnavailable as e:
        # Compiling needs no device (e.g. PTX on a CPU machine); running does: fail then, clearly.
        return _Unavailable(e, tuple(getattr(artifact, "in_place", ())))


def _autotune(module: ir.Module, target: Target, signature: Signature, options: dict) -> None:
    """Let the target measure its tile candidates on this partition (before the cache key is
    made: the key holds the tuning table's digest). Each variant compiles a fresh copy."""
    text = str(module)

    def build():
        artifact, _, _ = _run_stages(ir.Module.parse(text), target, options)
        return _load(target, artifact, signature, options)

    progress.step("autotune")
    target.tune(build, signature, options)  # type: ignore[misc]


_pack_warned: set[str] = set()


def pack_entry(target: Target, artifact: Any, stages: dict, binaries: dict, options: dict,
               required: bool = False) -> cache.Entry | None:
    """The artifact as plain data (a cache entry); None when the target finds it not worth
    caching. Raises when it cannot (e.g. no linker for cpu native code)."""
    packed = target.pack(artifact, options, required) if target.pack else None
    if packed is None:
        if required:
            raise ValueError(f"target {target.name} cannot save its compiled partitions")
        return None
    meta, blobs = packed
    blobs = dict(blobs, **{f"stage:{k}": v for k, v in binaries.items()})
    return cache.Entry(meta, blobs, stages)


def _pack(target: Target, artifact: Any, stages: dict, binaries: dict, options: dict) -> cache.Entry | None:
    try:
        return pack_entry(target, artifact, stages, binaries, options)
    except Exception as e:  # the cache is an optimization: never fail a compile for it
        if target.name not in _pack_warned:
            _pack_warned.add(target.name)
            log.warning("gac cache: %s partitions are not cached: %s", target.name, e)
        return None


def _unpack(target: Target, entry: cache.Entry, signature: Signature, options: dict):
    """The executable of a cache entry; None if it does not load (then recompiled)."""
    try:
        target.check_available()
        return target.unpack(entry.meta, entry.blobs, signature, options)  # type: ignore[misc]
    except TargetUnavailable as e:
        return _Unavailable(e)
    except Exception as e:
        log.warning("gac cache: an entry for target %s does not load (%s); recompiling", target.name, e)
        return None


def compile_partition(gm: fx.GraphModule, name: str, target: Target, options: dict,
                      dump_dir: str | None = None) -> CompiledGraph:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out_node.args[0]
    tuple_output = isinstance(outs, (list, tuple))
    outs = list(outs) if tuple_output else [outs]
    signature = Signature(_specs(placeholders), _specs(outs))
    if signature.dynamic and not target.dynamic_shapes:
        raise ValueError(f"target {target.name} compiles static shapes only (this partition has run-time sizes)")

    ctx = make_context()
    with progress.timed("build_module"):
        module = build_module(gm, ctx)
    with progress.timed("gac passes"):
        module = split_concat_sum(fuse_attention(gac_dce(module)))  # before verify: it checks the result
        if options.get("channels_last") if options.get("channels_last") is not None else target.channels_last:
            module = channels_last(module)  # (after fuse_attention, which matches NCHW patterns)
    with ctx, ir.Location.unknown(), progress.timed("verify"):
        module.operation.verify()  # IRDL: operand counts, attribute kinds, enums
        if options.get("verify", True):
            verify_gac(module)  # shapes and dtypes
    with ctx, ir.Location.unknown():
        # statically empty outputs are made by the runtime, never by the program (runtime/compiled.py)
        live = Signature(signature.inputs, tuple(o for o in signature.outputs if not is_empty_output(o)))
        if options.get("autotune") and target.tune is not None:
            _autotune(module, target, live, options)
        with progress.timed("key and lookup"):
            key = (cache.cache_key(str(module), repr(signature), options, target.name, target.cache_key(options))
                   if target.pack and cache.enabled(options) else None)
            entry = cache.load(key) if key else None
        executable = _unpack(target, entry, live, options) if entry else None
        if executable is None:  # a miss (or an entry that would not load)
            artifact, stages, binaries = _run_stages(module, target, options)
            entry = _pack(target, artifact, stages, binaries, options) if key else None
            if entry is not None:
                cache.store_later(key, entry)  # (packed and written behind the compile)
                executable = _unpack(target, entry, live, options)
            if executable is None:
                executable = _load(target, artifact, live, options)
        else:
            stages = entry.stages
            binaries = {k.removeprefix("stage:"): v for k, v in entry.blobs.items() if k.startswith("stage:")}
            artifact = None
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        with open(os.path.join(dump_dir, f"{name}.fx.txt"), "w") as f:
            f.write(str(gm.graph))
        for stage, text in stages.items():
            if stage in binaries:  # the dump holds the bytes; ir(stage) the description
                with open(os.path.join(dump_dir, f"{name}.{stage}"), "wb") as fb:
                    fb.write(binaries[stage])
                continue
            with open(os.path.join(dump_dir, f"{name}.{stage}"), "w") as f:
                f.write(text)
    cg = CompiledGraph(name, executable, signature, target.device_type, stages,
                       [p.name for p in placeholders], tuple_output, fx_graph=str(gm.graph))
    # what gac_torch.save needs: the plain-data entry, else the artifact to pack on demand
    cg.saved = (target, entry, artifact if entry is None else None, binaries, options)
    cg.out_vals = [n.meta.get("val") for n in outs]  # fake outputs: a saved graph's metadata
    return cg


SHARED_STAGES = ("gac", "linalg")


def compile_from_stage(text: str, stage: str, target: Target, options: dict) -> tuple[dict[str, str], Any]:
    """Resume a compile from one stage's dumped (possibly edited) text: run every later stage.
    Returns the text of each stage run (the given one first) and the last artifact (stages
    only: nothing is loaded on a device, e.g. cuda's GpuProgram with its PTX)."""
    target_stages = target.stages(options)
    names = [*SHARED_STAGES, *(st.name for st in target_stages)]
    if stage not in names:
        raise ValueError(f"{stage!r} is not a stage of target {target.name}; its stages: {', '.join(names)}")
    stages: dict[str, str] = {stage: text}
    if stage in SHARED_STAGES:
        ctx = make_context()
        module = ir.Module.parse(text, ctx)
        with ctx, ir.Location.unknown():
            module.operation.verify()
            if stage == "gac":
                if options.get("verify", True):
                    verify_gac(module)
                module = lower_to_linalg(module)
                stages["linalg"] = str(module)
        artifact: Any = module  # the stages rewrite it in place (its text is recorded)
        rest = target_stages
    else:
        at = [st.name for st in target_stages].index(stage)
        if target_stages[at].parse is None:
            resumable = [*SHARED_STAGES, *(st.name for st in target_stages if st.parse)]
            raise ValueError(f"target {target.name} cannot resume from its {stage!r} stage; "
                             f"it can from: {', '.join(resumable)}")
        artifact, rest = target_stages[at].parse(text), target_stages[at + 1:]
    for st in rest:
        artifact = st.run(artifact)
        stages[st.name] = stage_text(artifact)
    return stages, artifact


__all__ = ["compile_partition", "compile_from_stage", "SHARED_STAGES"]
