"""The backends' import rules, read from the source: a target never imports a sibling target
(they share code through backends/gpu and backends/base.py), and no private (_name) crosses a
package boundary (a name another package needs is public)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gac_torch

pytestmark = pytest.mark.unit  # the fast tier: pure Python, no model compile

PKG = Path(gac_torch.__file__).parent
BACKENDS = PKG / "backends"
TARGETS = ("cpu", "cuda", "vortex")


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) for every import in the file, nested ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
    return out


def _package(module: str) -> str:
    """gac_torch.backends.cuda.runtime -> gac_torch.backends.cuda; gac_torch.kernels.x -> gac_torch.kernels."""
    parts = module.split(".")
    return ".".join(parts[:3] if parts[:2] == ["gac_torch", "backends"] else parts[:2])


def _backend_files() -> list[Path]:
    return sorted(BACKENDS.rglob("*.py"))


def test_the_rules_see_the_backends() -> None:
    files = _backend_files()
    assert {p.relative_to(BACKENDS).parts[0] for p in files} >= {*TARGETS, "gpu", "base.py"}
    assert any(m.startswith("gac_torch.backends.gpu") for p in files for m, _, _ in _imports(p))


def test_no_target_imports_a_sibling_target() -> None:
    bad = []
    for path in _backend_files():
        rel = path.relative_to(BACKENDS).parts
        if rel[0] not in TARGETS:
            continue
        for module, names, line in _imports(path):
            for other in TARGETS:
                if other == rel[0]:
                    continue
                prefix = f"gac_torch.backends.{other}"
                if module == prefix or module.startswith(prefix + ".") or (
                        module == "gac_torch.backends" and other in names):
                    bad.append(f"{path.relative_to(PKG)}:{line} imports {module} ({other})")
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_a_package() -> None:
    bad = []
    for path in _backend_files():
        own = _package("gac_torch." + ".".join(path.relative_to(PKG).with_suffix("").parts))
        for module, names, line in _imports(path):
            if not module.startswith("gac_torch") or _package(module) == own:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private or any(p.startswith("_") for p in module.split(".")[1:]):
                bad.append(f"{path.relative_to(PKG)}:{line} from {module} import {private}")
    assert not bad, "\n".join(bad)


def test_no_private_attribute_of_another_package_is_used() -> None:
    """`from x import mod` then `mod._name`: the same crossing, through an attribute."""
    bad = []
    for path in _backend_files():
        own = _package("gac_torch." + ".".join(path.relative_to(PKG).with_suffix("").parts))
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gac_torch"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if _package(full) != own:
                        aliases[a.asname or a.name] = full
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(PKG)}:{node.lineno} {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)
