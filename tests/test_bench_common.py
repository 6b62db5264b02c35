"""benchmarks/common.py enforces parity: a row over tolerance says FAIL and the report's writer
exits non-zero (after writing it), so a benchmark never reports speed for wrong answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r})\nfrom common import *\n{body}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)


def test_over_tolerance_fails_the_row_and_the_run(tmp_path):
    out = tmp_path / "r.md"
    p = _run(f"rows = [parity('a', 1e-4, 1e-3), parity('b', 2e-3, 1e-3), parity('c', float('nan'), 1e-3)]\n"
             f"write_report(' | '.join(rows), {str(out)!r})", tmp_path)
    assert p.returncode == 1, p.stderr
    assert out.read_text() == "ok | FAIL (2.0e-03 > 1e-03) | FAIL (nan > 1e-03)"  # written before exiting
    assert "b: error 2.00e-03" in p.stderr and "c: error nan" in p.stderr


def test_within_tolerance_exits_zero(tmp_path):
    p = _run("write_report(parity('a', 1e-4, 1e-3) + failed.__name__, None)", tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "okfailed"


def test_a_raising_variant_fails_the_run(tmp_path):
    p = _run("write_report(failed('gemm gac', 'RuntimeError: boom'), None)", tmp_path)
    assert p.returncode == 1 and "FAIL (RuntimeError: boom)" in p.stdout


def test_each_train_variant_compiles_its_own_graph(tmp_path):
    # gemm_variants --train compiles one step per variant; module instances share forward's code
    # object, where dynamo keeps compiled graphs, so without _own_code every variant ran the
    # first one's kernels (3 instances: 1 compile)
    p = _run("import torch\nimport gemm_variants as gv\n"
             "n = [0]\n"
             "def count(gm, ex):\n    n[0] += 1\n    return gm.forward\n"
             "class Step(torch.nn.Module):\n"
             "    def __init__(self):\n        super().__init__()\n        self.l = torch.nn.Linear(4, 4)\n"
             "    def forward(self, x):\n        return self.l(x).relu().sum()\n"
             "for _ in range(3):\n    torch.compile(gv._own_code(Step()), backend=count)(torch.randn(2, 4))\n"
             "print(n[0])", tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "3"
