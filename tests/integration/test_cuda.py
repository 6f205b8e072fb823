"""The GPU path, where there are GPUs: workers train on `cuda:LOCAL_RANK` with NCCL and
follow the CPU's loss curve. Skipped on machines without CUDA (like the CI machine);
`pytest -m cuda` runs them on a GPU host."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.runtime import run, tiny_job

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpus() < 1, reason="needs a GPU")
def test_one_worker_trains_on_its_gpu(tmp_path: Path) -> None:
    cpu = run(tmp_path, "cpu", tiny_job(1, 1, 1, steps=6), device="cpu")
    gpu = run(tmp_path, "gpu", tiny_job(1, 1, 1, steps=6))
    records = (tmp_path / "gpu" / "work" / "rank-0.metrics.jsonl").read_text()
    assert '"device": "cuda:0"' in records
    for a, b in zip(gpu, cpu, strict=True):
        assert abs(a.loss - b.loss) <= 1e-3 * abs(b.loss), (a.step, a.loss, b.loss)


@pytest.mark.skipif(_gpus() < 8, reason="needs 8 GPUs")
def test_dp2_tp2_pp2_on_eight_gpus_follows_the_cpu_curve(tmp_path: Path) -> None:
    cpu = run(tmp_path, "cpu", tiny_job(1, 1, 1, steps=6), device="cpu")
    gpu = run(tmp_path, "gpu", tiny_job(2, 2, 2, steps=6))
    devices = {
        line.split('"device": "')[1].split('"')[0]
        for path in (tmp_path / "gpu" / "work").glob("rank-*.metrics.jsonl")
        for line in path.read_text().splitlines()
    }
    assert devices <= {f"cuda:{i}" for i in range(8)} and len(devices) >= 2
    for a, b in zip(gpu, cpu, strict=True):
        assert abs(a.loss - b.loss) <= 1e-3 * abs(b.loss), (a.step, a.loss, b.loss)


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
def test_dp2_on_two_gpus_with_topk_trains(tmp_path: Path) -> None:
    steps = run(tmp_path, "topk", tiny_job(2, 1, 1, steps=30, wan="topk", density=0.05))
    assert steps[-1].loss < steps[0].loss
