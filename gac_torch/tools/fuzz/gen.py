"""The random-graph generator: a seed -> a Program (Python source of make_inputs() and forward()).

The generator writes forward() one line at a time and runs each line eagerly on the example
inputs as it goes: a line eager rejects is dropped, and the next op sees real shapes, dtypes and
values (to stay in an op's domain, see table.py). The same seed always gives the same program,
and the program's source is its repro: it rebuilds its inputs from the seed.

Features a program has (Program.features) name the semantics it exercises, so that a caller can
leave out classes of cases (e.g. known bugs): nonfinite, zero_size, reduce_0d, input_mutation,
inplace_alias, noncontig_input, adaptive_pool_nondiv, plus every op entry's name ("flip").
"""

from __future__ import annotations

import random
import sys
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gac_torch.tools.fuzz.table import BOOL, FLOAT, INT, Op, active_ops, kind

DT_NAME = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "torch.int64", torch.int32: "torch.int32", torch.bool: "torch.bool"}
PRELUDE = ("import torch\nimport torch.nn.functional as F\n\n"
           "F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16\n")
MAX_NUMEL = 2048


@dataclass
class Var:
    name: str
    t: torch.Tensor
    exact: bool  # no rounding error so far (inputs, views, int math)
    role: str = "value"  # "input" | "const" (a weight: an input ops never mutate) | "value"
    no_write: bool = False  # a view of an unfold / expand result (its elements may overlap)

    @property
    def dt(self) -> str:
        return DT_NAME[self.t.dtype]


@dataclass
class Program:
    seed: int
    input_lines: list[str]  # make_inputs() body, in generator order
    inputs: list[str]  # forward()'s parameters
    lines: list[str]  # forward() body
    outputs: list[str]
    features: set[str] = field(default_factory=set)
    ops: list[str] = field(default_factory=list)  # op entry per line

    def source(self) -> str:
        feats = ", ".join(sorted(self.features)) or "none"
        body = "\n".join(f"    {ln}" for ln in self.lines)
        inputs = "\n".join(f"    {ln}" for ln in self.input_lines)
        return (f'"""gac_torch fuzz case, seed {self.seed}.\nfeatures: {feats}\n'
                f'Replay: PYTHONPATH=. python <this file> [--target cpu]"""\n\n{PRELUDE}SEED = {self.seed}\n\n\n'
                f"def make_inputs():\n    G = torch.Generator().manual_seed(SEED)\n{inputs}\n"
                f"    return [{', '.join(self.inputs)}]\n\n\n"
                f"def forward({', '.join(self.inputs)}):\n{body}\n    return ({', '.join(self.outputs)},)\n\n\n"
                'if __name__ == "__main__":\n    from gac_torch.tools.fuzz import replay\n\n    replay(__file__)\n')


def load(source: str, wide: bool = False) -> dict:
    """The program's namespace (make_inputs, forward). wide: forward computes every float in
    float64 (the reference); make_inputs still makes the real inputs."""
    name = "gac_fuzz_case_wide" if wide else "gac_fuzz_case"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dynamo looks the program's globals up by module name
    ns = module.__dict__
    exec(compile(source, "<fuzz case>", "exec"), ns)  # noqa: S102
    if wide:
        ns.update(F32=torch.float64, F16=torch.float64, BF16=torch.float64)
    return ns


class Gen:
    """State while writing one program (what the op entries' make() functions see)."""

    def __init__(self, seed: int, exclude: frozenset[str], nonfinite: bool | None):
        self.rng = random.Random(seed)
        self.seed = seed
        self.exclude = exclude
        self.nonfinite = (self.rng.random() < 0.15) if nonfinite is None else nonfinite
        self.nonfinite = self.nonfinite and "nonfinite" not in exclude
        self.G = torch.Generator().manual_seed(seed)
        self.ns: dict = load(PRELUDE)
        self.ns["G"] = self.G
        self.input_lines: list[str] = []
        self.vars: list[Var] = []
        self.features: set[str] = set()

    def _make(self, name: str, src: str, role: str) -> Var:
        """Runs one make_inputs() line now (same generator, same order as the program will)."""
        self.input_lines.append(f"{name} = {src}")
        exec(self.input_lines[-1], self.ns)  # noqa: S102
        v = Var(name, self.ns[name], exact=True, role=role)
        self.vars.append(v)
        return v

    def const(self, src: str) -> str:
        """A weight the op needs: one more input, made from the seed."""
        return self._make(f"w{sum(v.role == 'const' for v in self.vars)}", src, "const").name

    def input(self, i: int, shape: list[int], dtype: torch.dtype) -> None:
        rng, dt = self.rng, DT_NAME[dtype]
        layout = rng.random()
        noncontig = len(shape) >= 2 and layout < 0.15 and "noncontig_input" not in self.exclude
        make_shape = list(shape)
        if noncontig and layout < 0.08:
            make_shape[-1], make_shape[-2] = make_shape[-2], make_shape[-1]
            view = ".transpose(-1, -2)"
        elif noncontig:
            make_shape[-1] *= 2
            view = "[..., ::2]"
        else:
            view = ""
        shp = tuple(make_shape)
        if dtype.is_floating_point:
            scale = rng.choice(["", "", " * 3"])
            src = f"(torch.randn({shp}, generator=G){scale}).to({dt}){view}"
        elif dtype == torch.bool:
            src = f"torch.randint(0, 2, {shp}, generator=G).bool(){view}"
        else:
            src = f"torch.randint(-4, 5, {shp}, generator=G).to({dt}){view}"
        v = self._make(f"x{i}", src, "input")
        if noncontig:
            self.features.add("noncontig_input")
        if self.nonfinite and dtype.is_floating_point and v.t.numel() and rng.random() < 0.6:
            idx = (0,) * v.t.dim()
            last = (-1,) * v.t.dim()
            vals = rng.sample(["float('inf')", "float('-inf')", "float('nan')"], 2)
            for ix, val in ((idx, vals[0]), (last, vals[1])):
                self.input_lines.append(f"{v.name}[{ix}] = {val}")
                exec(self.input_lines[-1], self.ns)  # noqa: S102

    # --- drawing ops ---------------------------------------------------------------------------
    def _candidates(self, kinds: str, disc: bool) -> list[Var]:
        return [v for v in self.vars if v.role != "const" and kind(v.t) in kinds and (v.exact or not disc)]

    def _pick(self, cands: list[Var]) -> Var:
        recent = cands[-3:]
        return self.rng.choice(recent if self.rng.random() < 0.6 else cands)

    def args_for(self, o: Op) -> list[Var] | None:
        args: list[Var] = []
        for i, ks in enumerate(o.kinds):
            cands = self._candidates(ks, o.disc)
            if i and cands and o.name not in ("cat", "stack", "matmul"):  # broadcastable with args[0]
                cands = [c for c in cands if _broadcastable(c.t.shape, args[0].t.shape)]
            if not cands:
                return None
            args.append(self._pick(cands))
        return args

    def step(self, o: Op, k: int) -> str | None:
        args = self.args_for(o)
        if args is None:
            return None
        expr = o.make(self, *args)
        if expr is None:
            return None
        target = args[0]
        if o.inplace and (target.no_write or torch._debug_has_internal_overlap(target.t) != 0):
            return None  # writing through an overlapping view (unfold, expand): torch.compile bans it
        shares_input = o.inplace and any(
            v.role == "input" and _same_storage(target.t, v.t) for v in self.vars)
        if o.inplace and "input_mutation" in self.exclude and shares_input:
            return None
        before = {v.name: v.t.clone() for v in self.vars} if o.inplace else None
        try:
            out = eval(expr, self.ns, {v.name: v.t for v in self.vars})
        except Exception:  # eager rejects it (shapes, dtypes): not a program  # noqa: BLE001
            return None
        if not isinstance(out, torch.Tensor) or out.numel() > MAX_NUMEL or out.dim() > 6:
            if before:  # undo a mutation that we will not write down
                for v in self.vars:
                    v.t.copy_(before[v.name])
            return None
        feats = self._features(o, args, out, shares_input)
        if feats & self.exclude:
            if before:
                for v in self.vars:
                    v.t.copy_(before[v.name])
            return None
        self.features |= feats
        exact = all(a.exact for a in args) and (o.exact or (kind(out) != FLOAT and all(
            kind(a.t) != FLOAT for a in args)))
        if o.inplace:
            target.exact = target.exact and exact
        name = f"v{k}"
        no_write = o.name in ("unfold", "expand") or any(
            a.no_write and _same_storage(out, a.t) for a in args)
        self.vars.append(Var(name, out, exact, no_write=no_write))
        return f"{name} = {expr}"

    def _features(self, o: Op, args: list[Var], out: torch.Tensor, shares_input: bool) -> set[str]:
        feats = {o.name}
        if o.reduction and args[0].t.dim() == 0:
            feats.add("reduce_0d")
        if out.numel() == 0 or any(a.t.numel() == 0 for a in args):
            feats.add("zero_size")
        if out.is_floating_point() and not bool(out.isfinite().all()):
            feats.add("nonfinite")
        if shares_input:
            feats.add("input_mutation")
        elif o.inplace and any(v is not args[0] and v.role == "value" and _same_storage(args[0].t, v.t)
                               for v in self.vars):
            feats.add("inplace_alias")
        if o.name == "adaptive_avg_pool2d" and any(
                i % n for i, n in zip(args[0].t.shape[-2:], out.shape[-2:], strict=True)):
            feats.add("adaptive_pool_nondiv")
        return feats


def _broadcastable(a, b) -> bool:
    try:
        torch.broadcast_shapes(a, b)
        return True
    except RuntimeError:
        return False


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def lowered_names() -> set[str]:
    import gac_torch.legalize  # noqa: F401  (fills the registry)
    from gac_torch.legalize import registry

    return {e.name for e in registry.REGISTRY.values() if e.bucket == "lower"}


def generate(seed: int, exclude: frozenset[str] = frozenset(), n_ops: tuple[int, int] = (3, 12),
             nonfinite: bool | None = None) -> Program:
    """The program of this seed. exclude: features (and op names) the program must not have."""
    g = Gen(seed, frozenset(exclude), nonfinite)
    rng = g.rng
    ops = [o for o in active_ops(lowered_names()) if o.name not in g.exclude]
    float_dt = rng.choices([torch.float32, torch.float16, torch.bfloat16], [0.7, 0.15, 0.15])[0]
    rank = rng.choices([0, 1, 2, 3, 4], [1, 2, 3, 3, 2])[0]
    base = [rng.choice([1, 2, 3, 4, 5]) for _ in range(rank)]
    if rank and "zero_size" not in g.exclude and rng.random() < 0.06:
        base[rng.randrange(rank)] = 0
    for i in range(rng.choice([1, 2, 2, 3])):
        shape = [1 if rng.random() < 0.2 else d for d in base]
        if shape and rng.random() < 0.2:
            shape = shape[rng.randrange(len(shape)):]
        dtype = rng.choices([float_dt, torch.float32, torch.int64, torch.int32, torch.bool],
                            [0.65, 0.05, 0.12, 0.05, 0.13])[0]
        if i == 0 and rng.random() < 0.7:
            dtype = float_dt  # most graphs are float graphs
        g.input(i, shape, dtype)
    if "nonfinite" not in g.exclude:
        for v in g.vars:
            if v.t.is_floating_point() and not bool(v.t.isfinite().all()):
                g.features.add("nonfinite")
    lines: list[str] = []
    used: list[str] = []
    want = rng.randint(*n_ops)
    for _ in range(40 * want):
        if len(lines) >= want:
            break
        o = rng.choice(ops)
        line = g.step(o, len(lines))
        if line is not None:
            lines.append(line)
            used.append(o.name)
    values = [v for v in g.vars if v.role == "value"]
    outs = [values[-1].name] if values else [next(v.name for v in g.vars if v.role == "input")]
    for v in rng.sample(values[:-1], min(len(values) - 1, rng.choice([0, 1, 2]))):
        outs.append(v.name)
    inputs = [v.name for v in g.vars if v.role != "value"]
    return Program(seed, g.input_lines, inputs, lines, outs, g.features, used)


__all__ = ["BOOL", "INT", "F", "Program", "generate", "load"]
