"""Job: the model to train, how, with which parallel layout, and under what constraints.

The YAML form is documented in docs/contracts.md. A *shard* is one (data-parallel replica,
pipeline stage) pair: `tp` GPUs inside one node.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cpn.contracts.limits import INT32_MAX, INT64_MAX, MAX_GPU_MEMORY_GB, Label, Name


class Dtype(StrEnum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    @property
    def bytes(self) -> int:
        return 4 if self is Dtype.FP32 else 2


class WanCompression(StrEnum):
    """What data-parallel gradients look like when they cross the WAN."""

    NONE = "none"  # the gradient dtype, dense
    FP16 = "fp16"  # dense, cast to fp16
    TOPK = "topk"  # top-k sparsified with error feedback, fp16 values + compact indices
    INT8 = "int8"  # every value as int8, one fp32 scale per block, error feedback
    INT4 = "int4"  # every value as int4, one fp32 scale per block, error feedback
    OUTER = "outer"  # DiLoCo: in-site sync every step, pseudo-gradients every `every` steps
    AUTO = "auto"  # the scheduler picks one of the above from the measured WAN (`target`)


class OuterValues(StrEnum):
    """How outer-step pseudo-gradients cross the WAN (`compression.values`)."""

    DENSE = "dense"  # the gradient dtype
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"
    TOPK = "topk"

    @property
    def feedback(self) -> bool:
        """Whether the sender keeps what it could not send (error feedback)."""
        return self in (OuterValues.INT8, OuterValues.INT4, OuterValues.TOPK)


#: Inner steps between outer steps unless the job says (`compression.every`).
DEFAULT_OUTER_EVERY = 32


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """A GPT-like decoder: `layers` blocks of attention + MLP with hidden size `hidden`."""

    layers: int = Field(ge=1, le=100_000)
    hidden: int = Field(ge=1, le=1_000_000)
    heads: int = Field(ge=1, le=100_000)
    seq_len: int = Field(ge=1, le=10_000_000)
    vocab: int = Field(ge=1, le=100_000_000)

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelSpec:
        if self.hidden % self.heads:
            raise ValueError(
                f"heads: {self.heads} does not divide hidden ({self.hidden}); "
                "each head needs hidden/heads dimensions"
            )
        return self


class TrainSpec(_Strict):
    global_batch: int = Field(
        ge=1, le=INT32_MAX, description="sequences per iteration, all replicas together"
    )
    micro_batch: int = Field(
        ge=1, le=INT32_MAX, description="sequences per micro-batch on one replica"
    )
    dtype: Dtype = Dtype.BF16
    # Steps are counted in 64-bit columns; 2^31 − 1 is still far beyond any run.
    steps: int = Field(ge=1, le=INT32_MAX)
    lr: float = Field(
        default=3e-4, gt=0, le=1, allow_inf_nan=False, description="peak learning rate (AdamW)"
    )
    seed: int = Field(default=0, ge=0, le=INT64_MAX, description="initialisation and data seed")


class ParallelSpec(_Strict):
    dp: int = Field(ge=1, le=1_000_000)
    tp: int = Field(ge=1, le=1024)
    pp: int = Field(ge=1, le=100_000)

    @model_validator(mode="after")
    def _ranks_fit(self) -> ParallelSpec:
        # Ranks travel and are stored as 32-bit integers.
        if self.world_size > INT32_MAX:
            raise ValueError(
                f"dp×tp×pp = {self.world_size} workers: at most {INT32_MAX} (32-bit ranks)"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


class CompressionSpec(_Strict):
    wan: WanCompression = WanCompression.NONE
    density: float | None = Field(
        default=None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="fraction of entries sent (wan: topk, or wan: outer with values: topk)",
    )
    warmup_steps: int | None = Field(
        default=None,
        ge=0,
        le=INT32_MAX,
        description="steps over which top-k density ramps from 25 % down to `density`",
    )
    every: int | None = Field(
        default=None,
        ge=1,
        le=INT32_MAX,
        description="wan: outer — inner steps between outer steps (H, default 32)",
    )
    values: OuterValues | None = Field(
        default=None, description="wan: outer — how pseudo-gradients cross the WAN (fp16)"
    )
    outer_lr: float | None = Field(
        default=None, gt=0, le=10, allow_inf_nan=False, description="wan: outer (0.7)"
    )
    outer_momentum: float | None = Field(
        default=None, ge=0, lt=1, allow_inf_nan=False, description="wan: outer (0.9)"
    )
    target: float | None = Field(
        default=None,
        gt=0,
        le=10,
        allow_inf_nan=False,
        description="wan: auto — the WAN sync's share of an iteration's compute time (0.1)",
    )

    @model_validator(mode="after")
    def _fields_of_their_mode(self) -> CompressionSpec:
        outer = self.wan is WanCompression.OUTER
        if self.density is not None and not (
            self.wan is WanCompression.TOPK or (outer and self.outer_values is OuterValues.TOPK)
        ):
            raise ValueError(
                "density: only meaningful with wan: topk or wan: outer with values: topk, "
                f"not wan: {self.wan}" + (f" with values: {self.outer_values}" if outer else "")
            )
        if self.warmup_steps is not None and self.wan is not WanCompression.TOPK:
            raise ValueError(f"warmup_steps: only meaningful with wan: topk, not wan: {self.wan}")
        for name in ("every", "values", "outer_lr", "outer_momentum"):
            if getattr(self, name) is not None and not outer:
                raise ValueError(f"{name}: only meaningful with wan: outer, not wan: {self.wan}")
        if self.target is not None and self.wan is not WanCompression.AUTO:
            raise ValueError(f"target: only meaningful with wan: auto, not wan: {self.wan}")
        return self

    @property
    def summary(self) -> str:
        """One line for logs and metrics: 'fp16', 'topk 0.001', 'outer H=32 int8'."""
        if self.wan is WanCompression.OUTER:
            values = self.outer_values.value
            if self.outer_values is OuterValues.TOPK:
                values += f" {self.effective_density:g}"
            return f"outer H={self.outer_every} {values}"
        if self.wan is WanCompression.TOPK:
            return f"topk {self.effective_density:g}"
        return self.wan.value

    @property
    def auto_target(self) -> float:
        """wan: auto — the share of compute time the WAN sync may take (default 10 %)."""
        return self.target if self.target is not None else 0.1

    @property
    def outer_every(self) -> int:
        """H: inner steps per outer step (1 when not wan: outer)."""
        if self.wan is not WanCompression.OUTER:
            return 1
        return self.every if self.every is not None else DEFAULT_OUTER_EVERY

    @property
    def outer_values(self) -> OuterValues:
        return self.values if self.values is not None else OuterValues.FP16

    @property
    def effective_density(self) -> float:
        """Density of the sparse exchange (0.1 % under wan: topk, 1 % for outer top-k
        pseudo-gradients, unless given); 1.0 when nothing is sparse."""
        if self.wan is WanCompression.TOPK:
            return self.density if self.density is not None else 0.001
        if self.wan is WanCompression.OUTER and self.outer_values is OuterValues.TOPK:
            return self.density if self.density is not None else 0.01
        return 1.0


class ConstraintsSpec(_Strict):
    gpu_model: Label | None = None
    min_gpu_memory_gb: float | None = Field(
        default=None, gt=0, le=MAX_GPU_MEMORY_GB, allow_inf_nan=False
    )
    sites: list[Name] | None = Field(default=None, min_length=1)


class OnWorkerError(StrEnum):
    """What a worker that fails in user code (exits non-zero) does to its job."""

    RESTART = "restart"  # launch the job again from its last checkpoint, up to max_restarts
    FAIL = "fail"  # the job fails at once


class RecoverySpec(_Strict):
    """How a job survives failures (docs/contracts.md). Losses of infrastructure — an agent
    whose lease expired, a site cut off — always re-plan the job from its last checkpoint
    and do not use up `max_restarts`, which counts failures of the job's own workers."""

    max_restarts: int = Field(default=0, ge=0, le=1000)
    on_worker_error: OnWorkerError = OnWorkerError.FAIL
    checkpoint_every: int = Field(
        default=0,
        ge=0,
        le=INT32_MAX,
        description="steps between checkpoints (0: the control plane's default)",
    )
    stuck_after_s: float | None = Field(
        default=None,
        gt=0,
        le=7 * 86_400,
        allow_inf_nan=False,
        description="a running rank that finishes no step for this long is stuck: handled "
        "as a worker failure (None: never)",
    )


class JobSpec(_Strict):
    name: Name
    model: ModelSpec
    train: TrainSpec
    parallel: ParallelSpec | Literal["auto"]
    gpus: int | None = Field(
        default=None, ge=1, le=INT32_MAX, description="GPU budget, for parallel: auto"
    )
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    constraints: ConstraintsSpec = Field(default_factory=ConstraintsSpec)
    priority: int = Field(default=0, ge=-1000, le=1000)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.parallel == "auto":
            if self.gpus is None:
                raise ValueError("gpus: required with parallel: auto (the GPU budget)")
            if self.compression.wan is WanCompression.AUTO:
                raise ValueError(
                    "compression.wan: auto needs a fixed layout (parallel: {dp, tp, pp}); "
                    "with parallel: auto name the WAN sync"
                )
            return self
        par = self.parallel
        if self.gpus is not None and self.gpus != par.world_size:
            raise ValueError(
                f"gpus: {self.gpus} but parallel dp×tp×pp = {par.dp}×{par.tp}×{par.pp} "
                f"= {par.world_size}"
            )
        problem = layout_problem(self.model, self.train, par)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def fixed_parallel(self) -> ParallelSpec:
        """The explicit layout; for `auto` jobs the scheduler chooses one first."""
        if self.parallel == "auto":
            raise ValueError("parallel: auto has no fixed layout yet")
        return self.parallel


def layout_problem(model: ModelSpec, train: TrainSpec, par: ParallelSpec) -> str | None:
    """Why `par` cannot run this model and batch, as 'field: reason', or None if it can."""
    if model.layers % par.pp:
        return f"parallel.pp: {par.pp} does not divide model.layers ({model.layers})"
    if model.heads % par.tp:
        return f"parallel.tp: {par.tp} does not divide model.heads ({model.heads})"
    per_step = par.dp * train.micro_batch
    if train.global_batch % per_step:
        return (
            f"train.global_batch: {train.global_batch} is not a multiple of "
            f"dp × micro_batch = {par.dp} × {train.micro_batch} = {per_step}"
        )
    return None
