"""A checkpoint that cannot be used is refused before any worker starts, with one line
naming the file (and the field): checked on real `torch.distributed.checkpoint` files,
written here in one process (no process group needed), then damaged."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save

from cpn.contracts.job import JobSpec
from cpn.errors import InputError
from cpn.train.checkpoint import INFO, CheckpointInfo, CheckpointStore, check_resumable
from tests.factories import job

STEP = 3


def spec() -> JobSpec:
    return job(1, 1, 1, layers=2, hidden=64, heads=4, seq_len=16, vocab=256)


def info(step: int = STEP) -> CheckpointInfo:
    j = spec()
    return CheckpointInfo(
        step=step,
        job=j.name,
        model=j.model.model_dump(),
        parallel={"dp": 1, "tp": 1, "pp": 1},  # type: ignore[arg-type]
        sites=["a"],
        plan_digest="0" * 64,
        compression="none",
    )


def write_checkpoint(root: Path, step: int = STEP) -> CheckpointStore:
    """A real checkpoint: `dcp.save` of a few tensors (one data file, ~200 KB), committed."""
    store = CheckpointStore(str(root))
    gen = torch.Generator().manual_seed(0)
    state = {f"model/w{i}": torch.randn(128, 128, generator=gen) for i in range(3)}
    state["train/step"] = torch.tensor(step)
    save(state, storage_writer=store.writer(step))
    store.mark_complete(info(step))
    return store


def step_dir(store: CheckpointStore, step: int = STEP) -> Path:
    return Path(store.step_path(step))


def edit_info(store: CheckpointStore, edit: Callable[[dict[str, Any]], None]) -> None:
    path = step_dir(store) / INFO
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def one_line(exc: pytest.ExceptionInfo[InputError]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_a_sound_checkpoint_resumes(tmp_path: Path) -> None:
    store = write_checkpoint(tmp_path)
    assert check_resumable(store, spec()) == STEP
    assert store.info(STEP) == info()


def _set(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc[field] = value

    return edit


def _drop(field: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc.pop(field)

    return edit


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_set("step", "twelve"), "step"),
        (_set("step", "3"), "step"),  # strict: a string is not a step
        (_set("step", -1), "step"),
        (_set("step", True), "step"),
        (_set("parallel", None), "parallel"),
        (_set("parallel", {"dp": 0, "tp": 1, "pp": 1}), "parallel.dp"),
        (_set("parallel", {"dp": 1, "tp": 1}), "parallel.pp"),
        (_set("model", ["layers", 2]), "model"),
        (_set("model", {"layers": "two"}), "model.layers"),
        (_set("sites", "a"), "sites"),
        (_set("job", 7), "job"),
        (_drop("plan_digest"), "plan_digest"),
        (_drop("compression"), "compression"),
    ],
)
def test_a_cpn_json_with_a_wrong_field_is_one_line_naming_file_and_field(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], field: str
) -> None:
    store = write_checkpoint(tmp_path)
    edit_info(store, edit)
    with pytest.raises(InputError) as exc:
        check_resumable(store, spec())
    line = one_line(exc)
    assert line.startswith(f"checkpoint {step_dir(store) / INFO}: {field}: "), line


@pytest.mark.parametrize(
    ("text", "problem"),
    [("{not json", "unreadable"), ("[1, 2]", "not a JSON object"), ("null", "not a JSON object")],
)
def test_a_cpn_json_that_is_not_an_object_is_one_line(
    tmp_path: Path, text: str, problem: str
) -> None:
    store = write_checkpoint(tmp_path)
    (step_dir(store) / INFO).write_text(text)
    with pytest.raises(InputError) as exc:
        check_resumable(store, spec())
    assert one_line(exc).startswith(f"checkpoint {step_dir(store) / INFO}: {problem}")

