"""The architecture as import rules, checked on the source so a shortcut fails CI.

The folders of ``region_agent/`` are floors; a module imports from its own folder and from
floors below it, never above, and folders on one floor are independent unless an exception
below says otherwise::

    cli → demo → app → {cluster, usage, control} → {kube, checks, zonefile, globaldns, health}
        → {gossip, state} → base

Every module belongs to a floor (the rules are total: a new folder fails until it is placed).
Imports under ``if TYPE_CHECKING:`` and inside functions count like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "region_agent"

FLOORS: tuple[tuple[str, ...], ...] = (
    ("__main__",),
    ("cli",),
    ("demo",),
    ("app",),
    ("cluster", "usage", "control"),
    ("kube", "checks", "zonefile", "globaldns", "health"),
    ("gossip", "state"),
    ("base",),
)
# Same-floor imports that are part of the design, each with its reason.
EXCEPTIONS: dict[str, set[str]] = {
    "control": {"cluster"},   # writes pass the cluster's write gate; members are shown as cluster rows
}
# Modules held to less than their folder may import.
NARROWER: dict[str, set[str]] = {
    "cluster.quorum": {"base", "gossip"},   # pure quorum rules over the membership view
    "cluster.members": {"base", "gossip"},
    "control": {"base", "state", "cluster"},   # the API knows the store and the cluster, not DNS or gossip
}
FLOOR_OF = {folder: n for n, folders in enumerate(FLOORS) for folder in folders}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT / PACKAGE).with_suffix("").parts
        name = ".".join(p for p in parts if p != "__init__")
        if name:  # the package's own __init__ holds no code
            out.append((name, path))
    return out


def _imports(path: Path) -> set[str]:
    """Project modules imported by ``path``, without the package prefix."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            if node.module:
                found.add(node.module)
    return {name.removeprefix(PACKAGE + ".") for name in found if name == PACKAGE or name.startswith(PACKAGE + ".")}


def _folder(module: str) -> str:
    return module.split(".", 1)[0]


def allowed(importer: str, imported: str) -> bool:
    """Whether module ``importer`` may import module ``imported`` (both without the package prefix)."""
    here, there = _folder(importer), _folder(imported)
    if here == there:
        return True
    narrower = next((rule for prefix, rule in NARROWER.items()
                     if importer == prefix or importer.startswith(prefix + ".")), None)
    if narrower is not None:
        return there in narrower
    return FLOOR_OF[there] > FLOOR_OF[here] or there in EXCEPTIONS.get(here, set())


MODULES = _modules()


def test_every_module_is_on_a_floor() -> None:
    unplaced = sorted({_folder(name) for name, _ in MODULES} - FLOOR_OF.keys())
    assert unplaced == [], f"folders with no floor in tests/meta/test_layers.py: {unplaced}"


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_layering(module: str, path: Path) -> None:
    bad = sorted(name for name in _imports(path) if _folder(name) in FLOOR_OF and not allowed(module, name))
    assert bad == [], f"{module} imports {bad}: a floor imports only from below it (see this test's docstring)"


def test_gossip_never_imports_state_and_base_imports_nothing() -> None:
    """The two rules the floors alone would not say loudly enough."""
    for module, path in MODULES:
        imported = {_folder(name) for name in _imports(path)}
        if _folder(module) == "gossip":
            assert "state" not in imported, module
        if _folder(module) == "base":
            assert imported <= {"base"}, module


@pytest.mark.parametrize(("importer", "imported", "ok"), [
    ("control.api", "cluster.members", True),       # the one same-floor exception
    ("cluster.observer", "control.api", False),      # not the other way round
    ("globaldns.service", "health.service", False),  # one floor, independent
    ("state.store", "gossip.messages", False),
    ("gossip.node", "base.tasks", True),
    ("base.clock", "state.hlc", False),              # base imports nothing
    ("cluster.quorum", "state.model", False),        # held narrower than its folder
    ("control.api", "globaldns.compiler", False),
    ("app.supervisor", "cli.main", False),
    ("cli.main", "app.supervisor", True),
])
def test_the_rules_themselves(importer: str, imported: str, ok: bool) -> None:
    assert allowed(importer, imported) is ok


def test_no_module_named_dns_anywhere() -> None:
    """A package or module named dns would shadow dnspython."""
    offenders = [p for p in ROOT.rglob("dns") if ".venv" not in p.parts] + [
        p for p in ROOT.rglob("dns.py") if ".venv" not in p.parts]
    assert offenders == []
