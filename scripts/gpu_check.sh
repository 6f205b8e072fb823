#!/usr/bin/env bash
# The checks that need NVIDIA GPUs, on a host with a CUDA build of torch and no network:
# cpn's other dependencies may come as wheels in .whl/ (installed into /tmp/site), since
# such a host's Python is often not the project's virtual environment. Writes the pytest
# log to $OUT/gpu-check.log when OUT is set. Usage: scripts/gpu_check.sh [pytest args…]
# On this workplace's GPU image (Python 3.12, torch, grpcio, protobuf, typer, pytest,
# hypothesis there) the wheels needed were, at the versions of the project's lock:
# SQLAlchemy greenlet alembic Mako pydantic pydantic_core pydantic-settings python-dotenv
# annotated-types annotated-doc typing-inspection ortools immutabledict protobuf psycopg
# psycopg-binary (about 41 MB: `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux_2_28_x86_64 … -d .whl NAME==VERSION`).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi -L || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
    "gpus", torch.cuda.device_count())'
log="${OUT:-/tmp}/gpu-check.log"
python3 -m pytest -m "" -v -rs -p no:cacheprovider --durations=10 \
    tests/integration/test_cuda.py tests/unit/test_discovery.py "$@" 2>&1 | tee "$log"
