"""Regenerate the Python code for the agent protocol: `python -m proto.generate`.

The generated modules are committed (see proto/README.md for why) and a test checks that
running this again gives byte-identical files, so a change to a .proto file cannot be
merged without its generated code.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

#: The repository root: protoc runs with it as the include path, so a file's proto path is
#: `proto/cpn/v1/x.proto` and the generated imports read `from proto.cpn.v1 import x_pb2`,
#: which is where the modules really live (not our own `cpn` package).
ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "cpn" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def _plugin(name: str) -> str:
    # The mypy-protobuf plugins are console scripts installed beside this interpreter.
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: install the dev extra (pip install -e '.[dev]')")
    return found


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Run protoc on every .proto file, writing under `out_dir`; return the files made."""
    from grpc_tools import protoc  # noqa: PLC0415 (a dev dependency, only needed here)

    out_dir.mkdir(parents=True, exist_ok=True)
    protos = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    made = out_dir / "proto" / "cpn" / "v1"
    return sorted(p for p in made.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str]) -> None:
    # `--out DIR` generates elsewhere (the drift test compares DIR with the committed files).
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else ROOT
    for path in generate(out):
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
