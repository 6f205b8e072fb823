"""The committed protocol code is exactly what the pinned generators make of the .proto files."""

from __future__ import annotations

from pathlib import Path

from proto.cpn.v1 import agent_pb2
from proto.generate import GENERATED_SUFFIXES, PROTO_DIR, generate


def test_regenerating_gives_identical_files(tmp_path: Path) -> None:
    fresh = {p.name: p.read_bytes() for p in generate(tmp_path)}
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
