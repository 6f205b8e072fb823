"""Peak dense TFLOP/s of common GPU models, for GPUs whose agent could not tell.

NVML and nvidia-smi report a GPU's name and memory but not its speed; the scheduler's cost
model needs one. Figures are the vendors' dense BF16/FP16 tensor-core peaks (no
sparsity); matching is by substring of the reported name, longest key first, so
"NVIDIA H100 80GB HBM3" finds "H100".
"""

from __future__ import annotations

PEAK_TFLOPS: dict[str, float] = {
    "GB200": 2500.0,
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "A100": 312.0,
    "A800": 312.0,
    "A30": 165.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "V100": 125.0,
    "T4": 65.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
}

#: Used when the model is unknown: a mid-range accelerator, so plans stay plausible.
DEFAULT_TFLOPS = 100.0


def peak_tflops(model: str) -> float:
    name = model.upper()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key]
    return DEFAULT_TFLOPS
