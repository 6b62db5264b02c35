"""Tile choice measured on the device (backends/gpu/tuning.py, backends/cuda/autotune.py): the
choice rules, the table on disk, the autotuner's bookkeeping (with a fake clock on the cpu), and
the real thing on the GPU (cuda-marked)."""

from __future__ import annotations

import json

import pytest
import torch

import gac_torch
from gac_torch.backends.cuda import autotune
from gac_torch.backends.gpu import tuning


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GAC_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_choice_is_the_heuristic_outside_a_session_and_the_table_or_force_inside():
    assert tuning.choose("k", ("a", "b"), "a") == "a"
    with tuning.session({"k": "b", "gone": "z"}) as s:
        assert tuning.choose("k", ("a", "b"), "a") == "b"
        tuning.bind("gac_k3_x")
        assert tuning.choose("gone", ("x", "y"), "x") == "x"  # a stale entry is no candidate
        tuning.discard()
    assert [c.chosen for c in s.kernels["gac_k3_x"]] == ["b"]
    with tuning.session({"k": "b"}, force={"k": "a"}) as s:
        assert tuning.choose("k", ("a", "b"), "b") == "a"
        tuning.bind("gac_k0_x")
        tuning.rename({"gac_k0_x": "gac_k1_x"})
    assert list(s.kernels) == ["gac_k1_x"]
    assert tuning.current() is None


def test_table_round_trip_and_bad_tables_are_ignored(cache_dir, caplog):
    assert tuning.load_table("sm_90") == {} and tuning.digest("sm_90") == ""
    path = tuning.save_table("sm_90", {"k": "b"}, {"k": {"a": 2.0, "b": 1.0}})
    assert path == cache_dir / "tuning" / "sm_90.json"
    tuning.save_table("sm_90", {"j": "a"})
    assert tuning.load_table("sm_90") == {"j": "a", "k": "b"}
    d = tuning.digest("sm_90")
    assert d and d != tuning.digest("sm_80")
    path.write_text("{ not json")
    assert tuning.load_table("sm_90") == {}
    path.write_text(json.dumps({"arch": "sm_80", "best": {"k": "a"}}))  # another arch's table
    assert tuning.load_table("sm_90") == {}
    assert "ignoring" in caplog.text


def test_the_table_is_part_of_the_cuda_cache_key(cache_dir):
    from gac_torch.backends.cuda.target import TARGET

    before = TARGET.cache_key({"arch": "sm_90"})
    tuning.save_table("sm_90", {"k": "b"})
    after = TARGET.cache_key({"arch": "sm_90"})
    assert before != after and TARGET.cache_key({"arch": "sm_80"})["tuning"] == ""


def test_tune_keeps_the_fastest_candidate_per_key(cache_dir):
    """A fake program with two tunable kernels and one fixed one: each build makes its choices
    as the strategies would; the fake clock says which candidate is fast for which key."""
    clock = {("gemm", "bn128"): 2.0, ("gemm", "bn256"): 1.0,
             ("conv", "big"): 3.0, ("conv", "small"): 1.5, ("conv", "tiny"): 0.5}
    builds = []

    def build():
        names = {}
        for i, (key, cands, heur) in enumerate([("gemm", ("bn128", "bn256"), "bn128"),
                                                ("conv", ("big", "small", "tiny"), "big"),
                                                ("fixed", ("only",), "only")]):
            chosen = tuning.choose(key, cands, heur)
            tuning.bind(f"gac_k{i}_x")
            names[f"gac_k{i}_x"] = (key, chosen)
        builds.append(dict(names))
        return names

    def measure(names):
        return {n: clock.get(kc, 0.1) for n, kc in names.items()}

    best = autotune.tune(build, measure, "sm_90")
    assert best == {"gemm": "bn256", "conv": "tiny"}
    assert len(builds) == 4  # the first (what is tunable), then one per candidate index
    assert tuning.load_table("sm_90") == best
    saved = json.loads((cache_dir / "tuning" / "sm_90.json").read_text())
    assert saved["ms"]["conv"] == {"big": 3.0, "small": 1.5, "tiny": 0.5}
    with tuning.session(tuning.load_table("sm_90")):  # a later compile builds the measured best
        assert build()["gac_k1_x"] == ("conv", "tiny")


def test_autotune_without_a_gpu_keeps_heuristic_tiles(cache_dir):
    """options autotune on a machine without a GPU: a warning, the normal compile, no table."""
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    ep = torch.export.export(_Mm(), (a, b))
    prog = gac_torch.compile(ep, target="cuda", options={"autotune": True, "arch": "sm_90"})
    assert "launch" in prog.ir("ptx")
    assert not (cache_dir / "tuning").exists()


class _Mm(torch.nn.Module):
    def forward(self, a, b):
        return a @ b


@pytest.mark.cuda
def test_max_autotune_measures_and_matches_eager_on_gpu(cache_dir):
    torch.compiler.reset()
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2048, 1024, generator=g).to("cuda", torch.bfloat16)
    b = torch.randn(1024, 3072, generator=g).to("cuda", torch.bfloat16)
    out = torch.compile(_Mm(), backend="gac", mode="max-autotune")(a, b)
    ref = (a.double() @ b.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    table = json.loads(next((cache_dir / "tuning").glob("sm_*.json")).read_text())
    assert table["best"] and all(len(v) >= 2 for v in table["ms"].values()), table


def _launches(prog) -> list[str]:
    return [ln for ln in prog.ir("ptx").split("\n.version")[0].splitlines() if "// launch" in ln]


def test_wgmma_tile_width_is_a_choice_and_a_table_entry_builds_it(cache_dir):
    """Offline (sm_90 PTX): the 4096^3 bf16 GEMM offers bn128/bn256 and builds bn256 by the
    heuristic; a measured table entry for its key makes the next compile build bn128."""
    a = torch.randn(4096, 4096, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, dtype=torch.bfloat16)
    opts = {"arch": "sm_90", "cache": False}
    with tuning.session() as s:
        first = _launches(gac_torch.compile(_Mm(), (a, b), target="cuda", options=opts))
    [(name, [choice])] = s.kernels.items()
    assert "wgmma" in name and choice.candidates == ("bn128", "bn256") and choice.chosen == "bn256"
    tuning.save_table("sm_90", {choice.key: "bn128"})
    second = _launches(gac_torch.compile(_Mm(), (a, b), target="cuda", options=opts))
    assert first != second and "smem=" in second[0]
    tuning.save_table("sm_90", {choice.key: "bn256"})
    assert _launches(gac_torch.compile(_Mm(), (a, b), target="cuda", options=opts)) == first


def test_conv_tile_size_is_a_choice(cache_dir):
    """Offline (sm_90): a TF32 3x3 conv offers 128- and 64-wide tiles; forcing the one the
    heuristic did not pick changes the launch (grid), the heuristic compile does not."""
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).eval()
    x = torch.randn(2, 64, 40, 56)
    opts = {"arch": "sm_90", "cache": False, "allow_tf32": True, "allow_tf32_conv": True}

    def compile_with(force=None):
        with tuning.session(force=force) as s, torch.no_grad():
            prog = gac_torch.compile(conv, (x,), target="cuda", options=opts)
        return _launches(prog), s

    first, s = compile_with()
    choices = [c for cs in s.kernels.values() for c in cs if c.key.startswith("igemm:")]
    assert len(choices) == 1 and set(choices[0].candidates) == {"tile128", "tile64"}, s.kernels
    other = next(c for c in choices[0].candidates if c != choices[0].heuristic)
    forced, _ = compile_with({choices[0].key: other})
    assert forced != first and compile_with()[0] == first
