"""Contract files: the examples load, and every kind of mistake gets one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cpn.contracts import Plan, load_job, load_reservations, load_topology
from cpn.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def write(tmp_path: Path, name: str, doc: object) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc) if not isinstance(doc, str) else doc)
    return path


@pytest.fixture
def topo_doc() -> dict:
    return yaml.safe_load((EXAMPLES / "topologies" / "three-sites.yaml").read_text())


@pytest.fixture
def job_doc() -> dict:
    return yaml.safe_load((EXAMPLES / "jobs" / "gpt-13b.yaml").read_text())


@pytest.mark.parametrize("path", sorted((EXAMPLES / "topologies").glob("*.yaml")))
def test_example_topologies_load(path: Path) -> None:
    topo = load_topology(path)
    assert topo.sites


@pytest.mark.parametrize("path", sorted((EXAMPLES / "jobs").glob("*.yaml")))
def test_example_jobs_load(path: Path) -> None:
    assert load_job(path).name


def test_node_count_expands_to_named_instances(topo_doc: dict, tmp_path: Path) -> None:
    topo = load_topology(write(tmp_path, "t.yaml", topo_doc))
    names = [name for name, _ in topo.site("beijing").node_instances()]
    assert names[:2] == ["bj-a100-0", "bj-a100-1"] and len(names) == 16
    assert topo.site("beijing").gpu_count == 128
    assert topo.gpu_count == 128 + 64 + 192


def error_of(loader, path: Path) -> str:
    with pytest.raises(InputError) as info:
        loader(path)
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    return message


def test_missing_field_is_named(topo_doc: dict, tmp_path: Path) -> None:
    del topo_doc["sites"][1]["nodes"][0]["gpu"]["memory_gb"]
    msg = error_of(load_topology, write(tmp_path, "t.yaml", topo_doc))
    assert "sites[1].nodes[0].gpu.memory_gb" in msg and "required" in msg


def test_negative_bandwidth_is_named(topo_doc: dict, tmp_path: Path) -> None:
    topo_doc["links"][0]["bandwidth_gbps"] = -5
    msg = error_of(load_topology, write(tmp_path, "t.yaml", topo_doc))
    assert "links[0].bandwidth_gbps" in msg and "greater than or equal to 0.001" in msg
    assert "-5" in msg


def test_link_to_unknown_site_is_named(topo_doc: dict, tmp_path: Path) -> None:
    topo_doc["links"][1]["b"] = "chengdu"
    msg = error_of(load_topology, write(tmp_path, "t.yaml", topo_doc))
    assert "links[1].b" in msg and "chengdu" in msg


def test_unknown_key_is_an_error(topo_doc: dict, tmp_path: Path) -> None:
    topo_doc["links"][0]["bandwith_gbps"] = topo_doc["links"][0].pop("bandwidth_gbps")
    msg = error_of(load_topology, write(tmp_path, "t.yaml", topo_doc))
    assert "links[0]" in msg


def test_duplicate_node_and_site_names(topo_doc: dict, tmp_path: Path) -> None:
    doc = yaml.safe_load(yaml.safe_dump(topo_doc))
    doc["sites"][0]["nodes"].append(dict(doc["sites"][0]["nodes"][0]))
    assert "duplicate node name" in error_of(load_topology, write(tmp_path, "a.yaml", doc))
    doc = yaml.safe_load(yaml.safe_dump(topo_doc))
    doc["sites"][2]["name"] = "beijing"
    assert "duplicate site name 'beijing'" in error_of(
        load_topology, write(tmp_path, "b.yaml", doc)
    )


def test_link_between_a_site_and_itself(topo_doc: dict, tmp_path: Path) -> None:
    topo_doc["links"][0]["b"] = topo_doc["links"][0]["a"]
    assert "two different sites" in error_of(load_topology, write(tmp_path, "t.yaml", topo_doc))


def test_pp_not_dividing_layers(job_doc: dict, tmp_path: Path) -> None:
    job_doc["parallel"]["pp"] = 3
    msg = error_of(load_job, write(tmp_path, "j.yaml", job_doc))
    assert msg.endswith("parallel.pp: 3 does not divide model.layers (40)")


def test_tp_not_dividing_heads_and_batch_not_divisible(job_doc: dict, tmp_path: Path) -> None:
    doc = dict(job_doc, parallel={"dp": 8, "tp": 3, "pp": 4})
    assert "parallel.tp: 3 does not divide model.heads (40)" in error_of(
        load_job, write(tmp_path, "a.yaml", doc)
    )
    doc = dict(job_doc, parallel={"dp": 6, "tp": 8, "pp": 4})
    assert "train.global_batch" in error_of(load_job, write(tmp_path, "b.yaml", doc))


def test_auto_needs_a_gpu_budget(job_doc: dict, tmp_path: Path) -> None:
    job_doc["parallel"] = "auto"
    assert "gpus: required with parallel: auto" in error_of(
        load_job, write(tmp_path, "j.yaml", job_doc)
    )


def test_bad_enum_and_density(job_doc: dict, tmp_path: Path) -> None:
    doc = dict(job_doc, compression={"wan": "zstd"})
    assert "compression.wan" in error_of(load_job, write(tmp_path, "a.yaml", doc))
    doc = dict(job_doc, compression={"wan": "topk", "density": 1.5})
    assert "compression.density" in error_of(load_job, write(tmp_path, "b.yaml", doc))
    doc = dict(job_doc, compression={"wan": "none", "density": 0.01})
    assert "only meaningful with wan: topk" in error_of(load_job, write(tmp_path, "c.yaml", doc))


def test_malformed_files(tmp_path: Path) -> None:
    assert "no such file" in error_of(load_topology, tmp_path / "missing.yaml")
    assert "not valid YAML at line 2" in error_of(
        load_topology, write(tmp_path, "bad.yaml", "sites:\n  - name: a: b\n")
    )
    assert "empty document" in error_of(load_job, write(tmp_path, "empty.yaml", ""))
    assert "input should be a valid dictionary" in error_of(
        load_job, write(tmp_path, "list.yaml", "- 1\n- 2\n")
    )


def test_reservations_are_checked_against_the_topology(tmp_path: Path) -> None:
    topo = load_topology(EXAMPLES / "topologies" / "three-sites.yaml")
    ok = write(
        tmp_path,
        "ok.yaml",
        {"gpus": {"beijing": {"bj-a100-3": [0, 1]}}, "wan_gbps": {"shanghai|beijing": 20}},
    )
    res = load_reservations(ok, topo)
    assert res.held("beijing", "bj-a100-3") == {0, 1}
    bad = write(tmp_path, "bad.yaml", {"gpus": {"beijing": {"bj-a100-3": [8]}}})
    with pytest.raises(InputError, match=r"GPU index 8 out of range 0\.\.7"):
        load_reservations(bad, topo)
    bad = write(tmp_path, "bad2.yaml", {"wan_gbps": {"beijing|guiyang": 1}})
    with pytest.raises(InputError, match="no such link"):
        load_reservations(bad, topo)


def test_plan_rejects_missing_or_duplicate_shards() -> None:
    base = {
        "job": "j",
        "parallel": {"dp": 2, "tp": 1, "pp": 1},
        "micro_batches": 1,
        "bytes_per_iteration": {"intra_node": 0, "intra_site": 0, "wan": 0},
        "predicted_iteration_seconds": 1.0,
        "breakdown": {"compute": 1, "pipeline": 0, "dp_sync": 0, "bubble": 0},
        "price_per_hour": 0,
        "solver": {"status": "OPTIMAL", "seconds": 0, "objective": 0, "bound": 0, "gap": 0},
    }
    shard = {"replica": 0, "stage": 0, "site": "a", "node": "n", "gpus": [0]}
    with pytest.raises(ValueError, match="exactly one entry per"):
        Plan.model_validate({**base, "shards": [shard, shard]})
    plan = Plan.model_validate({**base, "shards": [shard, {**shard, "replica": 1, "gpus": [1]}]})
    assert [r.rank for r in plan.ranks()] == [0, 1]


def _set(doc: dict, path: str, value: object) -> dict:
    """A deep copy of `doc` with the dotted `path` (list indices as numbers) set."""
    out = yaml.safe_load(yaml.safe_dump(doc))
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    target = out
    for part in parents:
        target = target[part]
    target[last] = value
    return out


HOSTILE_TOPOLOGIES = [
    ("links.0.bandwidth_gbps", float("inf"), "links[0].bandwidth_gbps"),
    ("links.0.latency_ms", float("nan"), "links[0].latency_ms"),
    ("links.0.latency_ms", 1e300, "links[0].latency_ms"),
    ("sites.0.gpu_price_per_hour", float("inf"), "sites[0].gpu_price_per_hour"),
    ("sites.0.nodes.0.gpu.model", "A100\x00", "sites[0].nodes[0].gpu.model"),
    ("sites.0.nodes.0.gpu.model", "A100\u202e", "sites[0].nodes[0].gpu.model"),
    ("sites.0.nodes.0.gpu.memory_gb", 1e9, "sites[0].nodes[0].gpu.memory_gb"),
    ("sites.0.nodes.0.gpu.count", 2**40, "sites[0].nodes[0].gpu.count"),
    ("sites.0.nodes.0.name", "n0\n", "sites[0].nodes[0].name"),
    ("sites.0.name", "x" * 65, "sites[0].name"),
    # Tiny positive values: no scheduler can represent the times they make.
    ("links.0.bandwidth_gbps", 1e-12, "links[0].bandwidth_gbps"),
    ("sites.0.intra_site_gbps", 5e-324, "sites[0].intra_site_gbps"),
    ("sites.0.nodes.0.intra_node_gbps", 1e-300, "sites[0].nodes[0].intra_node_gbps"),
    ("sites.0.nodes.0.gpu.tflops", 1e-300, "sites[0].nodes[0].gpu.tflops"),
    ("sites.0.nodes.0.gpu.memory_gb", 5e-324, "sites[0].nodes[0].gpu.memory_gb"),
]


@pytest.mark.parametrize(("path", "value", "field"), HOSTILE_TOPOLOGIES)
def test_topology_values_beyond_the_bounds_are_named(
    topo_doc: dict, tmp_path: Path, path: str, value: object, field: str
) -> None:
    message = error_of(load_topology, write(tmp_path, "t.yaml", _set(topo_doc, path, value)))
    assert f": {field}:" in message
    assert len(message) < 300  # a huge value is not echoed whole


HOSTILE_JOBS = [
    ("train.seed", 2**64, "train.seed"),
    ("train.steps", 2**40, "train.steps"),
    ("train.lr", float("nan"), "train.lr"),
    ("train.global_batch", -1, "train.global_batch"),
    ("compression", {"wan": "topk", "density": float("nan")}, "compression.density"),
    ("constraints", {"gpu_model": "A100\x1b[31m"}, "constraints.gpu_model"),
    ("constraints", {"min_gpu_memory_gb": float("inf")}, "constraints.min_gpu_memory_gb"),
    ("parallel", {"dp": 1_000_000, "tp": 1024, "pp": 100}, "parallel: dp×tp×pp"),
]


@pytest.mark.parametrize(("path", "value", "field"), HOSTILE_JOBS)
def test_job_values_beyond_the_bounds_are_named(
    job_doc: dict, tmp_path: Path, path: str, value: object, field: str
) -> None:
    message = error_of(load_job, write(tmp_path, "j.yaml", _set(job_doc, path, value)))
    assert f": {field}" in message


def test_reservations_and_plans_refuse_values_nothing_can_hold(tmp_path: Path) -> None:
    bad = write(tmp_path, "r.yaml", {"wan_gbps": {"a|b": float("inf")}})
    assert "wan_gbps.a|b" in error_of(load_reservations, bad)
    bad = write(tmp_path, "r2.yaml", {"gpus": {"a": {"n\x00": [0]}}})
    assert "gpus.a" in error_of(load_reservations, bad)
    shard = {"replica": 0, "stage": 0, "site": "a", "node": "n", "gpus": [0]}
    plan = {
        "job": "j",
        "parallel": {"dp": 1, "tp": 1, "pp": 1},
        "micro_batches": 1,
        "shards": [shard],
        "bytes_per_iteration": {"intra_node": 0, "intra_site": 0, "wan": 2**64},
        "predicted_iteration_seconds": 1.0,
        "breakdown": {"compute": 1, "pipeline": 0, "dp_sync": 0, "bubble": 0},
        "price_per_hour": 0,
        "solver": {"status": "OPTIMAL", "seconds": 0, "objective": 0, "bound": 0, "gap": 0},
    }
    with pytest.raises(ValueError, match=r"bytes_per_iteration\.wan"):
        Plan.model_validate(plan)
    plan["bytes_per_iteration"]["wan"] = 0  # type: ignore[index]
    plan["shards"] = [{**shard, "site": "a\x00"}]
    with pytest.raises(ValueError, match=r"shards\.0\.site"):
        Plan.model_validate(plan)
