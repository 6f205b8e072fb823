"""The GPU path, where there are GPUs: workers train on `cuda:LOCAL_RANK` with NCCL and
follow the CPU's loss curve. Skipped on machines without CUDA (like the CI machine);
`pytest -m cuda` runs them on a GPU host."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from agents.discovery.gpus import (
    VirtualGpus,
    discover_gpus,
    from_nvidia_smi,
    from_nvml,
    from_torch_cuda,
    sample_usage,
)
from cpn import wire
from cpn.comm.codec import decode, encode
from cpn.comm.quant import dequantize, quantize
from cpn.comm.select import topk_indices
from cpn.registry.gpu_specs import DEFAULT_TFLOPS, peak_tflops
from cpn.train.launcher import WorkerFailed
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


@pytest.mark.skipif(_gpus() < 1, reason="needs a GPU")
def test_the_wire_codecs_give_the_same_bytes_on_the_gpu_as_on_the_cpu() -> None:
    """Top-k selection, its payload and the low-bit quantiser: a GPU worker and a CPU
    worker of one job must put the same bytes on the wire (the CPU path is the one the
    property tests check), non-finite entries included."""
    gen = torch.Generator().manual_seed(7)
    for numel in (1, 7, 1000, 70_001, 300_000):
        # Distinct magnitudes: where they tie either answer is a correct top-k.
        x = (torch.randperm(numel, generator=gen).float() + 1) / numel
        x *= torch.where(torch.rand(numel, generator=gen) < 0.5, -1.0, 1.0)
        gpu = x.cuda()
        for k in sorted({0, 1, max(1, numel // 1000), numel // 7, numel}):
            cpu_idx = topk_indices(x, k)
            gpu_idx = topk_indices(gpu, k)
            assert gpu_idx.device.type == "cuda"
            assert torch.equal(gpu_idx.cpu(), cpu_idx), (numel, k)
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                cpu_payload = encode(x[cpu_idx], cpu_idx, numel, dtype)
                gpu_payload = encode(gpu[gpu_idx], gpu_idx, numel, dtype)
                assert gpu_payload.device.type == "cuda"
                assert torch.equal(gpu_payload.cpu(), cpu_payload), (numel, k, dtype)
                values, indices = decode(gpu_payload, numel, k, dtype)
                assert torch.equal(indices.cpu(), cpu_idx)
                assert torch.equal(values.cpu(), decode(cpu_payload, numel, k, dtype)[0])
        y = x.clone()
        y[::97] = float("nan")
        y[5::89] = float("inf")
        scales = wire.quant_blocks(numel, wire.QUANT_BLOCK_ELEMENTS) * wire.QUANT_SCALE_BYTES
        for source in (x, y):
            for bits in (4, 8):
                cpu_payload, cpu_sent = quantize(source, bits)
                gpu_payload, gpu_sent = quantize(source.cuda(), bits)
                # The codes byte for byte; the fp32 scales as values (a NaN scale may have
                # another bit pattern on the GPU: any NaN is the same non-finite step).
                assert torch.equal(gpu_payload[scales:].cpu(), cpu_payload[scales:])
                gpu_scales = gpu_payload[:scales].cpu().view(torch.float32)
                same(gpu_scales, cpu_payload[:scales].view(torch.float32))
                same(gpu_sent.cpu(), cpu_sent)
                back = dequantize(gpu_payload, numel, bits)
                assert back.device.type == "cuda"
                same(back.cpu(), dequantize(cpu_payload, numel, bits))


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(_gpus() < 1, reason="needs a GPU")
def test_a_checkpoint_moves_between_the_gpu_and_the_cpu(tmp_path: Path) -> None:
    """A run checkpointed on a GPU resumes on the CPU and the other way round, on the
    curve of a run that never stopped (a site that lost its GPUs, or a debug run)."""
    doc = tiny_job(1, 1, 1, steps=8)
    straight = run(tmp_path, "straight", doc, device="cpu")
    for first, then in (("cuda", "cpu"), ("cpu", "cuda")):
        store = tmp_path / f"ckpt-{first}"
        head = run(
            tmp_path, f"{first}-head", doc, device=first, checkpoint_store=str(store),
            stop_after=4,
        )  # fmt: skip
        tail = run(
            tmp_path, f"{first}-then-{then}", doc, device=then,
            resume_from=str(store / "step-00000004"),
        )  # fmt: skip
        assert [s.step for s in head + tail] == list(range(8))
        for a, b in zip(head + tail, straight, strict=True):
            assert abs(a.loss - b.loss) <= 1e-3 * abs(b.loss), (first, a.step, a.loss, b.loss)


@pytest.mark.skipif(_gpus() != 1, reason="needs exactly one GPU")
def test_more_workers_on_a_node_than_gpus_is_refused_in_one_line(tmp_path: Path) -> None:
    """Two workers and one GPU: NCCL cannot put both on it; the worker says so and what
    to do, instead of NCCL's duplicate-GPU failure at the first collective."""
    with pytest.raises(WorkerFailed, match=r"2 workers on this node but 1 GPU\(s\) visible"):
        run(tmp_path, "two", tiny_job(2, 1, 1, steps=2))
    steps = run(tmp_path, "cpu", tiny_job(2, 1, 1, steps=2), device="cpu")
    assert [s.step for s in steps] == [0, 1]


@pytest.mark.skipif(_gpus() < 1, reason="needs a GPU")
def test_the_agents_gpu_sources_agree_on_a_real_gpu() -> None:
    """NVML (where nvidia-ml-py is installed), nvidia-smi and torch.cuda list the same
    GPUs with the same memory, the chain picks the first, the usage samplers read them, and
    the model name finds a real peak in the control plane's table (not the default)."""
    via_torch = from_torch_cuda()
    assert via_torch and len(via_torch) == _gpus()
    sources = {"torch-cuda": via_torch}
    if shutil.which("nvidia-smi"):
        sources["nvidia-smi"] = from_nvidia_smi() or []
    if importlib.util.find_spec("pynvml") is not None:
        sources["nvml"] = from_nvml() or []
    for name, gpus in sources.items():
        assert [g.index for g in gpus] == list(range(_gpus())), name
        for g, t in zip(gpus, via_torch, strict=True):
            assert abs(g.memory_gb - t.memory_gb) <= 0.02 * t.memory_gb, (name, g, t)
            assert g.uuid and g.model, (name, g)
            assert peak_tflops(g.model) != DEFAULT_TFLOPS, (name, g.model)
    found = discover_gpus(VirtualGpus(0))
    assert found.source != "none" and len(found.gpus) == _gpus()
    usage = sample_usage(found.source)
    if found.source != "torch-cuda":
        assert usage is not None and len(usage) == _gpus()
        assert all(0 <= u.utilisation <= 1 and u.memory_used_gb >= 0 for u in usage)
    print({name: [(g.model, round(g.memory_gb, 1), g.uuid) for g in gpus]
           for name, gpus in sources.items()})  # fmt: skip
