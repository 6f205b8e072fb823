"""Cost model against hand-computed cases (DESIGN.md §3).

Model for the hand cases: 2 layers, hidden 64, 4 heads, seq 32, vocab 100, fp32.
Per block: 12·64² + 13·64 = 49 984 parameters. Whole model (untied head):
wte 6 400 + wpe 2 048 + 2 × 49 984 + ln_f 128 + head 6 400 = 114 944.
"""

from __future__ import annotations

import pytest

from cpn import wire
from cpn.contracts import ParallelSpec
from cpn.costmodel import EFFICIENCY, Placement, Workload, evaluate
from cpn.gpt_shapes import padded_vocab, parameter_count, stage_numel, stage_parameters
from cpn.network import SiteGraph
from tests.factories import job, link, site, topology


def small_job(dp: int = 2, tp: int = 2, pp: int = 2, micro_batches: int = 3, **kw):
    return job(
        dp,
        tp,
        pp,
        layers=2,
        hidden=64,
        heads=4,
        seq_len=32,
        vocab=100,
        micro_batch=2,
        micro_batches=micro_batches,
        **kw,
    )


def test_parameter_counts() -> None:
    model = small_job().model
    assert parameter_count(model) == 114_944
    # GPT-2 small (124 M with a tied head) has 124 439 808 + a separate 768 × 50 257 head.
    gpt2 = job(layers=12, hidden=768, heads=12, seq_len=1024, vocab=50257).model
    assert parameter_count(gpt2) == 124_439_808 + 768 * 50257


def test_stage_shards_with_tensor_parallelism() -> None:
    model = small_job().model
    # Block per tp rank (tp=2): sharded (12·64² + 7·64)/2 = 24 800, replicated LayerNorms
    # and row-parallel biases 6·64 = 384.
    assert stage_numel(model, 2, 2, 0) == 3_200 + 2_048 + 25_184  # wte/2 + wpe + block
    assert stage_numel(model, 2, 2, 1) == 25_184 + 128 + 3_200  # block + ln_f + head/2
    names = [p.name for p in stage_parameters(model, 2, 2, 1)]
    assert names[0] == "blocks.1.ln_1.weight" and names[-1] == "lm_head.weight"
    assert padded_vocab(101, 2) == 102 and padded_vocab(100, 3) == 102


def test_pipeline_and_tensor_parallel_bytes() -> None:
    w = Workload.of(small_job())
    assert w.micro_batches == 3
    assert w.activation_bytes == 2 * 32 * 64 * 4 == 16_384
    assert w.boundary_bytes == 2 * 3 * 16_384
    # stage 0: 4 all-reduces per layer + embedding all-reduce, each 2·(tp−1)·16 384,
    # plus the all-gather of the gradient arriving from stage 1; × 3 micro-batches.
    assert w.tp_bytes(0) == 3 * (4 * 32_768 + 32_768 + 16_384) == 540_672
    # last stage: head input gradient + 3 fp32 cross-entropy all-reduces of b·s = 64 values
    # + all-gather of the activation arriving from stage 0.
    assert w.tp_bytes(1) == 3 * (4 * 32_768 + 32_768 + 3 * 2 * 64 * 4 + 16_384) == 545_280
    assert Workload.of(small_job(tp=1)).tp_bytes(0) == 0


def test_data_parallel_bytes_dense_fp16_and_sparse() -> None:
    e0 = 30_432
    dense = Workload.of(small_job())
    assert dense.dp_wan_bytes(0, 1) == 0
    assert dense.dp_wan_bytes(0, 2) == 2 * 1 * e0 * 4 * 2  # 2(k−1)·E·g·tp
    assert dense.dp_wan_bytes(0, 3) == 2 * 2 * e0 * 4 * 2
    assert dense.dp_intra_bytes(0, 3) == 2 * 2 * e0 * 4 * 2  # reduce + broadcast
    assert Workload.of(small_job(wan="fp16")).dp_wan_bytes(0, 2) == 2 * e0 * 2 * 2
    sparse = Workload.of(small_job(wan="topk", density=0.01))
    # tp = 2: top-k compresses the 28 000 sharded elements (wte/2 + the block's shards);
    # the 2 432 held whole (wpe + LayerNorms + row biases) go dense, or the tp copies of
    # them would drift apart. One bucket: k = 280, packed 2-byte indices, fp16 values.
    assert sparse.dense_numel(0) == 2_048 + 384
    assert sparse.sparse_payload(0) == 280 * 2 + 280 * 2 == 1_120
    # k(k−1)·payload + 2(k−1)·dense·g, per tp rank, × tp
    assert sparse.dp_wan_bytes(0, 3) == (3 * 2 * 1_120 + 2 * 2 * 2_432 * 4) * 2
    assert sparse.dp_wan_per_leader(0, 3) == pytest.approx((2 * 1_120 + 4 / 3 * 2_432 * 4) * 2)
    # tp = 1: everything is compressed: 58 432 elements, k = 585, 2-byte indices.
    flat = Workload.of(small_job(tp=1, wan="topk", density=0.01))
    assert flat.dense_numel(0) == 0
    assert flat.sparse_payload(0) == 585 * 2 + 585 * 2
    assert flat.dp_wan_bytes(0, 2) == 2 * 1 * 2_340


def test_low_bit_and_outer_step_bytes() -> None:
    e0 = 30_432
    # int8 per step, tp = 2: the 28 000 sharded elements as one bucket, 219 blocks of 128
    # with an fp32 scale each, one byte per value; the 2 432 held whole go dense.
    int8 = Workload.of(small_job(wan="int8"))
    payload8 = 219 * 4 + 28_000
    assert int8.sparse_payload(0) == payload8 == wire.quantized_bytes(28_000, 8)
    assert int8.dp_wan_bytes(0, 3) == (3 * 2 * payload8 + 2 * 2 * 2_432 * 4) * 2
    int4 = Workload.of(small_job(tp=1, wan="int4"))
    assert int4.sparse_payload(0) == 457 * 4 + 58_432 // 2  # 58 432 values, 457 blocks
    # Outer steps: one exchange every H iterations; per iteration ÷ H, rounded up.
    outer = Workload.of(small_job(wan="outer", every=32, values="fp16"))
    assert outer.dp_wan_bytes_per_sync(0, 2) == 2 * e0 * 2 * 2  # fp16 ring, × tp
    assert outer.dp_wan_bytes(0, 2) == -(-(2 * e0 * 2 * 2) // 32)
    assert outer.dp_wan_per_leader(0, 2) == pytest.approx(e0 * 2 * 2 / 32)
    # In the site: reduce + broadcast every step, plus the mean's broadcast every H steps.
    assert outer.dp_intra_bytes_per_sync(0, 3) == 2 * e0 * 4 * 2
    assert outer.dp_intra_bytes(0, 3) == 2 * 2 * e0 * 4 * 2 + -(-(2 * e0 * 4 * 2) // 32)
    dense_h1 = Workload.of(small_job(wan="outer", every=1, values="dense"))
    assert dense_h1.dp_wan_bytes(0, 3) == Workload.of(small_job()).dp_wan_bytes(0, 3)
    topk = Workload.of(small_job(tp=1, wan="outer", every=8, values="topk", density=0.01))
    assert topk.dp_wan_bytes_per_sync(0, 2) == 2 * 1 * 2_340  # as per-step top-k at 1 %
    # Per iteration: k(k − 1)·⌈payload / H⌉, convex in k for the scheduler.
    assert topk.dp_wan_bytes(0, 2) == 2 * 293 and topk.dp_wan_bytes(0, 3) == 6 * 293


def test_wire_sizes() -> None:
    assert wire.topk_count(1000, 0.001) == 1 and wire.topk_count(0, 0.5) == 0
    assert wire.topk_count(10, 1.0) == 10
    assert wire.index_width(256) == 1 and wire.index_width(257) == 2
    assert wire.index_width(1 << 22) == 3 and wire.index_width(1 << 24) == 3
    assert wire.index_encoding(1 << 22, 100) == wire.IndexEncoding.PACKED
    assert wire.index_encoding(1 << 30, 100) == wire.IndexEncoding.INT32
    assert wire.index_encoding(1000, 500) == wire.IndexEncoding.BITMAP
    assert wire.sparse_payload_bytes(1000, 0.5) == 500 * 2 + 125
    assert wire.fuse([5, 5, 5], cap=10) == [[2, 1], [0]]
    assert wire.fuse([30, 1, 1], cap=10) == [[2, 1], [0]]
    assert wire.bucket_numels([30, 1, 1], cap=10) == [2, 30]
    assert wire.ring_chunks(10, 3) == [4, 3, 3]
    per_rank = [wire.ring_allreduce_bytes(10, 4, 3, i) for i in range(3)]
    assert sum(per_rank) == 2 * (3 - 1) * 10 * 4


def test_memory_model() -> None:
    big = job(
        8,
        8,
        4,
        layers=40,
        hidden=5120,
        heads=40,
        seq_len=2048,
        vocab=50257,
        dtype="bf16",
        micro_batches=128,
    )
    w = Workload.of(big)
    gib = [w.memory_bytes(p) / 2**30 for p in range(4)]
    # 13B over 32 GPUs: ~0.4 B parameters each → ~6 GiB of state; activations of up to
    # pp − stage micro-batches in flight dominate the first stage.
    assert 10 < gib[0] < 40
    assert gib[0] > gib[1] > gib[2]  # fewer micro-batches in flight down the pipeline
    assert w.fits(0, 80) and not w.fits(0, 8)


def test_evaluate_stage_major_plan_by_hand() -> None:
    topo = topology([site("a", gpus=4), site("b", gpus=4)], [link("a", "b", 10, 20, price=0.5)])
    w = Workload(small_job(), ParallelSpec(dp=2, tp=2, pp=2))
    shards = [
        Placement(r, p, "a" if p == 0 else "b", "a-n" if p == 0 else "b-n")
        for r in range(2)
        for p in range(2)
    ]
    ev = evaluate(w, topo, SiteGraph(topo), shards)
    # Both replicas cross a→b between stage 0 and 1; each stage's gradients stay in a site.
    assert ev.wan == 2 * 98_304
    assert ev.wan_links == {"a|b": 2 * 98_304}
    e0, e1 = 30_432, 28_512
    assert ev.intra_site == 2 * e0 * 4 * 2 + 2 * e1 * 4 * 2
    assert ev.intra_node == 2 * 540_672 + 2 * 545_280
    # Time: hop = 2·(20 ms + 2 replicas × 16 384 B × 8 / 10 Gb/s); compute per micro-batch
    # = 3 × forward FLOPs / tp / (312 TFLOP/s × efficiency) + the tp all-reduces over NVLink.
    hop = 2 * (0.020 + 2 * 16_384 * 8 / 10e9)
    fwd0 = 24 * 2 * 32 * 64**2 + 4 * 2 * 32**2 * 64
    fwd1 = fwd0 + 2 * 2 * 32 * 64 * 100
    c0 = 3 * fwd0 / 2 / (312e12 * EFFICIENCY) + 540_672 / 3 / 2 * 8 / 4800e9
    c1 = 3 * fwd1 / 2 / (312e12 * EFFICIENCY) + 545_280 / 3 / 2 * 8 / 4800e9
    slot = max(c0 + hop, c1)
    sync = max(2 * e0 * 4 * 2 * 8 / 800e9, 2 * e1 * 4 * 2 * 8 / 800e9)
    assert ev.iteration_seconds == pytest.approx((3 + 2 - 1) * slot + sync, rel=1e-12)
    assert ev.pipeline == pytest.approx(3 * hop) and ev.bubble == pytest.approx(slot)
    assert ev.compute + ev.pipeline + ev.bubble + ev.dp_sync == pytest.approx(ev.iteration_seconds)
    # Price: 8 GPUs at 2.0/h, plus WAN egress at 0.5 per GB, iterations per hour.
    egress = 0.5 * 2 * 98_304 / 1e9 * 3600 / ev.iteration_seconds
    assert ev.price_per_hour == pytest.approx(8 * 2.0 + egress)


def test_evaluate_replicas_per_site_dense_ring() -> None:
    # Whole replicas in three sites: no pipeline WAN traffic; each stage syncs over a ring
    # of 3 leaders; a–c has no link and is relayed through b.
    topo = topology(
        [site(n, gpus=4) for n in "abc"], [link("a", "b", 10, 10), link("b", "c", 5, 30)]
    )
    w = Workload(small_job(dp=3, micro_batches=2), ParallelSpec(dp=3, tp=2, pp=2))
    shards = [Placement(r, p, "abc"[r], f"{'abc'[r]}-n") for r in range(3) for p in range(2)]
    ev = evaluate(w, topo, SiteGraph(topo), shards)
    e0, e1 = 30_432, 28_512
    assert ev.wan == sum(2 * 2 * e * 4 * 2 for e in (e0, e1))
    assert ev.intra_site == 3 * w.boundary_bytes  # one stage-0→1 hop per replica, in-site

    # ring a→b→c→a: leader i sends 2·(E − chunk_i)·4 B per tp rank; c→a goes via b.
    def sent(e: int, i: int) -> int:
        return wire.ring_allreduce_bytes(e, 4, 3, i) * 2

    ab = sum(sent(e, 0) + sent(e, 2) for e in (e0, e1))  # a→b, and c→a relayed over b–a
    bc = sum(sent(e, 1) + sent(e, 2) for e in (e0, e1))  # b→c, and c→a over c–b
    assert ev.wan_links == {"a|b": ab, "b|c": bc}
    # WAN sync time: worst pair is a–c (5 Gb/s, 40 ms): 4 steps × 40 ms + 4/3·E·g·tp / 5 Gb/s
    worst = max(4 * 0.040 + (2 * 2 / 3 * e * 4 * 2) * 8 / 5e9 for e in (e0, e1))
    assert ev.dp_sync == pytest.approx(worst)
