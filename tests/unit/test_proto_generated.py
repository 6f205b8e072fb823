"""The committed protocol code is exactly what the pinned generators make of the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from proto.cpn.v1 import agent_pb2
from proto.generate import GENERATED_SUFFIXES, PROTO_DIR, ROOT


def test_regenerating_gives_identical_files(tmp_path: Path) -> None:
    # In a fresh interpreter: grpc_tools' bundled protobuf aborts the process when loaded
    # beside descriptors that are already in memory (ours, grpc health's, ...).
    done = subprocess.run(
        [sys.executable, "-m", "proto.generate", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    made = tmp_path / "proto" / "cpn" / "v1"
    fresh = {p.name: p.read_bytes() for p in made.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
    committed = {
        p.name: p.read_bytes() for p in PROTO_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES)
    }
    assert sorted(fresh) == sorted(committed), (
        "generated file set differs: run python -m proto.generate"
    )
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated code {stale}: run python -m proto.generate"


def test_enums_start_with_unspecified_zero() -> None:
    for name, enum in agent_pb2.DESCRIPTOR.enum_types_by_name.items():
        zero = enum.values_by_number[0].name
        assert zero.endswith("_UNSPECIFIED"), f"{name}: value 0 is {zero}"
