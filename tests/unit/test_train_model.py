"""The runtime's model matches the cost model's description of it, shard by shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cpn.comm import Member, Traffic
from cpn.contracts import ParallelSpec, Plan
from cpn.contracts.job import CompressionSpec
from cpn.contracts.plan import Binding
from cpn.errors import InputError
from cpn.gpt_shapes import stage_parameters
from cpn.scheduler import SolverSettings, plan_job
from cpn.train.data import BatchSource, corpus
from cpn.train.model import GPTConfig, GPTStage
from cpn.train.parallelize import TensorParallel, parallelize, shard_layouts
from cpn.train.trainer import TrainOptions, check_launch, learning_rate
from tests.factories import job, site, topology

CFG = GPTConfig(layers=4, hidden=64, heads=4, seq_len=16, vocab=101)


def shard(stage: int, pp: int, tp: int, rank: int) -> GPTStage:
    module = GPTStage(CFG, stage, pp, seed=3)
    group = Member(None, tuple(range(tp)), rank)  # construction needs no communication
    return parallelize(module, TensorParallel(group, Traffic(), torch.float32))


@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (2, 1), (2, 2), (4, 4), (1, 2)])
def test_parameters_match_the_cost_models_shapes(pp: int, tp: int) -> None:
    spec = job(layers=4, hidden=64, heads=4, seq_len=16, vocab=101).model
    for stage in range(pp):
        for rank in range(tp):
            got = [(n, tuple(p.shape)) for n, p in shard(stage, pp, tp, rank).named_parameters()]
            want = [(p.name, p.shape) for p in stage_parameters(spec, pp, tp, stage)]
            assert got == want


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_layouts_put_every_piece_where_checkpoints_expect_it(tp: int) -> None:
    # Checkpoints store whole logical tensors, split by torch.chunk along `dim` (what a
    # DTensor Shard(dim) means): the pieces must reassemble the single-process weights.
    whole = dict(GPTStage(CFG, 0, 1, seed=3).named_parameters())
    pieces: dict[str, list[torch.Tensor]] = {}
    layouts = {}
    for rank in range(tp):
        module = shard(0, 1, tp, rank)
        layouts = shard_layouts(module, tp, rank)
        for name, p in module.named_parameters():
            pieces.setdefault(name, []).append(layouts[name].local_view(p.detach()))
    for name, parts in pieces.items():
        layout = layouts[name]
        logical = whole[name].detach().reshape(layout.shape)
        if layout.dim is None:
            assert all(torch.equal(part, logical) for part in parts), name
            continue
        chunks = logical.chunk(tp, dim=layout.dim)
        for rank, part in enumerate(parts):
            want = chunks[rank] if rank < len(chunks) else logical.narrow(layout.dim, 0, 0)
            assert torch.equal(part, want), (name, rank)


def test_shards_are_slices_of_the_single_process_weights() -> None:
    whole = dict(GPTStage(CFG, 0, 1, seed=3).named_parameters())
    parts = [dict(shard(0, 1, 2, r).named_parameters()) for r in range(2)]
    h = CFG.hidden
    # qkv: each worker holds its half of the heads of q, of k and of v.
    for i, name in enumerate("qkv"):
        rows = whole["blocks.0.attn.qkv.weight"][i * h : (i + 1) * h]
        got = torch.cat(
            [p["blocks.0.attn.qkv.weight"][i * h // 2 : (i + 1) * h // 2] for p in parts]
        )
        assert torch.equal(got, rows), name
    assert torch.equal(
        torch.cat([p["blocks.0.mlp.proj.weight"] for p in parts], dim=1),
        whole["blocks.0.mlp.proj.weight"],
    )
    # vocabulary 101 padded to 102; the padding row is zero
    table = torch.cat([p["wte.weight"] for p in parts])
    assert table.shape[0] == 102
    assert torch.equal(table[:101], whole["wte.weight"]) and not table[101].any()
    assert torch.equal(parts[0]["blocks.0.ln_1.weight"], parts[1]["blocks.0.ln_1.weight"])


def test_initialisation_depends_only_on_seed_and_name() -> None:
    full = dict(GPTStage(CFG, 0, 1, seed=5).named_parameters())
    second = dict(GPTStage(CFG, 1, 2, seed=5).named_parameters())
    for name, p in second.items():
        assert torch.equal(p, full[name])
    other = dict(GPTStage(CFG, 1, 2, seed=6).named_parameters())
    assert not torch.equal(other["blocks.3.mlp.fc.weight"], full["blocks.3.mlp.fc.weight"])


def test_corpus_and_batches_are_deterministic_and_partition_the_global_batch() -> None:
    assert corpus(0)[:1000].tobytes() == corpus(0)[:1000].tobytes()
    text = corpus(0)[:2000].tobytes().decode()
    assert text.count(" ") > 200 and any(p in text for p in ".!?")
    one = BatchSource(16, 256, global_batch=8, micro_batch=2, dp=1)
    two = BatchSource(16, 256, global_batch=8, micro_batch=2, dp=2)
    whole = torch.cat([x for x, _ in one.for_replica(3, 0)])
    split = torch.cat([x for r in range(2) for x, _ in two.for_replica(3, r)])
    assert torch.equal(whole, split)
    x, y = one.for_replica(3, 0)[0]
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(BatchSource(16, 100, 8, 2, 1).windows(0).max()) < 100


def test_learning_rate_warms_up_then_decays() -> None:
    lrs = [learning_rate(1e-3, s, 100) for s in range(100)]
    assert lrs[0] < lrs[4] == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4, rel=0.05) and lrs[50] < lrs[10]


def tiny_plan(dp: int, tp: int, pp: int):
    topo = topology([site("a", nodes=2, gpus=4)], [])
    spec = job(dp, tp, pp, layers=4, hidden=64, heads=4, seq_len=16, vocab=256)
    return plan_job(topo, spec, settings=SolverSettings(time_limit=2)), spec


def test_bad_launches_fail_before_any_process_group(tmp_path: Path) -> None:
    plan, spec = tiny_plan(2, 1, 2)
    opts = TrainOptions()
    with pytest.raises(InputError, match="WORLD_SIZE: 3, but the plan has dp×tp×pp = 4"):
        check_launch(plan, spec, 3, 0, opts)
    with pytest.raises(InputError, match=r"--rank: 4 is not in 0..3"):
        check_launch(plan, spec, 4, 4, opts)
    # A plan for another version of the job: what it predicts no longer applies.
    topk = spec.model_copy(update={"compression": CompressionSpec(wan="topk", density=0.01)})
    bigger = spec.model_copy(update={"model": spec.model.model_copy(update={"hidden": 128})})
    for other in (topk, bigger):
        with pytest.raises(InputError, match=r"binding\.job_digest: the plan was made for another"):
            check_launch(plan, other, 4, 0, opts)
    # ... but steps, learning rate and seed are not what a plan depends on.
    longer = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": 99})})
    check_launch(plan, longer, 4, 0, opts)
    with pytest.raises(InputError, match="binding: missing"):
        check_launch(plan.model_copy(update={"binding": None}), spec, 4, 0, opts)
    auto = spec.model_copy(update={"parallel": "auto", "gpus": 3})
    bad = plan.model_copy(
        update={
            "parallel": ParallelSpec(dp=1, tp=3, pp=1),
            "binding": Binding.of(auto, topology([site("a", nodes=2, gpus=4)], [])),
        }
    )
    with pytest.raises(InputError, match=r"parallel.tp: 3 does not divide model.heads \(4\)"):
        check_launch(bad, auto, 3, 0, opts)
    with pytest.raises(InputError, match="no complete checkpoint"):
        check_launch(plan, spec, 4, 0, TrainOptions(resume=True, checkpoint_store=str(tmp_path)))
    renamed = plan.model_copy(update={"job": "other"})
    with pytest.raises(InputError, match="the plan is for job 'other'"):
        check_launch(renamed, spec, 4, 0, opts)
    with pytest.raises(InputError, match="--device: 'tpu'"):
        check_launch(plan, spec, 4, 0, TrainOptions(device="tpu"))
    json.loads(plan.model_dump_json())  # the plan a launcher writes is plain JSON


@pytest.mark.parametrize(
    ("update", "message"),
    [
        (
            {"micro_batches": 1_000_000_000},
            r"plan: micro_batches: 1000000000, but the job's batch gives global_batch / "
            r"\(dp × micro_batch\) = 4 / \(2 × 1\) = 2",
        ),
        ({"micro_batches": 1}, r"plan: micro_batches: 1, but .* = 2$"),
        (
            {"compression": CompressionSpec(wan="topk", density=0.01)},
            r"plan: compression: \{'wan': 'topk', 'density': 0.01\}, but the job says "
            r"\{'wan': 'none'\}",
        ),
    ],
    ids=["huge-micro-batches", "fewer-micro-batches", "compression"],
)
def test_a_plan_whose_derived_fields_disagree_with_its_job_is_refused(
    update: dict[str, object], message: str
) -> None:
    """The binding digest covers the job, not what the plan derived from it."""
    plan, spec = tiny_plan(2, 1, 2)
    assert plan.micro_batches == spec.train.global_batch // (2 * spec.train.micro_batch) == 2
    check_launch(plan, spec, 4, 0, TrainOptions())
    with pytest.raises(InputError, match=message):
        check_launch(plan.model_copy(update=update), spec, 4, 0, TrainOptions())


def test_plans_with_shared_gpus_or_unknown_sites_do_not_validate() -> None:
    plan, _ = tiny_plan(2, 1, 2)
    doc = json.loads(plan.model_dump_json())
    shared = json.loads(json.dumps(doc))
    first, second = shared["shards"][0], shared["shards"][1]
    second.update(site=first["site"], node=first["node"], gpus=first["gpus"])
    with pytest.raises(ValueError, match="both use GPU"):
        Plan.model_validate(shared)
    elsewhere = json.loads(json.dumps(doc))
    elsewhere["shards"][0]["site"] = "nowhere"
    with pytest.raises(ValueError, match="site 'nowhere', which is not in the topology"):
        Plan.model_validate(elsewhere)
    missing = json.loads(json.dumps(doc))
    missing["shards"].pop()
    with pytest.raises(ValueError, match="need exactly one entry per"):
        Plan.model_validate(missing)
