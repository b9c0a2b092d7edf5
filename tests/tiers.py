"""Test tiers by folder: every test under tests/e2e/ is marked ``e2e``, under tests/deploy/ ``deploy``.

Loaded by ``-p tests.tiers`` in pyproject.toml's addopts; the markers are registered there too.
The fast tier, the edit loop, leaves out the slow tiers and the programs scripts/test.sh installs::

    .venv/bin/python -m pytest -q -m "not e2e and not deploy and not external"

``bash scripts/test.sh`` runs every tier. The README's "Tests" section has the measured times.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = {"e2e": TESTS / "e2e", "deploy": TESTS / "deploy"}


def tier_of(path: Path) -> str | None:
    """The tier a test file belongs to by its folder, or None for the fast tier."""
    resolved = path.resolve()
    for marker, folder in TIERS.items():
        if resolved.is_relative_to(folder):
            return marker
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        marker = tier_of(item.path)
        if marker is not None:
            item.add_marker(marker)
