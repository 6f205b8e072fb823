"""GPU discovery, best source first: NVML (nvidia-ml-py, the `nvml` extra), then the
`nvidia-smi` CSV query, then `torch.cuda`, then the virtual slots given on the command line
(CPU-only hosts, demos, tests).

The same source later samples utilisation for heartbeats (NVML or nvidia-smi; virtual
GPUs count as busy while a worker runs on them).
"""

from __future__ import annotations

import csv
import glob
import io
import logging
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger("cpn.agent")

MIB_PER_GIB = 1024.0
NVIDIA_SMI_QUERY = "index,name,memory.total,uuid"
NVIDIA_SMI_USAGE_QUERY = "index,utilization.gpu,memory.used"


@dataclass(frozen=True)
class DiscoveredGpu:
    index: int
    model: str
    memory_gb: float
    uuid: str
    source: str  # nvml | nvidia-smi | torch-cuda | virtual
    tflops: float = 0.0  # 0: unknown; the control plane fills it from the model name


@dataclass(frozen=True)
class GpuUsageSample:
    index: int
    utilisation: float  # 0..1
    memory_used_gb: float


@dataclass(frozen=True)
class VirtualGpus:
    count: int = 0
    model: str = "virtual"
    memory_gb: float = 80.0
    tflops: float = 100.0


class NvidiaSmiError(ValueError):
    """nvidia-smi printed something that is not the CSV we asked for."""


# ---------------------------------------------------------------------------- NVML


def from_nvml() -> list[DiscoveredGpu] | None:
    """GPUs as NVML sees them, or None when NVML (library or driver) is not there."""
    try:
        import pynvml  # noqa: PLC0415 (optional extra: cpn[nvml])
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            gpus.append(
                DiscoveredGpu(
                    index=i,
                    model=name.decode() if isinstance(name, bytes) else str(name),
                    memory_gb=float(memory.total) / 2**30,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    source="nvml",
                )
            )
        return gpus
    except Exception as exc:
        log.warning("NVML: %s; trying nvidia-smi", exc)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            log.debug("NVML shutdown failed", exc_info=True)


def nvml_usage() -> list[GpuUsageSample] | None:
    try:
        import pynvml  # noqa: PLC0415

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(GpuUsageSample(i, util.gpu / 100.0, float(memory.used) / 2**30))
        return out
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            log.debug("NVML shutdown failed", exc_info=True)


# ---------------------------------------------------------------------------- nvidia-smi

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=20, check=False)


def _csv_rows(text: str) -> list[list[str]]:
    rows = []
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if row and any(cell.strip() for cell in row):
            rows.append([cell.strip() for cell in row])
    return rows


def _number(cell: str, what: str, line: int) -> float:
    try:
        return float(cell)
    except ValueError:
        raise NvidiaSmiError(f"line {line}: {what} {cell!r} is not a number") from None


def parse_nvidia_smi_csv(text: str) -> list[DiscoveredGpu]:
    """Parse `nvidia-smi --query-gpu=index,name,memory.total,uuid
    --format=csv,noheader,nounits` (memory in MiB)."""
    gpus = []
    for n, row in enumerate(_csv_rows(text), start=1):
        if len(row) != 4:
            raise NvidiaSmiError(
                f"line {n}: expected 4 fields ({NVIDIA_SMI_QUERY}), got {len(row)}"
            )
        index, name, memory, uuid = row
        memory_gb = (
            0.0 if memory.startswith("[") else _number(memory, "memory.total", n) / MIB_PER_GIB
        )
        gpus.append(
            DiscoveredGpu(
                index=int(_number(index, "index", n)),
                model=name,
                memory_gb=memory_gb,
                uuid=uuid,
                source="nvidia-smi",
            )
        )
    return gpus


def parse_nvidia_smi_usage_csv(text: str) -> list[GpuUsageSample]:
    """Parse `--query-gpu=index,utilization.gpu,memory.used` (percent, MiB); `[N/A]` → 0."""
    out = []
    for n, row in enumerate(_csv_rows(text), start=1):
        if len(row) != 3:
            raise NvidiaSmiError(f"line {n}: expected 3 fields, got {len(row)}")
        index, util, used = row
        out.append(
            GpuUsageSample(
                index=int(_number(index, "index", n)),
                utilisation=0.0 if util.startswith("[") else _number(util, "utilization", n) / 100,
                memory_used_gb=0.0
                if used.startswith("[")
                else _number(used, "memory", n) / MIB_PER_GIB,
            )
        )
    return out


def from_nvidia_smi(run: Runner = _run, binary: str = "nvidia-smi") -> list[DiscoveredGpu] | None:
    try:
        done = run([binary, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"])
    except (FileNotFoundError, PermissionError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        log.warning("nvidia-smi exited %d: %s", done.returncode, done.stderr.strip()[:200])
        return None
    try:
        return parse_nvidia_smi_csv(done.stdout)
    except NvidiaSmiError as exc:
        log.warning("nvidia-smi: %s", exc)
        return None


def nvidia_smi_usage(run: Runner = _run, binary: str = "nvidia-smi") -> list[GpuUsageSample] | None:
    try:
        done = run(
            [binary, f"--query-gpu={NVIDIA_SMI_USAGE_QUERY}", "--format=csv,noheader,nounits"]
        )
        return parse_nvidia_smi_usage_csv(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, NvidiaSmiError):
        return None


# ---------------------------------------------------------------------------- torch.cuda


def _gpu_device_nodes() -> bool:
    # torch.cuda needs a driver: without NVIDIA's or ROCm's device nodes there is no GPU to
    # find, and importing torch (seconds, hundreds of MB) would be wasted on every start.
    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/kfd"))


def from_torch_cuda() -> list[DiscoveredGpu] | None:
    if not _gpu_device_nodes():
        return None
    try:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            return None
        gpus = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(
                DiscoveredGpu(
                    index=i,
                    model=props.name,
                    memory_gb=props.total_memory / 2**30,
                    uuid=str(getattr(props, "uuid", "")),
                    source="torch-cuda",
                )
            )
        return gpus
    except Exception as exc:
        log.warning("torch.cuda: %s", exc)
        return None


# ---------------------------------------------------------------------------- the chain


@dataclass(frozen=True)
class GpuDiscovery:
    gpus: list[DiscoveredGpu]
    source: str  # where they came from, or "none"


def virtual_gpus(spec: VirtualGpus) -> list[DiscoveredGpu]:
    return [
        DiscoveredGpu(
            index=i,
            model=spec.model,
            memory_gb=spec.memory_gb,
            uuid=f"virtual-{i}",
            source="virtual",
            tflops=spec.tflops,
        )
        for i in range(spec.count)
    ]


def discover_gpus(
    virtual: VirtualGpus,
    *,
    nvml: Callable[[], list[DiscoveredGpu] | None] = from_nvml,
    nvidia_smi: Callable[[], list[DiscoveredGpu] | None] = from_nvidia_smi,
    torch_cuda: Callable[[], list[DiscoveredGpu] | None] = from_torch_cuda,
) -> GpuDiscovery:
    """The first source that finds at least one GPU wins; virtual slots come last."""
    for name, probe in (("nvml", nvml), ("nvidia-smi", nvidia_smi), ("torch-cuda", torch_cuda)):
        found = probe()
        if found:
            return GpuDiscovery(found, name)
    if virtual.count > 0:
        return GpuDiscovery(virtual_gpus(virtual), "virtual")
    return GpuDiscovery([], "none")


def sample_usage(source: str) -> list[GpuUsageSample] | None:
    if source == "nvml":
        return nvml_usage()
    if source == "nvidia-smi":
        return nvidia_smi_usage()
    return None
