"""What an agent finds on its host: RDMA NICs from sysfs fixture trees, GPUs from
nvidia-smi's CSV (a real process printing the real format), the order of the sources."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from agents.discovery import DiscoveredGpu, DiscoveredNic, VirtualGpus, discover_gpus, discover_rdma
from agents.discovery.gpus import (
    NvidiaSmiError,
    from_nvidia_smi,
    from_nvml,
    nvidia_smi_usage,
    parse_nvidia_smi_csv,
    parse_nvidia_smi_usage_csv,
)
from agents.discovery.rdma import parse_rate, parse_state

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


# ---------------------------------------------------------------------------- RDMA


def test_infiniband_ports() -> None:
    assert discover_rdma(FIXTURES / "sysfs-infiniband") == [
        DiscoveredNic("mlx5_0", 1, "infiniband", 0, 200.0, "active"),
        DiscoveredNic("mlx5_1", 1, "infiniband", 0, 10.0, "down"),
    ]


def test_roce_v2_and_v1_from_the_gid_types() -> None:
    assert discover_rdma(FIXTURES / "sysfs-roce") == [
        DiscoveredNic("mlx4_0", 1, "roce", 1, 40.0, "active"),
        DiscoveredNic("mlx4_0", 2, "roce", 1, 40.0, "down"),
        DiscoveredNic("mlx5_2", 1, "roce", 2, 100.0, "active"),
    ]


def test_iwarp_is_decided_by_the_node_type_not_the_link_layer() -> None:
    assert discover_rdma(FIXTURES / "sysfs-iwarp") == [
        DiscoveredNic("cxgb4_0", 1, "iwarp", 0, 25.0, "active"),
        DiscoveredNic("cxgb4_0", 2, "iwarp", 0, 25.0, "init"),
    ]


def test_a_host_without_rdma_has_no_nics(tmp_path: Path) -> None:
    assert discover_rdma(tmp_path) == []


def test_an_unknown_link_layer_is_skipped(tmp_path: Path) -> None:
    port = tmp_path / "class" / "infiniband" / "odd0" / "ports" / "1"
    port.mkdir(parents=True)
    (port.parent.parent / "node_type").write_text("1: CA\n")
    (port / "link_layer").write_text("Carrier pigeon\n")
    assert discover_rdma(tmp_path) == []


@pytest.mark.parametrize(
    ("text", "gbps"),
    [
        ("200 Gb/sec (4X HDR)", 200.0),
        ("2.5 Gb/sec (1X SDR)", 2.5),
        ("400 Gb/sec (4X NDR)", 400.0),
        ("", 0.0),
        ("fast", 0.0),
    ],
)
def test_rate_strings(text: str, gbps: float) -> None:
    assert parse_rate(text) == gbps


@pytest.mark.parametrize(
    ("text", "state"),
    [
        ("4: ACTIVE", "active"),
        ("1: DOWN", "down"),
        ("5: ACTIVE_DEFER", "active_defer"),
        ("ARMED", "armed"),
        ("?", "down"),
    ],
)
def test_port_states(text: str, state: str) -> None:
    assert parse_state(text) == state


# ---------------------------------------------------------------------------- nvidia-smi


def test_nvidia_smi_query_csv() -> None:
    gpus = parse_nvidia_smi_csv((FIXTURES / "nvidia-smi" / "h100-query.csv").read_text())
    assert len(gpus) == 8
    assert gpus[3] == DiscoveredGpu(
        index=3,
        model="NVIDIA H100 80GB HBM3",
        memory_gb=81559 / 1024,
        uuid="GPU-4c1a9e3b-7d2f-4f6a-9b1e-0c2d3e4f5a03",
        source="nvidia-smi",
    )


def test_nvidia_smi_usage_csv_with_not_available_fields() -> None:
    usage = parse_nvidia_smi_usage_csv((FIXTURES / "nvidia-smi" / "h100-usage.csv").read_text())
    assert [(u.index, u.utilisation, u.memory_used_gb) for u in usage[:3]] == [
        (0, 0.0, 0.0),
        (1, 0.1, 1.0),
        (2, 0.2, 2.0),
    ]
    [mig] = parse_nvidia_smi_usage_csv((FIXTURES / "nvidia-smi" / "mig-usage.csv").read_text())
    assert mig.utilisation == 0.0 and mig.memory_used_gb == pytest.approx(12345 / 1024)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0, NVIDIA A100, 40960\n", "line 1: expected 4 fields"),
        ("0, A100, lots, GPU-1\n", "line 1: memory.total 'lots' is not a number"),
        ("x, A100, 1, GPU-1\n", "line 1: index 'x' is not a number"),
    ],
)
def test_nvidia_smi_garbage_is_refused(text: str, message: str) -> None:
    with pytest.raises(NvidiaSmiError, match=message):
        parse_nvidia_smi_csv(text)


def _fake_nvidia_smi(tmp_path: Path, body: str, code: int = 0) -> Path:
    """An executable that answers like nvidia-smi: the real process path, not a mock."""
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat <<'CSV'\n{body}CSV\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_gpus_from_an_nvidia_smi_process(tmp_path: Path) -> None:
    csv = (FIXTURES / "nvidia-smi" / "a100-query.csv").read_text()
    binary = _fake_nvidia_smi(tmp_path, csv)
    [gpu] = from_nvidia_smi(binary=str(binary)) or []
    assert (gpu.model, gpu.memory_gb, gpu.source) == ("NVIDIA A100-SXM4-40GB", 40.0, "nvidia-smi")
    usage = nvidia_smi_usage(binary=str(_fake_nvidia_smi(tmp_path, "0, 55, 2048\n")))
    assert usage is not None and usage[0].utilisation == 0.55


def test_nvidia_smi_missing_or_failing_means_no_gpus_from_it(tmp_path: Path) -> None:
    assert from_nvidia_smi(binary=str(tmp_path / "absent")) is None
    assert from_nvidia_smi(binary=str(_fake_nvidia_smi(tmp_path, "", code=9))) is None
    assert from_nvidia_smi(binary=str(_fake_nvidia_smi(tmp_path, "garbage\n"))) is None


# ---------------------------------------------------------------------------- the chain


def _gpu(source: str) -> list[DiscoveredGpu]:
    return [DiscoveredGpu(0, "X", 1.0, "u", source)]


def test_sources_are_tried_best_first() -> None:
    virtual = VirtualGpus(count=2)
    found = discover_gpus(
        virtual,
        nvml=lambda: _gpu("nvml"),
        nvidia_smi=lambda: _gpu("nvidia-smi"),
        torch_cuda=lambda: None,
    )
    assert found.source == "nvml"
    found = discover_gpus(
        virtual, nvml=lambda: None, nvidia_smi=lambda: _gpu("nvidia-smi"), torch_cuda=lambda: None
    )
    assert found.source == "nvidia-smi"
    found = discover_gpus(
        virtual, nvml=lambda: None, nvidia_smi=lambda: [], torch_cuda=lambda: _gpu("torch-cuda")
    )
    assert found.source == "torch-cuda"


def test_virtual_slots_when_no_gpu_is_found() -> None:
    found = discover_gpus(
        VirtualGpus(3, "A100", 40.0, 312.0),
        nvml=lambda: None,
        nvidia_smi=lambda: None,
        torch_cuda=lambda: None,
    )
    assert found.source == "virtual"
    assert [(g.index, g.model, g.memory_gb, g.tflops) for g in found.gpus] == [
        (i, "A100", 40.0, 312.0) for i in range(3)
    ]
    assert (
        discover_gpus(
            VirtualGpus(0), nvml=lambda: None, nvidia_smi=lambda: None, torch_cuda=lambda: None
        ).gpus
        == []
    )


def test_nvml_path() -> None:
    """Where NVML and a driver exist this lists the GPUs; elsewhere it must step aside
    (None) without raising, so the chain can go on. NOT exercised on GPU hardware in CI."""
    gpus = from_nvml()
    if gpus is None:
        return
    assert gpus and all(g.source == "nvml" and g.memory_gb > 0 and g.uuid for g in gpus)
    assert [g.index for g in gpus] == list(range(len(gpus)))
