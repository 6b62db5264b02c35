"""The main-thread work around a target's stages: timed per piece at DEBUG (progress.timed), the
stage texts (no repr of an artifact that has a text), and
the lowering's per-module attribute reuse (core.lowered_attrs), which must never outlive its
module's context nor change the linalg text."""

from __future__ import annotations

import logging
import time

import torch
from mlir import ir

from gac_torch.backends import get_target, stages_only
from gac_torch.frontends.fx import compile_graph
from gac_torch.ir.dialect import make_context
from gac_torch.legalize import decompositions
from gac_torch.lowering import core, lower_to_linalg
from gac_torch.options import resolve
from gac_torch.runtime import progress


class _Net(torch.nn.Module):  # reductions, broadcasts, bools and a matmul: several iterator kinds
    def forward(self, x, w):
        y = torch.relu(x @ w) + x.sum(dim=1, keepdim=True)
        return torch.where(y > 0.5, y, -y).softmax(dim=-1)


def _gac_text() -> str:
    """The gac stage of _Net (cuda, stages only): the input of lower_to_linalg, as text."""
    args = (torch.randn(5, 7), torch.randn(7, 7))
    gm = torch.export.export(_Net(), args).run_decompositions(decompositions()).graph_module
    options = resolve({"fallback": False}, target="cuda")
    compiled = compile_graph(gm, options, target=stages_only(get_target("cuda")))
    (part,) = compiled.partitions.values()
    return part.ir("gac")


def test_timed_pieces_are_reported_with_their_step(caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="gac_torch"):
        with progress.timed("outside"):  # no compile running: nothing recorded, no error
            pass
        with progress.Compile("graph 9 on cpu") as c:
            c.step("stage a")
            for _ in range(2):  # a repeated piece adds up
                with progress.timed("sleeping"):
                    time.sleep(0.05)
            c.step("stage b")  # reports stage a's pieces
            c.step("stage c")  # stage b timed nothing: no line
    lines = [r.getMessage() for r in caplog.records if " took " in r.getMessage()]
    assert len(lines) == 1, lines
    (line,) = lines
    assert line.startswith("gac: graph 9 on cpu: stage a took ") and "outside" not in line
    wall = float(line.split("sleeping ")[1].split(" s")[0])
    cpu = float(line.split("(cpu ")[1].split(")")[0])
    assert wall >= 0.1 and cpu < wall  # both sleeps counted; sleeping is no CPU
    assert not c.spent


def test_lowering_reuses_attributes_within_one_module_only() -> None:
    text = _gac_text()
    outs = []
    for _ in range(2):  # two contexts, one after the other: nothing of the first in the second
        ctx = make_context()
        module = ir.Module.parse(text, ctx)
        outs.append(lower_to_linalg(module))
        assert not core.lowered_attrs.active and not core.lowered_attrs.items
    assert str(outs[0]) == str(outs[1]) and "linalg.generic" in str(outs[1])
    with outs[1].context:
        outs[1].operation.verify()
    # outside lower_to_linalg the builders parse their own (nothing kept in a dead context)
    with make_context(), ir.Location.unknown():
        core._iterator_types(("parallel", "reduction"))
    assert not core.lowered_attrs.items


def test_iterator_types_parse_as_the_list_of_single_attributes() -> None:
    with make_context():
        kinds = ("parallel", "reduction", "parallel")
        single = ir.ArrayAttr.get([ir.Attribute.parse(f"#linalg.iterator_type<{k}>") for k in kinds])
        assert core._iterator_types(kinds) == single


def test_stage_text_prints_no_repr_of_an_artifact_with_a_text() -> None:
    from gac_torch.driver import stage_text

    class Stage:
        text = "the stage"

        def __repr__(self):  # a GPU program's repr holds all its PTX: never made for nothing
            raise AssertionError("repr made although the artifact has a text")

    class Plain:
        def __repr__(self):
            return "plain"

    assert stage_text(Stage()) == "the stage" and stage_text(Plain()) == "plain"


def test_type_predicates_agree_with_the_printed_types() -> None:
    """is_bool / is_float decide most types without printing them: same answers as the text."""
    from gac_torch.ir.types import is_bool, is_float

    with make_context():
        for text in ["i1", "si1", "ui1", "i8", "i64", "f16", "bf16", "f32", "f64", "f8E4M3FN",
                     "index", "tensor<2xi1>", "complex<f32>"]:
            t = ir.Type.parse(text)
            assert is_bool(t) == (str(t) == "i1"), text
            assert is_float(t) == (str(t) in ("f32", "f16", "bf16", "f64")), text
