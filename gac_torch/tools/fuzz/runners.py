"""Runs one fuzz program through eager and gac's front-ends and classifies what happened.

Per front-end (torch.compile(backend="gac") and gac_torch.compile(torch.export.export(...))):
strict mode first (options={"fallback": False}); default mode only when strict did not compile
the whole graph (when it did, default mode compiles the very same partitions). Outcomes:

    ok           outputs and mutated inputs match eager (oracle.py)
    mismatch     they do not
    crash        any exception other than the documented unsupported-op error, and in default
                 mode a partition that failed to compile and silently ran eagerly
    skipped      eager itself fails on this target (e.g. an op CUDA lacks for a dtype)
    unsupported  strict mode raised GacUnsupportedError (ops gac does not lower; listed) and
                 default mode, falling back for them, matches eager
A case's status is its worst outcome (crash > mismatch > unsupported > ok).
"""

from __future__ import annotations

import traceback
import warnings
from dataclasses import dataclass, field

import torch

import gac_torch
from gac_torch.frontends.fx import GacUnsupportedError
from gac_torch.tools.fuzz.gen import load
from gac_torch.tools.fuzz.oracle import compare

FRONTENDS = ("compile", "export")
RANK = {"skipped": -1, "ok": 0, "unsupported": 1, "mismatch": 2, "crash": 3}


@dataclass
class Outcome:
    config: str  # e.g. "cpu/export/strict"
    status: str
    detail: str = ""
    unsupported: list[str] = field(default_factory=list)  # "op: reason" lines (strict mode)


@dataclass
class CaseResult:
    seed: int
    outcomes: list[Outcome]

    @property
    def status(self) -> str:
        return max((o.status for o in self.outcomes), key=RANK.__getitem__, default="ok")

    def summary(self) -> str:
        return "\n".join(f"{o.config}: {o.status}" + (f" -- {o.detail}" if o.detail else "")
                         for o in self.outcomes)


class _Case(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def device_of(target: str) -> str:
    from gac_torch.backends import get_target

    return get_target(target).device_type


def _unsupported_error(e: BaseException) -> GacUnsupportedError | None:
    while e is not None:
        if isinstance(e, GacUnsupportedError):
            return e
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return None


def _root(e: BaseException) -> BaseException:
    """The error to report: the first of gac's own in the chain (not dynamo's wrapper)."""
    chain = []
    while e is not None and len(chain) < 20:
        chain.append(e)
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return next((x for x in chain if type(x).__module__.startswith("gac_torch")), chain[-1])


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:300] if lines else ""


def _silent_fallbacks(reports) -> list[str]:
    """Partitions that failed to compile and ran eagerly (default mode hides compiler bugs so)."""
    return [f"{op}: {why}" for r in reports for (op, why) in r.unsupported if op.startswith("partition ")]


class Runner:
    """One program (its source), run on one target; eager's results computed once."""

    def __init__(self, source: str, target: str = "cpu"):
        self.source = source
        self.target = target
        self.device = device_of(target)
        self.ns = load(source)
        self._wide: list | None = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ins = self.inputs()
            self.eager = list(self.ns["forward"](*ins))
            self.eager_inputs = ins

    def inputs(self) -> list[torch.Tensor]:
        """Fresh inputs (the same values each time; views stay views on the cpu)."""
        return [t.to(self.device) for t in self.ns["make_inputs"]()]

    def wide(self) -> list:
        """The float64 reference: outputs then inputs after the run."""
        if self._wide is None:
            ns = load(self.source, wide=True)
            ins = [t.double() if t.is_floating_point() else t for t in ns["make_inputs"]()]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outs = list(ns["forward"](*ins))
            self._wide = outs + ins
        return self._wide

    def check(self, outs, ins) -> str | None:
        n = len(self.eager)
        why = compare(list(outs), self.eager, lambda: self.wide()[:n])
        if why is None:
            why = compare(ins, self.eager_inputs, lambda: self.wide()[n:], what="input (after the call)")
        return why

    def compiled(self, frontend: str, strict: bool):
        """(callable, reports): the program compiled by one front-end."""
        options = {"fallback": not strict}
        model = _Case(self.ns["forward"])
        if frontend == "compile":
            from gac_torch.frontends import dynamo

            torch._dynamo.reset()
            fn = torch.compile(model, backend="gac", options=dict(options, target=self.target))
            seen = list(dynamo.compiled_graphs)

            def reports():
                return [c.report for c in dynamo.compiled_graphs if not any(c is s for s in seen)]
            return fn, reports
        try:
            ep = torch.export.export(model, tuple(self.inputs()))
        except Exception as e:  # torch's exporter, not gac: the case says so
            raise _ExportFailed(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from e
        prog = gac_torch.compile(ep, target=self.target, options=options)
        return prog, lambda: [prog.report]

    def _torch_compile_fails(self) -> str | None:
        """Why torch.compile with backend="eager" fails on this case (None when it runs): then a
        crash under backend="gac" is torch's tracer (e.g. torch 2.11's fake-tensor `split` of a
        0-size dim, H200 fuzz seed 167), not gac's."""
        torch._dynamo.reset()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.compile(_Case(self.ns["forward"]), backend="eager")(*self.inputs())
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {_first_line(_root(e))[:200]}"
        finally:
            torch._dynamo.reset()
        return None

    def run(self, frontend: str, strict: bool) -> tuple[Outcome, list | None]:
        config = f"{self.target}/{frontend}/{'strict' if strict else 'default'}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn, reports = self.compiled(frontend, strict)
                ins = self.inputs()
                outs = list(fn(*ins))
        except _ExportFailed as e:
            return Outcome(config, "ok", f"skipped: torch.export failed ({e})"), None
        except Exception as e:  # noqa: BLE001
            unsup = _unsupported_error(e)
            if unsup is not None and strict:
                lines = [ln.strip() for ln in str(unsup).splitlines()[1:] if ln.strip()]
                return Outcome(config, "unsupported", "", lines), None
            torch_fails = self._torch_compile_fails() if frontend == "compile" else None
            if torch_fails is not None:  # dynamo itself, whatever the backend: torch's bug
                return Outcome(config, "ok", f"skipped: torch.compile fails with backend='eager' too ({torch_fails})"), None
            root = _root(e)
            frames = traceback.extract_tb(root.__traceback__)
            ours = [f for f in frames if "gac_torch" in f.filename][-2:] or frames[-2:]
            return Outcome(config, "crash", f"{type(root).__name__}: {_first_line(root)}\n"
                           + "".join(traceback.format_list(ours))[-1500:]), None
        fell_back = _silent_fallbacks(reports())
        why = self.check(outs, ins)
        if why:
            return Outcome(config, "mismatch", why), outs
        if fell_back:
            return Outcome(config, "crash", "a partition failed to compile and ran eagerly: "
                           + "; ".join(fell_back)[:500]), outs
        return Outcome(config, "ok"), outs


class _ExportFailed(gac_torch.GacError):
    """torch.export refused the generated program: torch's limit, not a gac bug."""


def run_case(source: str, seed: int, targets: tuple[str, ...] = ("cpu",),
             frontends: tuple[str, ...] = FRONTENDS) -> CaseResult:
    """Every front-end on every target; with several targets, each one's strict outputs are also
    compared with the first target's."""
    outcomes: list[Outcome] = []
    first: tuple[str, list] | None = None
    for target in targets:
        try:
            runner = Runner(source, target)
        except Exception as e:  # noqa: BLE001  (e.g. an op eager lacks on this device)
            return CaseResult(seed, [Outcome(f"{target}/eager", "skipped", f"eager failed: {e}")])
        for frontend in frontends:
            strict, outs = runner.run(frontend, strict=True)
            outcomes.append(strict)
            if strict.status in ("unsupported", "crash"):
                default, _ = runner.run(frontend, strict=False)
                outcomes.append(default)
                if strict.status == "unsupported" and default.status == "ok":
                    default.status = "unsupported"  # the case counts once, as unsupported
                    default.unsupported = strict.unsupported
            if outs is None:
                continue
            if first is None:
                first = (strict.config, outs)
            elif first[1] is not outs and target != targets[0]:
                why = compare(outs, first[1], lambda r=runner: r.wide()[:len(r.eager)])
                if why:
                    outcomes.append(Outcome(f"{strict.config} vs {first[0]}", "mismatch", why))
    return CaseResult(seed, outcomes)
