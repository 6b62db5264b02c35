"""gac_torch.save / gac_torch.load: a compiled torch.export program as one file that runs in a new
process without MLIR and without re-exporting.

The file is a zip:
  manifest.json        format and version, gac / torch versions and platform, the target, and
                       per file its sha256; per partition its signature and calling convention
  program.pt2          torch.export.save of the partitioned program: eager (fallback) nodes as
                       they were, each compiled partition a call to the custom op
                       `gac::partition(name, tensors, sizes)`, parameters and constants (a whole
                       program in the compile cache leaves parameters and buffers out, as meta
                       tensors, manifest "weights": "caller": a hit takes the caller's; such a
                       file is no artifact gac_torch.load accepts)
  program.json         (compile-cache entries only, where the graph is partition calls only)
                       the same graph as plain JSON, rebuilt around the caller's program
                       without torch.export.load (runtime/program_json.py)
  partitions/<p>.gac   each partition as plain data (runtime/cache.py's entry format): native
                       code (cpu .so, cuda PTX + host program as JSON, vortex .vxbin + launches)

Nothing is unpickled by gac. A file from another gac version, platform or target, or whose bytes
do not match the manifest's checksums, is refused with ArtifactError. Checksums detect damage and
edits, not a malicious author who rewrites them: load artifacts you trust, as any native code.
Not saved (yet): ONNX programs, and programs compiled once per input shape.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import operator
import zipfile
from collections.abc import Sequence
from typing import Any

import torch

from gac_torch.backends import get_target
from gac_torch.errors import GacError, TargetUnavailable
from gac_torch.frontends.torch_state import TRACE_LOCK
from gac_torch.backends.base import Signature, SizeSpec, TensorSpec
from gac_torch.options import Options, resolve
from gac_torch.runtime import cache, program_json
from gac_torch.runtime.compiled import CompiledGraph
from gac_torch.runtime.plain import PlainDataError, decode_size, encode_size


log = logging.getLogger("gac_torch")
FORMAT = "gac-torch-artifact"
VERSION = 1
_PARTITIONS: dict[str, CompiledGraph] = {}  # gac::partition's name argument -> loaded partition
_lib: Any = None


class ArtifactError(GacError, ValueError):
    """The file is not a gac artifact this installation can run."""


# -- the custom op standing for a compiled partition ---------------------------------------------

def _define_op() -> None:
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("gac", "FRAGMENT")
    _lib.define("partition(str name, Tensor[] tensors, SymInt[] sizes) -> Tensor[]")
    _lib.impl("partition", _run_partition, "CompositeExplicitAutograd")
    torch.library.register_fake("gac::partition", _fake_partition, lib=_lib)


def _arguments(cg: CompiledGraph, tensors: Sequence, sizes: Sequence) -> list:
    it_t, it_s = iter(tensors), iter(sizes)
    return [next(it_s) if isinstance(s, SizeSpec) else next(it_t) for s in cg.signature.inputs]


def _run_partition(name: str, tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[torch.Tensor]:
    cg = _PARTITIONS.get(name)
    if cg is None:
        raise ArtifactError(f"gac partition {name!r} is not loaded (gac_torch.load the artifact first)")
    out = cg(*_arguments(cg, tensors, sizes))
    return list(out) if cg.tuple_output else [out]


def _fake_partition(name: str, tensors: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[torch.Tensor]:
    cg = _PARTITIONS[name]
    device = next((t.device for t in tensors), torch.device(cg.device_type))
    return [torch.empty(s.shape, dtype=s.dtype, device=device) for s in cg.signature.outputs]


# -- save ----------------------------------------------------------------------------------------

def _spec_json(s: TensorSpec | SizeSpec) -> dict:
    """A signature entry as JSON; run-time sizes as plain.encode_size expressions."""
    if isinstance(s, SizeSpec):
        return {"size": encode_size(s.expr)}
    return {"shape": [encode_size(d) for d in s.shape], "dtype": str(s.dtype).removeprefix("torch.")}


def _entry(cg: CompiledGraph) -> cache.Entry:
    from gac_torch.driver import pack_entry

    target, entry, artifact, binaries, options = cg.saved
    if entry is None:
        entry = pack_entry(target, artifact, cg.stages, binaries, options, required=True)
    return entry


def _inline(graph: torch.fx.Graph, sub: torch.fx.GraphModule, args: list) -> Any:
    """Copies an eager partition's ATen nodes into `graph`; returns its output node(s)."""
    local: dict = {}
    placeholders = iter(args)
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            local[n] = next(placeholders)
        elif n.op == "output":
            out = n.args[0]
            return [local[o] for o in out] if isinstance(out, (list, tuple)) else local[out]
        elif n.op == "call_function":
            local[n] = graph.node_copy(n, lambda m: local[m])
        else:
            raise ArtifactError(f"cannot save an eager partition holding a {n.op} node")
    raise ArtifactError("an eager partition without an output")


def _without_values(state_dict: dict) -> dict:
    """Parameters and buffers as meta tensors: shapes and kinds kept, no bytes to save or load."""
    def meta(t: torch.Tensor) -> torch.Tensor:
        m = t.detach().to("meta")
        return torch.nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else m

    return {k: meta(v) if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}


def _saved_program(compiled: Any, names: dict[str, str], weights: bool = True) -> torch.export.ExportedProgram:
    """The partitioned graph as an ExportedProgram: each CompiledGraph call -> gac::partition;
    without `weights`, parameters and buffers are meta tensors."""
    from torch.export.exported_program import ExportedProgram
    from torch.export.graph_signature import ExportGraphSignature, OutputSpec, TensorArgument

    ep = compiled.exported_program
    fused = compiled.compiled.gm
    graph = torch.fx.Graph()
    env: dict = {}
    inlined: dict = {}  # a partition left to eager (its compile failed) -> its output values
    out_node = None
    for node in fused.graph.nodes:
        if node.op == "call_module" and not isinstance(getattr(fused, node.target), CompiledGraph):
            inlined[node] = _inline(graph, getattr(fused, node.target), [env[a] for a in node.args])
            env[node] = inlined[node] if isinstance(inlined[node], torch.fx.Node) else None
            continue
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in inlined:
            env[node] = inlined[node.args[0]][node.args[1]]
            continue
        if node.op == "call_module" and isinstance(getattr(fused, node.target), CompiledGraph):
            cg = getattr(fused, node.target)
            args = [env[a] if isinstance(a, torch.fx.Node) else a for a in node.args]
            tensors = [a for a, s in zip(args, cg.signature.inputs) if not isinstance(s, SizeSpec)]
            sizes = [a for a, s in zip(args, cg.signature.inputs) if isinstance(s, SizeSpec)]
            call = graph.call_function(torch.ops.gac.partition.default, (names[node.target], tensors, sizes))
            call.meta["val"] = list(cg.out_vals)
            if cg.tuple_output:
                env[node] = call
            else:
                env[node] = graph.call_function(operator.getitem, (call, 0))
                env[node].meta["val"] = cg.out_vals[0]
            continue
        new = graph.node_copy(node, lambda n: env[n])
        if node.op == "call_function" and node.target is torch.ops.gac.partition.default:
            # a program that was itself loaded (e.g. a cache hit): its partitions' new names
            new.args = (names[_PARTITIONS[node.args[0]].name], *new.args[1:])
        if node.op == "call_function" and node.target is operator.getitem and "val" not in new.meta:
            src = node.args[0]
            if src.op == "call_module":
                new.meta["val"] = getattr(fused, src.target).out_vals[node.args[1]]
        env[node] = new
        if node.op == "output":
            out_node = new
    graph.lint()
    root = torch.fx.GraphModule(fused, graph)
    outs = out_node.args[0] if out_node is not None else []
    sig = ep.graph_signature
    out_specs = [OutputSpec(kind=s.kind, arg=TensorArgument(name=o.name) if isinstance(s.arg, TensorArgument) else s.arg,
                            target=s.target) for s, o in zip(sig.output_specs, outs)]
    signature = ExportGraphSignature(input_specs=list(sig.input_specs), output_specs=out_specs)
    state_dict = ep.state_dict if weights else _without_values(ep.state_dict)
    return ExportedProgram(root=root, graph=graph, graph_signature=signature, state_dict=state_dict,
                           range_constraints=ep.range_constraints, module_call_graph=ep.module_call_graph,
                           example_inputs=None, constants=ep.constants, verifiers=[ep.verifier])


def save(compiled: Any, path: str) -> None:
    """Writes a program compiled from torch.export (gac_torch.compile) to `path` (see module doc)."""
    data = to_bytes(compiled)
    with open(path, "wb") as f:
        f.write(data)


def to_bytes(compiled: Any, weights: bool = True) -> bytes:
    """The artifact's bytes; without `weights` (the compile cache), parameter and buffer values
    are left to whoever reads it (they are inputs of the compiled code, not part of it)."""
    from gac_torch.frontends.export import CompiledProgram, SpecializedFx

    if not isinstance(compiled, CompiledProgram):
        raise ArtifactError(f"gac_torch.save takes what gac_torch.compile returns for a torch.export "
                            f"program or nn.Module, got {type(compiled).__name__}")
    if isinstance(compiled.compiled, SpecializedFx):
        raise ArtifactError("this program is compiled once per input shape; saving it is not supported yet")
    with TRACE_LOCK:  # (torch's tracing state; and gac_torch.save beside the cache's writer thread)
        return _to_bytes(compiled, weights)


def _to_bytes(compiled: Any, weights: bool) -> bytes:
    _define_op()
    parts = compiled.compiled.partitions
    entries = {name: cache.pack_entry(name, _entry(cg)) for name, cg in parts.items()}
    digest = hashlib.sha256(b"".join(entries[n] for n in sorted(entries))).hexdigest()[:16]
    names = {name: f"{digest}/{name}" for name in parts}
    for name, cg in parts.items():
        _PARTITIONS[names[name]] = cg
    buf = io.BytesIO()
    saved = _saved_program(compiled, names, weights)
    torch.export.save(saved, buf)
    files = {"program.pt2": buf.getvalue(), **{f"partitions/{n}.gac": e for n, e in entries.items()}}
    caller = getattr(compiled, "user_program", None)
    desc = program_json.describe(saved, caller) if not weights and caller is not None else None
    if desc is not None:
        files["program.json"] = json.dumps(desc).encode()
    report = compiled.compiled.report
    manifest = {
        "format": FORMAT, "version": VERSION, "target": compiled.compiled.target,
        "versions": cache.versions(), "dynamic": bool(compiled.dynamic),
        "weights": "included" if weights else "caller",
        "files": {f: hashlib.sha256(data).hexdigest() for f, data in files.items()},
        "partitions": {names[n]: {"file": f"partitions/{n}.gac", "name": n, "device_type": cg.device_type,
                                  "inputs": [_spec_json(s) for s in cg.signature.inputs],
                                  "outputs": [_spec_json(s) for s in cg.signature.outputs],
                                  "input_names": cg.input_names, "tuple_output": cg.tuple_output}
                       for n, cg in parts.items()},
        "report": {"total": report.total, "compiled": report.compiled, "partitions": report.partitions,
                   "unsupported": [[op, why, n] for (op, why), n in report.unsupported.items()]},
    }
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
        for f, data in files.items():
            z.writestr(f, data)
    return out.getvalue()


# -- load ----------------------------------------------------------------------------------------

class LoadedProgram:
    """A loaded artifact: call it like the original module. Runs the saved graph directly with
    its parameters as inputs (no unlifting: ep.module() would copy and recompile the graph)."""

    def __init__(self, ep: torch.export.ExportedProgram, partitions: dict[str, CompiledGraph], target: str):
        from torch.export.graph_signature import InputKind, OutputKind

        self.exported_program = ep
        self.partitions = {cg.name: cg for cg in partitions.values()}
        self.target = target
        specs = ep.graph_signature.input_specs
        self._lifted = {i: (ep.state_dict[s.target] if s.target in ep.state_dict else ep.constants[s.target])
                        for i, s in enumerate(specs) if s.kind != InputKind.USER_INPUT}
        self._user = [i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT]
        self._outs = [i for i, s in enumerate(ep.graph_signature.output_specs) if s.kind == OutputKind.USER_OUTPUT]
        self._n = len(specs)
        self._device = get_target(target).device_type
        self._on_device = False

    def __call__(self, *args, **kwargs):
        import torch.utils._pytree as pytree

        from gac_torch.runtime.compiled import GacInputError

        if not self._on_device:  # parameters move to the target's device on the first call
            self._lifted = {i: t.to(self._device) if isinstance(t, torch.Tensor) else t
                            for i, t in self._lifted.items()}
            self._on_device = True
        flat, _ = pytree.tree_flatten((args, kwargs))
        if len(flat) != len(self._user):
            raise GacInputError(f"expected {len(self._user)} inputs, got {len(flat)}")
        full: list[Any] = [None] * self._n
        for i, t in self._lifted.items():
            full[i] = t
        for i, t in zip(self._user, flat):
            full[i] = t
        outs = self.exported_program.graph_module(*full)
        outs = outs if isinstance(outs, (list, tuple)) else (outs,)
        return pytree.tree_unflatten([outs[i] for i in self._outs], self.exported_program.call_spec.out_spec)

    def ir(self, stage: str) -> str:
        return "\n".join(cg.ir(stage) for cg in self.partitions.values())


def _signature(part: dict) -> Signature:
    def spec(d: dict) -> TensorSpec | SizeSpec:
        try:
            if "size" in d:
                return SizeSpec(decode_size(d["size"]))
            dtype = getattr(torch, d["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise PlainDataError(f"dtype {d['dtype']!r}")
            return TensorSpec(tuple(decode_size(n) for n in d["shape"]), dtype)
        except (PlainDataError, KeyError, TypeError) as e:
            raise ArtifactError(f"bad signature in the manifest: {str(d)[:200]} ({e})") from e

    return Signature(tuple(spec(d) for d in part["inputs"]), tuple(spec(d) for d in part["outputs"]))


def _read(path: str | io.BytesIO) -> tuple[dict, dict[str, bytes]]:
    try:
        with zipfile.ZipFile(path) as z:
            manifest = json.loads(z.read("manifest.json"))
            files = {f: z.read(f) for f in manifest.get("files", {})}
    except (OSError, zipfile.BadZipFile, KeyError, ValueError) as e:
        raise ArtifactError(f"{path}: not a readable gac artifact ({e})") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ArtifactError(f"{path}: format {manifest.get('format')!r} v{manifest.get('version')}; "
                            f"this gac reads {FORMAT} v{VERSION}")
    for f, data in files.items():
        if hashlib.sha256(data).hexdigest() != manifest["files"][f]:
            raise ArtifactError(f"{path}: {f} does not match its checksum (damaged or modified)")
    return manifest, files


def load(path: str, target: str | None = None, options: dict | None = None) -> LoadedProgram:
    """Loads what gac_torch.save wrote; no MLIR, no export. `target`, if given, must match;
    `options` are the target's run-time ones (e.g. vortex_mode, vortex_home)."""
    manifest, ep, loaded = read(path, target, options)
    return LoadedProgram(ep, loaded, manifest["target"])


def read(path: str | io.BytesIO, target: str | None = None, options: dict | None = None,
         caller: torch.export.ExportedProgram | None = None):
    """(manifest, the saved ExportedProgram, its partitions by gac::partition name), checked;
    `options` reach the target's loader (e.g. vortex_mode); `caller` (the program a cache hit
    was keyed on) brings the parameters and buffers of a program saved without them."""
    manifest, files = _read(path)
    external = manifest.get("weights", "included") == "caller"
    if external and caller is None:
        raise ArtifactError(f"{path}: a compile-cache entry without its weights, not a saved artifact "
                            "(gac_torch.save writes those)")
    here, there = cache.versions(), manifest.get("versions", {})
    for what in ("gac", "gac_sources", "torch", "platform"):
        if there.get(what) != here[what]:
            raise ArtifactError(f"{path}: saved with {what} {there.get(what)}, this is {here[what]}; "
                                "compile and save it again with this installation")
    if target is not None and target != manifest["target"]:
        raise ArtifactError(f"{path}: compiled for target {manifest['target']!r}, not {target!r}")
    tgt = get_target(manifest["target"])
    opts = resolve(options, target=manifest["target"])  # the caller's run-time ones (vortex_mode)
    tgt.check_available()
    if tgt.unpack is None:
        raise ArtifactError(f"target {tgt.name} cannot load saved partitions")
    _define_op()
    loaded: dict[str, CompiledGraph] = {}
    for key, part in manifest["partitions"].items():
        try:
            entry = cache.unpack_entry(files[part["file"]], part["name"])
        except (KeyError, cache.CacheError) as e:
            raise ArtifactError(f"{path}: partition {part.get('name')}: {e}") from e
        signature = _signature(part)
        # statically empty outputs are made by CompiledGraph, never by the program
        live = Signature(signature.inputs, tuple(o for o in signature.outputs if not (
            isinstance(o, TensorSpec) and any(isinstance(d, int) and d == 0 for d in o.shape))))
        executable = tgt.unpack(entry.meta, entry.blobs, live, opts)
        cg = CompiledGraph(part["name"], executable, signature, part["device_type"], entry.stages,
                           part["input_names"], part["tuple_output"])
        cg.saved = (tgt, entry, None, {}, {})  # what to_bytes needs to save it again
        loaded[key] = _PARTITIONS[key] = cg
    if external and "program.json" in files:
        try:
            return manifest, program_json.rebuild(json.loads(files["program.json"]), caller), loaded
        except Exception as e:  # noqa: BLE001  (then the torch.export way below)
            log.debug("gac cache: program.json does not fit the caller's program (%s); reading program.pt2", e)
    ep = torch.export.load(io.BytesIO(files["program.pt2"]))
    if external:
        weights = caller.state_dict
        missing = sorted(set(ep.state_dict) - set(weights))
        if missing:
            raise ArtifactError(f"{path}: the caller's program has no {missing[0]!r} ({len(missing)} missing)")
        for k in ep.state_dict:
            ep.state_dict[k] = weights[k]
    return manifest, ep, loaded


# -- whole programs in the on-disk cache (gac_torch.compile's warm path) -------------------------

def program_key(ep: torch.export.ExportedProgram, options: Options) -> str:
    """What decides a compiled torch.export program, before torch's decompositions run (they
    are most of a warm compile): the graph's code (and its subgraphs'), the input metadata,
    signature, output structure, size ranges, tensor constants' bytes, and cache_key's rest (with
    the target's own key: cuda's arch, also when the options leave it to the visible GPU).
    Parameter and buffer values are inputs of the compiled code, not part of it."""
    gm = ep.graph_module
    code = [m.code for _, m in sorted(gm.named_modules()) if isinstance(m, torch.fx.GraphModule)]
    metas = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder":
            metas.append(f"{n.name}: {getattr(v, 'dtype', '')} {getattr(v, 'device', '')} "
                         f"{list(v.shape) if isinstance(v, torch.Tensor) else v} "
                         f"{list(v.stride()) if isinstance(v, torch.Tensor) else ''}")
    consts = hashlib.sha256()
    for name, c in sorted(ep.constants.items()):
        consts.update(name.encode())
        if isinstance(c, torch.Tensor):
            consts.update(str((c.dtype, tuple(c.shape))).encode())
            # reshape: a 0-d tensor cannot be viewed as bytes
            consts.update(c.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            consts.update(repr(c).encode())
    text = "\n".join([*code, *metas, str(ep.graph_signature), str(ep.call_spec.out_spec),
                      repr(sorted((str(k), str(v)) for k, v in ep.range_constraints.items())),
                      consts.hexdigest()])
    target = get_target(options.target)  # (cuda: the GPU's arch when none is asked, ptxas)
    return cache.cache_key(text, "program", options, f"program:{options.target}", target.cache_key(options))


def remember_program(key: str, compiled: Any) -> None:
    """Stores the whole compiled program when every partition is already plain data (else the
    packing would cost more than it saves, e.g. small cpu partitions); never raises. Packed
    (torch.export.save: ~1.5 s for BEVFormer-tiny) and written by the cache's writer thread
    behind the compile (cache.store_later; GAC_CACHE_BACKGROUND=0: here)."""
    parts = compiled.compiled.partitions.values()
    if any(getattr(cg, "saved", (None, None))[1] is None for cg in parts):
        return

    def entry() -> cache.Entry | None:
        try:
            data = to_bytes(compiled, weights=False)  # the caller's ep brings them on a hit
        except Exception as e:  # noqa: BLE001  (an optimization: e.g. a graph torch cannot serialize)
            log.debug("gac cache: program not cached: %s", e)
            return None
        return cache.Entry({"kind": "program"}, {"artifact": data})

    cache.store_later(key, entry)


def cached_program(key: str, options: dict | None, user_ep: torch.export.ExportedProgram):
    """(manifest, saved ExportedProgram with `user_ep`'s parameters and buffers, partitions by
    name) for `key`, or None."""
    entry = cache.load(key)
    if entry is None or "artifact" not in entry.blobs:
        return None
    try:
        manifest, ep, loaded = read(io.BytesIO(entry.blobs["artifact"]), options=options, caller=user_ep)
    except TargetUnavailable as e:  # e.g. cuda compiled to PTX on a machine without a GPU: the
        log.debug("gac cache: cached program not loaded here: %s", e)  # partitions still hit
        return None
    except Exception as e:  # noqa: BLE001  (then compiled as if missed)
        log.warning("gac cache: a cached program does not load (%s); recompiling", e)
        return None
    return manifest, ep, {cg.name: cg for cg in loaded.values()}
