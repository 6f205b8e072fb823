"""Every tensor cpn makes in a training step names its device.

On a GPU host a tensor made without a device lands on the CPU and the step fails (or
silently copies); on this CPU-only machine both look the same. So the check is on the
code: a TorchFunctionMode watches every factory call made *from cpn's own files* during
real training steps — tensor-parallel, pipeline, data-parallel sync dense and top-k, on
8 real workers — and records any that does not pass `device=` equal to the worker's
chosen device. Tensors made like another (`*_like`, `new_*`, views, arithmetic) follow
their input and are fine by construction.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from cpn.contracts import JobSpec, Plan
from cpn.train.trainer import Trainer, TrainOptions
from tests.integration.ranks import run_ranks
from tests.integration.runtime import replica_per_site, tiny_job

pytestmark = pytest.mark.slow

CPN = str(Path(__file__).resolve().parents[2] / "cpn")
FACTORIES = {
    torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor,
    torch.as_tensor, torch.rand, torch.randn, torch.randint, torch.empty_strided,
    torch.linspace, torch.eye, torch.from_numpy, torch.scalar_tensor,
}  # fmt: skip


class DeviceAudit(TorchFunctionMode):
    """Records factory calls from files under `root` that do not name `device`."""

    def __init__(self, device: torch.device, root: str) -> None:
        super().__init__()
        self.device, self.root = device, root
        self.offences: list[str] = []
        self.checked = 0  # factory calls from `root` that were looked at

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES:
            caller: FrameType | None = sys._getframe(1)
            while caller is not None and "torch" in caller.f_code.co_filename.split("/")[-3:-1]:
                caller = caller.f_back  # torch's own wrappers around the call
            if caller is not None and caller.f_code.co_filename.startswith(self.root):
                self.checked += 1
                named = kwargs.get("device")
                if named is None or torch.device(named) != self.device:
                    where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
                    self.offences.append(f"{func.__name__}(device={named}) at {where}")
        return func(*args, **kwargs)


def _audited_steps(rank: int, world: int, plan_json: str, job_json: str) -> tuple[list[str], int]:
    plan = Plan.model_validate_json(plan_json)
    job = JobSpec.model_validate_json(job_json)
    trainer = Trainer(plan, job, rank, TrainOptions(stop_after=2))
    trainer.start()  # the process group exists (the test launcher made it)
    with DeviceAudit(trainer.device, CPN) as audit:
        trainer.train(0)
    return audit.offences, audit.checked


def test_the_audit_catches_a_tensor_made_without_a_device() -> None:
    # Guard against an audit that passes because it sees nothing.
    with DeviceAudit(torch.device("cpu"), str(Path(__file__).resolve())) as audit:
        torch.zeros(3)
        torch.zeros(3, device="cpu")
    assert len(audit.offences) == 1 and "zeros(device=None)" in audit.offences[0]


@pytest.mark.parametrize("compression", [{"wan": "none"}, {"wan": "topk", "density": 0.05}])
def test_no_tensor_is_made_off_the_workers_device_in_a_step(compression: dict[str, Any]) -> None:
    doc = tiny_job(2, 2, 2, 4, **compression)
    plan = replica_per_site(doc)  # data parallelism across sites: the whole sync runs
    job = JobSpec.model_validate(doc)
    results = run_ranks(_audited_steps, 8, plan.model_dump_json(), job.model_dump_json())
    offences = sorted({o for per_rank, _ in results for o in per_rank})
    assert offences == []
    assert all(checked > 0 for _, checked in results)  # it did look at cpn's tensors
