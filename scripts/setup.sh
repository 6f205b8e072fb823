#!/usr/bin/env bash
# Set up everything cpn needs on a fresh Debian machine, idempotently:
#   - a virtual environment in .venv with torch pinned to the CPU build (an unpinned torch
#     pulls gigabytes of CUDA packages), then cpn itself (editable) with its dev tools;
#   - iproute2 (ip, tc) for `cpn demo`'s emulated sites and the benchmarks, and Debian's
#     chromium and chromium-driver for the dashboard's browser test, when they are missing
#     and we are root;
#   - Slurm's controller, node daemon and client, and munge (Debian's slurmctld, slurmd,
#     slurm-client, munge) when we are root: the Slurm backend's tests start a real
#     cluster on this host (tests/slurm_cluster.py) and fail, not skip, without them;
#   - the local PostgreSQL server, started if it is installed but not running (the
#     registry tests run against it and must fail, not skip, when it is unreachable).
# Re-running is cheap: the Python install is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.cpn-installed

if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing iproute2 (ip, tc)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 >/dev/null
    fi
fi

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v slurmd >/dev/null 2>&1 \
    || ! command -v sbatch >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing Slurm (slurmctld, slurmd, slurm-client) and munge"
        install="apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge"
        DEBIAN_FRONTEND=noninteractive $install >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $install >/dev/null; }
    fi
fi

if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing chromium and chromium-driver (the dashboard's browser test)"
        install="apt-get install -y -q --no-install-recommends chromium chromium-driver"
        # A fresh machine may not have the package lists yet.
        DEBIAN_FRONTEND=noninteractive $install >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $install >/dev/null; } \
            || echo "setup: WARNING: could not install chromium (the dashboard's browser test needs it)"
    fi
fi

# uPlot, the dashboard's chart library: from the npm registry, served by `cpn serve` from
# api/ui/vendor/ (nothing is fetched from a CDN when the page is viewed).
UPLOT=1.6.32
VENDOR=api/ui/vendor
if [ "$(cat "$VENDOR/VERSION" 2>/dev/null)" != "$UPLOT" ]; then
    if ! command -v npm >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing npm (to fetch the dashboard's chart library)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends npm >/dev/null || true
    fi
    mkdir -p build
    if command -v npm >/dev/null 2>&1 && (cd build && npm pack --silent "uplot@$UPLOT" >/dev/null); then
        echo "setup: vendored uPlot $UPLOT (npm) into $VENDOR"
        mkdir -p "$VENDOR"
        tar -xzf "build/uplot-$UPLOT.tgz" -C build \
            package/dist/uPlot.iife.min.js package/dist/uPlot.min.css package/LICENSE
        cp build/package/dist/uPlot.iife.min.js build/package/dist/uPlot.min.css "$VENDOR/"
        cp build/package/LICENSE "$VENDOR/uPlot.LICENSE"
        echo "$UPLOT" > "$VENDOR/VERSION"
    else
        echo "setup: WARNING: no uPlot (needs npm): the dashboard at /ui shows no charts"
    fi
fi

if command -v pg_ctlcluster >/dev/null 2>&1 && command -v pg_isready >/dev/null 2>&1; then
    if ! pg_isready -q -h 127.0.0.1 -p 5432; then
        echo "setup: starting PostgreSQL"
        pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    echo "setup: installing Python packages (torch 2.13.0 CPU build first)"
    "$VENV/bin/pip" install -q --upgrade pip >/dev/null
    # PyPI's Linux torch wheel is the CUDA build; PyTorch's CPU index has the +cpu one
    # (which pip prefers: the local version sorts higher). Used where it can be reached;
    # elsewhere (a mirror, a wheel directory in pip's config) pip finds torch as set up.
    torch_index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
    torch_args=()
    if "$VENV/bin/python" - "$torch_index" >/dev/null 2>&1 <<'PY'; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5)
PY
        torch_args=(--extra-index-url "$torch_index")
    fi
    "$VENV/bin/pip" install -q "${torch_args[@]}" "torch==2.13.0"
    "$VENV/bin/pip" install -q -e ".[dev]"
    echo "$want" > "$STAMP"
fi
