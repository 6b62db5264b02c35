"""The gac-torch command line.

    gac-torch report model.onnx                    # coverage before compiling
    gac-torch compile model.onnx --target cuda --arch sm_90 -o out/

`compile` writes every IR stage of every compiled partition (`fused_0.gac`, `fused_0.linalg`,
then the target's own stages, e.g. `fused_0.ptx`) without loading anything, so compiling for
cuda needs no GPU. Models: ONNX files, or torch.export archives (`.pt2`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch

from gac_torch.errors import GacError
from gac_torch.options import TARGETS, OptionError, resolve


class UsageError(GacError):
    """An ordinary mistake on the command line: one line on stderr, exit status 2."""


def _parse_shapes(items: Sequence[str]) -> dict[str, list[int]]:
    shapes = {}
    for item in items:
        name, _, dims = item.partition("=")
        try:
            shapes[name] = [int(d) for d in dims.lower().split("x")]
        except ValueError:
            name = ""
        if not name or not dims or any(d < 0 for d in shapes.get(name, [])):
            raise UsageError(f"--shape expects NAME=D0xD1x... (sizes >= 0), got {item!r}")
    return shapes


def _load_onnx(path: str, shapes: dict[str, list[int]], strict: bool):
    """(ATen FX graph, ONNX report) on the cpu device: stages do not depend on the device."""
    from gac_torch.frontends.onnx import import_model, load_model
    from gac_torch.frontends.onnx.load import torch_dtype

    model = load_model(path)
    examples = None
    if shapes:
        inits = {i.name for i in model.graph.initializer}
        inputs = [i for i in model.graph.input if i.name not in inits]
        unknown = sorted(set(shapes) - {i.name for i in inputs})
        if unknown:
            raise UsageError(
                f"--shape: no input named {unknown}; inputs: {[i.name for i in inputs]}"
            )
        examples = [
            torch.empty(
                shapes[i.name]
                if i.name in shapes
                else [d.dim_value for d in i.type.tensor_type.shape.dim],
                dtype=torch_dtype(i.type.tensor_type.elem_type),
            )
            for i in inputs
        ]
    imported = import_model(model, strict=strict, example_inputs=examples)
    return imported.gm, imported.report


def _specialize(ep: torch.export.ExportedProgram, shapes: dict[str, list[int]]) -> torch.export.ExportedProgram:
    """--shape for a .pt2: export its module again with inputs of the given (static) shapes."""
    specs = [s for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    names = [s.arg.name for s in specs]
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise UsageError(f"--shape: no input named {unknown}; inputs: {names}")
    metas = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    examples = []
    for name in names:
        val = metas[name]
        shape = shapes.get(name) or [int(d) for d in val.shape]  # raises for a symbolic dim: say so
        examples.append(torch.zeros(shape, dtype=val.dtype))
    return torch.export.export(ep.module(), tuple(examples))


def _load(path: str, shapes: dict[str, list[int]], strict: bool):
    if not os.path.exists(path):
        raise UsageError(f"no such file: {path}")
    if path.endswith(".pt2"):
        from gac_torch.frontends.decompose import decompose_program
        from gac_torch.legalize import decompositions

        ep = torch.export.load(path)
        if shapes:
            ep = _specialize(ep, shapes)
        ep = decompose_program(ep, decompositions())
        return ep.graph_module, None
    return _load_onnx(path, shapes, strict)


def _print_onnx_report(report, out) -> None:
    print(f"ONNX: {report.summary().split(';')[0]}", file=out)
    if report.unsupported:
        print("  unsupported ONNX ops (run through onnxruntime):", file=out)
        for (op, why), n in sorted(report.unsupported.items()):
            print(f"    {op:24s} x{n:<5d} {why}", file=out)
    ops = ", ".join(f"{op} x{n}" for op, n in report.ops.most_common())
    print(f"  ops: {ops}", file=out)


def cmd_report(args: argparse.Namespace) -> int:
    from gac_torch.frontends.onnx import OnnxLoadError, OnnxUnsupportedError
    from gac_torch.passes.partition import analyze, drop_metadata_asserts, partition

    shapes = _parse_shapes(args.shape)
    try:
        gm, onnx_report = _load(args.model, shapes, strict=False)
    except OnnxLoadError as e:  # e.g. an unsupported op that needs onnxruntime to be sized
        try:
            _load(args.model, shapes, strict=True)
        except OnnxUnsupportedError as listed:
            _print_onnx_report(listed.report, sys.stdout)
            print(f"ATen: not analyzed ({e})")
            return 0
        raise
    print(f"{args.model}")
    if onnx_report is not None:
        _print_onnx_report(onnx_report, sys.stdout)
    drop_metadata_asserts(gm)
    decisions, report = analyze(gm)
    _, names = partition(gm, decisions, args.min_block_size)
    report.partitions = len(names)
    print(f"ATen: {report.summary().split('; eager')[0]} (before compiling)")
    for (op, why), n in sorted(report.unsupported.items()):
        print(f"  eager: {op:32s} x{n:<5d} {why}")
    return 0


def _write(path: str, data: str | bytes) -> None:
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def _stage_of(path: str, options: dict) -> str | None:
    """The stage a dumped file holds (its extension), if it names one of the target's."""
    from gac_torch.backends import get_target
    from gac_torch.driver import SHARED_STAGES

    ext = path.rsplit(".", 1)[-1]
    names = [*SHARED_STAGES, *(st.name for st in get_target(options["target"]).stages(options))]
    return ext if ext in names else None


def _compile_from_stage(args: argparse.Namespace, options: dict) -> int:
    """`gac-torch compile fused_0.linalg --target cuda`: every later stage, next to each other."""
    import gac_torch

    stages, artifact = gac_torch.compile_stage_file(args.model, options=options)
    os.makedirs(args.output, exist_ok=True)
    stem = os.path.basename(args.model).rsplit(".", 1)[0]
    last = list(stages)[-1]
    for stage, text in list(stages.items())[1:]:
        binary = getattr(artifact, "binary", None) if stage == last else None
        _write(os.path.join(args.output, f"{stem}.{stage}"), binary if isinstance(binary, bytes) else text)
    print(f"{stem}: -> {', '.join(f'{stem}.{s}' for s in list(stages)[1:])} in {args.output}/")
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from gac_torch.backends import get_target, stages_only
    from gac_torch.frontends.fx import compile_graph

    try:
        options = resolve(
            {"arch": args.arch, "fallback": not args.strict, "min_block_size": args.min_block_size},
            target=args.target,
        )
    except OptionError as e:
        raise UsageError(str(e)) from None
    if _stage_of(args.model, options):
        return _compile_from_stage(args, options)
    gm, onnx_report = _load(args.model, _parse_shapes(args.shape), strict=args.strict)
    compiled = compile_graph(gm, options, target=stages_only(get_target(options["target"])))  # --strict: raises listing every op
    os.makedirs(args.output, exist_ok=True)
    _write(os.path.join(args.output, "graph.fx.txt"), str(compiled.gm.graph))
    for name, part in compiled.partitions.items():
        _write(os.path.join(args.output, f"{name}.fx.txt"), part.fx_graph)
        for stage, text in part.stages.items():
            _write(os.path.join(args.output, f"{name}.{stage}"), text)
        last = list(part.stages)[-1]
        binary = getattr(part.executable, "binary", None)  # the last stage's artifact (stages_only)
        if isinstance(binary, bytes) and binary:  # a binary final stage (e.g. .vxbin): exact bytes
            _write(os.path.join(args.output, f"{name}.{last}"), binary)
        print(f"{name}: -> {', '.join(f'{name}.{s}' for s in part.stages)}")
    lines = ([str(compiled.report)] if onnx_report is None
             else [f"ONNX: {onnx_report}", f"ATen: {compiled.report}"])
    _write(os.path.join(args.output, "report.txt"), "\n".join(lines) + "\n")
    print(f"wrote {len(compiled.partitions)} partition(s) for {options['target']} to {args.output}/")
    print("\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from gac_torch import __version__

    p = argparse.ArgumentParser(prog="gac-torch", description="GAC-Torch: compile models with gac.")
    p.add_argument("--version", action="version", version=f"gac-torch {__version__}")
    p.add_argument("--traceback", action="store_true", help="show Python tracebacks of errors")
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", help="an ONNX model (.onnx), a torch.export archive (.pt2), or "
                        "(compile) a dumped stage to resume from, e.g. fused_0.linalg")
    common.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=D0xD1x...",
        help="static shape for an input with symbolic dims (repeatable)",
    )
    common.add_argument("--min-block-size", type=int, default=1, help="smallest compiled partition")
    r = sub.add_parser("report", parents=[common], help="coverage before compiling")
    r.set_defaults(fn=cmd_report)
    c = sub.add_parser("compile", parents=[common], help="write every IR stage per partition")
    c.add_argument("--target", default="cpu", choices=TARGETS)
    c.add_argument(
        "--arch", default=None, help="cuda: sm_80, sm_90, ... (default: the GPU's, else sm_90)"
    )
    c.add_argument("-o", "--output", default="gac_out", help="output folder (created)")
    c.add_argument("--strict", action="store_true", help="fail if any op would fall back")
    c.set_defaults(fn=cmd_compile)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a command; an error is one line on stderr (exit 2 for usage, 1 for a failed compile)
    unless --traceback asks for Python's traceback."""
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except Exception as e:
        if args.traceback:
            raise
        status = 2 if isinstance(e, UsageError) else 1
        what = "" if isinstance(e, UsageError) else f"{type(e).__name__}: "
        first = str(e).strip() or type(e).__name__
        print(f"gac-torch: error: {what}{first}", file=sys.stderr)
        if status == 1:
            print("gac-torch: (--traceback shows where)", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
