"""The architecture as import rules (STYLE.md): checked on the source, so a shortcut fails CI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("region_agent",)

# component → components it may import (besides itself), all under region_agent.
_SHORT: dict[str, tuple[str, ...]] = {
    "base": (),
    "state": ("base",),
    "globaldns": ("base", "state", "globaldns"),
    "health": ("base", "state", "health"),
    "kube": ("base", "state", "kube"),
    "usage": ("base", "state", "kube", "usage"),
    "checks": ("base", "state", "checks"),
    "gossip": ("base", "gossip"),  # membership knows nothing of projects or the store
    "cluster.quorum": ("base", "gossip"),  # pure quorum rules over membership
    # the cluster's edges: observations gossiped, ingress probes, verdicts laid over the answers
    "cluster": ("base", "gossip", "cluster", "state", "checks"),
    "control": ("base", "state", "gossip", "cluster", "control", "globaldns", "health"),
}
RULES = {f"region_agent.{k}": tuple(f"region_agent.{m}" for m in v) for k, v in _SHORT.items()}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out.append((".".join(p for p in parts if p != "__init__"), path))
    return out


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in PACKAGES}


@pytest.mark.parametrize(("module", "path"), _modules(), ids=[m for m, _ in _modules()])
def test_layering(module: str, path: Path) -> None:
    rule = next((allowed for prefix, allowed in RULES.items() if module == prefix or module.startswith(prefix + ".")),
                None)
    if rule is None:
        return  # the wiring (region_agent.cli, region_agent.app, ...) may import everything
    own = module.rsplit(".", 1)[0] if "." in module else module
    for name in _imports(path):
        allowed = any(name == a or name.startswith(a + ".") for a in rule) or name.startswith(own)
        assert allowed, f"{module} imports {name}; allowed: {', '.join(rule) or 'nothing from the project'}"


def test_no_module_named_dns_anywhere() -> None:
    """A package or module named dns would shadow dnspython (STYLE.md)."""
    offenders = [p for p in ROOT.rglob("dns") if ".venv" not in p.parts] + [
        p for p in ROOT.rglob("dns.py") if ".venv" not in p.parts]
    assert offenders == []
