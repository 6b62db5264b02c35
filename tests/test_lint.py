"""ruff (configured in pyproject.toml, a dev dependency) passes on the package and the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # the fast tier: pure Python, no model compile

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "gac_torch", "tests"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
