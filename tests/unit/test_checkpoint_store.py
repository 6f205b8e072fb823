"""A checkpoint that cannot be used is refused before any worker starts, with one line
naming the file (and the field): checked on real `torch.distributed.checkpoint` files,
written here in one process (no process group needed), then damaged."""

from __future__ import annotations

import json
import zlib
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


def info(step: int = STEP, j: JobSpec | None = None) -> CheckpointInfo:
    j = j or spec()
    return CheckpointInfo(
        step=step,
        job=j.name,
        model=j.model.model_dump(),
        parallel={"dp": 1, "tp": 1, "pp": 1},  # type: ignore[arg-type]
        sites=["a"],
        plan_digest="0" * 64,
        compression="none",
    )


def write_checkpoint(root: Path, step: int = STEP, j: JobSpec | None = None) -> CheckpointStore:
    """A real checkpoint: `dcp.save` of a few tensors (one data file, ~200 KB), committed."""
    store = CheckpointStore(str(root))
    gen = torch.Generator().manual_seed(0)
    state = {f"model/w{i}": torch.randn(128, 128, generator=gen) for i in range(3)}
    state["train/step"] = torch.tensor(step)
    save(state, storage_writer=store.writer(step))
    store.mark_complete(info(step, j))
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
    got = store.info(STEP)
    assert got.model_copy(update={"files": None}) == info()


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


def data_file(store: CheckpointStore) -> Path:
    (path,) = step_dir(store).glob("*.distcp")
    return path


def _xor(start: Callable[[int], int], length: int) -> Callable[[Path], None]:
    """Flip every bit of `length` bytes from `start(size)`: the size stays the same."""

    def damage(path: Path) -> None:
        data = bytearray(path.read_bytes())
        at = max(0, start(len(data)))
        for i in range(at, min(at + length, len(data))):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))

    return damage


def _one_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))


SAME_SIZE = {
    "first-64-bytes": _xor(lambda n: 0, 64),
    "middle-4k": _xor(lambda n: n // 2 - 2048, 4096),
    "last-200-bytes": _xor(lambda n: n - 200, 200),
    "one-bit": _one_bit,
}


@pytest.mark.parametrize("damage", SAME_SIZE.values(), ids=SAME_SIZE.keys())
@pytest.mark.parametrize("victim", ["data", ".metadata"])
def test_a_file_damaged_in_place_is_refused_naming_it(
    tmp_path: Path, damage: Callable[[Path], None], victim: str
) -> None:
    store = write_checkpoint(tmp_path)
    path = data_file(store) if victim == "data" else step_dir(store) / ".metadata"
    size = path.stat().st_size
    damage(path)
    assert path.stat().st_size == size
    with pytest.raises(InputError) as exc:
        check_resumable(store, spec())
    line = one_line(exc)
    assert line.startswith(f"checkpoint {path}: corrupt (CRC-32 "), line
    assert "recorded in cpn.json" in line


def test_the_damage_checksums_catch_would_otherwise_load_silently(tmp_path: Path) -> None:
    """Why the checksums: a same-size change in the middle of a data file loads without
    any error from torch, into wrong weights."""
    from torch.distributed.checkpoint.state_dict_loader import load  # noqa: PLC0415

    store = write_checkpoint(tmp_path)
    want = {f"model/w{i}": torch.zeros(128, 128) for i in range(3)}
    load(want, storage_reader=store.reader(STEP))
    SAME_SIZE["middle-4k"](data_file(store))
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    load(got, storage_reader=store.reader(STEP))  # no error
    assert any(not torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(InputError, match="corrupt"):
        check_resumable(store, spec())


def _shorten(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _lengthen(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (_shorten, "truncated"),
        (_lengthen, "longer than written"),
        (Path.unlink, "missing"),
    ],
    ids=["shorter", "longer", "lost"],
)
def test_a_file_of_another_size_is_refused_without_reading_it(
    tmp_path: Path, damage: Callable[[Path], None], problem: str
) -> None:
    store = write_checkpoint(tmp_path)
    path = data_file(store)
    damage(path)
    with pytest.raises(InputError) as exc:
        check_resumable(store, spec())
    assert one_line(exc).startswith(f"checkpoint {path}: {problem}")


def test_cpn_json_records_every_file_of_the_step(tmp_path: Path) -> None:
    store = write_checkpoint(tmp_path)
    files = store.info(STEP).files
    assert files is not None
    on_disk = {p.name: p.read_bytes() for p in step_dir(store).iterdir()}
    assert set(files) == set(on_disk) - {"cpn.json", "COMPLETE"}
    for name, check in files.items():
        assert (check.size, check.crc32) == (len(on_disk[name]), zlib.crc32(on_disk[name]))


def test_an_older_checkpoint_without_checksums_is_checked_for_size_only(tmp_path: Path) -> None:
    """Checkpoints written before cpn recorded checksums still resume (documented):
    a short file is refused, a same-size change cannot be seen."""
    store = write_checkpoint(tmp_path)
    edit_info(store, _drop("files"))
    assert store.info(STEP).files is None
    SAME_SIZE["middle-4k"](data_file(store))
    assert check_resumable(store, spec()) == STEP
    _shorten(data_file(store))
    with pytest.raises(InputError, match="truncated"):
        check_resumable(store, spec())
