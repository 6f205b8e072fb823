"""DESIGN.md §1's layering, checked on the source: agents reach the control plane only
through proto/, and the control layer never imports the service layer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    root = ROOT / package
    for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("agents", ("cpn.registry", "cpn.control", "cpn.scheduler", "api")),
        ("cpn/registry", ("api", "agents")),
        ("cpn/control", ("api", "agents", "cpn.orchestration")),
        # Orchestration uses the control layer, never the service layer above it.
        ("cpn/orchestration", ("api", "agents")),
        ("cpn/scheduler", ("api", "agents")),
        # The runtime (resource layer) runs what the plan says; where it decides anything
        # itself (wan: auto moving its rung) it uses the shared pure functions, not the
        # scheduler's.
        (
            "cpn/train",
            ("cpn.scheduler", "cpn.registry", "cpn.control", "cpn.orchestration", "api", "agents"),
        ),
        # Shared by every layer (DESIGN.md §1), depending on none.
        (
            "cpn/wan_schedule.py",
            ("cpn.scheduler", "cpn.registry", "cpn.control", "cpn.orchestration", "cpn.train"),
        ),
        # The comm library sits under the runtime: usable by any DDP job on its own.
        (
            "cpn/comm",
            ("cpn.train", "cpn.control", "cpn.registry", "cpn.scheduler", "api", "agents"),
        ),
    ],
)
def test_layers(package: str, forbidden: tuple[str, ...]) -> None:
    assert (ROOT / package).exists()
    assert _violations(package, forbidden) == []


def test_the_check_sees_imports() -> None:
    # Guard against a checker that passes because it looks at nothing.
    assert "proto.cpn.v1" in _imports(ROOT / "agents" / "agent.py")
    # ... and one file is checked as well as a package.
    assert _violations("cpn/wan_schedule.py", ("cpn.costmodel",)) == [
        "cpn/wan_schedule.py imports cpn.costmodel"
    ]
