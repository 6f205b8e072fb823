"""Cost model: bytes per link class and time per iteration of a 3D-parallel placement.

One place computes these numbers: the scheduler minimises them, the API reports them and
the runtime's byte counters are checked against them. Notation (DESIGN.md §3): `b`
micro-batch, `s` sequence length, `h` hidden size, `m` micro-batches per replica per
iteration, `a` activation bytes, `g` gradient bytes on the wire.

Bytes are *sent* bytes summed over all senders, with the algorithm each collective uses
fixed by convention so that the counts are exact integers:
  - ring all-reduce of E elements over n members: 2·(n − 1)·E elements in all;
  - tree reduce or broadcast over n members: (n − 1)·E (every non-root sends or receives
    exactly one message of E);
  - ring all-gather of a c-byte payload per member: n·(n − 1)·c.

Traffic, per iteration:
  - pipeline: between stage p and p+1 of one replica, 2·m·b·s·h·a (activations forward,
    their gradients backward). With tp > 1 each tensor-parallel rank sends 1/tp of it and
    the receivers all-gather inside their node (Megatron's scatter/gather), so the hop
    carries exactly this; the all-gather is intra-node traffic.
  - tensor parallel (intra-node): per layer and micro-batch 4 all-reduces of b·s·h·a; the
    vocabulary-parallel embedding adds one in the first stage, the head adds one (its input
    gradient) plus three fp32 all-reduces of b·s for the parallel cross-entropy.
  - data parallel, per stage and tensor-parallel rank, hierarchical over the k sites that
    hold replicas of the stage: inside each site with c replicas a reduce and a broadcast,
    2·(c − 1)·E·g; across sites, dense: a ring all-reduce among site leaders, 2·(k − 1)·E·w
    (w: gradient bytes, or 2 with fp16); top-k at density d: a ring all-gather of each
    leader's sparse payload, k·(k − 1)·payload (see `cpn.wire`). With tp > 1, parameters
    every tensor-parallel worker holds whole (LayerNorms, row-parallel biases) are synced
    dense even under top-k: each worker compressing its own copy would let the copies
    drift apart. They are small (6·h per layer against 12·h²/tp sharded); their ring
    all-reduce is added to the sparse exchange. Low-bit values (`int8`/`int4`, one fp32
    scale per block) are all-gathered like top-k payloads, k·(k − 1)·payload.
  - outer-step sync (`wan: outer`, DiLoCo): the in-site reduce and broadcast every
    iteration; every H iterations the leaders exchange the pseudo-gradient (dense or fp16
    ring, or int8/int4/top-k payloads as above) and broadcast its mean in the site,
    (c − 1)·E·g. Per-iteration figures are one exchange ÷ H, each term rounded up
    (`dp_wan_bytes`); `dp_wan_bytes_per_sync` is the exact exchange the runtime sends.

Time, per iteration (1F1B schedule, no overlap of data-parallel sync with compute):
  (m + pp − 1)·max_p(compute_p + boundary_p) + max_p dp_sync_p
where compute_p is the slowest shard of stage p per micro-batch (forward + backward at
`EFFICIENCY` of peak, plus its tensor-parallel all-reduces), boundary_p the slowest hop
from stage p to p+1 per micro-batch (both directions; replicas crossing the same pair of
sites share its route's bandwidth), and dp_sync_p the in-site phase plus the WAN phase,
whose time is the worst over pairs of sites used by the stage of
(steps · latency + bytes per leader / bandwidth). Known simplifications: transfers of
different stages or site pairs that share a WAN link are not made to share its
bandwidth; gradient sync is not overlapped with the backward pass.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from cpn import wire
from cpn.contracts.job import JobSpec, OuterValues, ParallelSpec, WanCompression
from cpn.contracts.topology import NodeSpec, Topology
from cpn.gpt_shapes import ParamShape, padded_vocab, stage_layers, stage_parameters
from cpn.network import Route, SiteGraph

#: Fraction of peak FLOP/s a transformer training step reaches (model FLOPs utilisation).
EFFICIENCY = 0.45
#: Bytes of optimizer state + weights + gradients per parameter under Adam with mixed
#: precision: 2 (weights) + 2 (grads) + 4 (fp32 master) + 4 + 4 (moments). fp32 training
#: needs 4 + 4 + 8 = 16 as well.
STATE_BYTES_PER_PARAM = 16
#: CUDA context, communication buffers, allocator slack.
RUNTIME_OVERHEAD_BYTES = 1 << 30
GIB = 1 << 30
#: Values of a sparse payload are sent as fp16.
SPARSE_VALUE_BYTES = 2


@dataclass(frozen=True)
class Workload:
    """A job with a fixed dp × tp × pp layout: the per-stage quantities of the cost model."""

    job: JobSpec
    parallel: ParallelSpec
    bucket_elements: int = wire.DEFAULT_BUCKET_ELEMENTS

    @classmethod
    def of(cls, job: JobSpec, parallel: ParallelSpec | None = None) -> Workload:
        return cls(job, parallel if parallel is not None else job.fixed_parallel)

    # -- shapes --------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.parallel.dp

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def pp(self) -> int:
        return self.parallel.pp

    @property
    def micro_batches(self) -> int:
        """m: micro-batches per replica per iteration."""
        return self.job.train.global_batch // (self.dp * self.job.train.micro_batch)

    @property
    def act_bytes(self) -> int:
        return self.job.train.dtype.bytes

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element on the wire inside a site."""
        return self.job.train.dtype.bytes

    @property
    def wan_grad_bytes(self) -> int:
        """Bytes per element of a dense gradient (or pseudo-gradient) on the WAN."""
        c = self.job.compression
        if c.wan is WanCompression.FP16 or (
            c.wan is WanCompression.OUTER and c.outer_values is OuterValues.FP16
        ):
            return 2
        return self.grad_bytes

    @property
    def codec(self) -> str | None:
        """ "topk", "int8" or "int4" when site leaders all-gather per-leader payloads (with
        error feedback) instead of running a dense ring; None for a dense ring."""
        c = self.job.compression
        if c.wan in (WanCompression.TOPK, WanCompression.INT8, WanCompression.INT4):
            return c.wan.value
        if c.wan is WanCompression.OUTER and c.outer_values.feedback:
            return c.outer_values.value
        return None

    @property
    def sparse(self) -> bool:
        """Whether the WAN exchange is an all-gather of payloads (top-k or low-bit values):
        with tp > 1 the parameters held whole are then synced dense beside it."""
        return self.codec is not None

    @property
    def outer(self) -> bool:
        return self.job.compression.wan is WanCompression.OUTER

    @property
    def outer_every(self) -> int:
        """H: iterations per WAN exchange (1 unless `wan: outer`)."""
        return self.job.compression.outer_every

    @property
    def density(self) -> float:
        return self.job.compression.effective_density

    @property
    def activation_bytes(self) -> int:
        """b·s·h·a: one micro-batch's activations at a stage boundary."""
        t, mdl = self.job.train, self.job.model
        return t.micro_batch * mdl.seq_len * mdl.hidden * self.act_bytes

    @cached_property
    def stage_params(self) -> list[list[ParamShape]]:
        """Parameters of one tensor-parallel rank of each stage."""
        return [stage_parameters(self.job.model, self.pp, self.tp, p) for p in range(self.pp)]

    @cached_property
    def _stage_numels(self) -> list[int]:
        return [sum(p.numel for p in params) for params in self.stage_params]

    def stage_numel(self, stage: int) -> int:
        """E: elements one tensor-parallel rank of `stage` holds (and syncs)."""
        return self._stage_numels[stage]

    def layers_in(self, stage: int) -> int:
        return len(stage_layers(self.job.model.layers, self.pp, stage))

    # -- bytes ---------------------------------------------------------------------------
    @property
    def boundary_bytes(self) -> int:
        """2·m·b·s·h·a: one replica's traffic between stage p and p+1 per iteration."""
        return 2 * self.micro_batches * self.activation_bytes

    def tp_bytes(self, stage: int) -> int:
        """Intra-node bytes one shard of `stage` sends per iteration (all its tp ranks)."""
        tp = self.tp
        if tp == 1:
            return 0
        n = self.activation_bytes
        allreduce = 2 * (tp - 1) * n  # ring all-reduce of n bytes over tp ranks
        per_mb = 4 * self.layers_in(stage) * allreduce
        if stage == 0:
            per_mb += allreduce  # vocabulary-parallel embedding, forward
        if stage == self.pp - 1:
            per_mb += allreduce  # head input gradient, backward
            tokens = self.job.train.micro_batch * self.job.model.seq_len
            per_mb += 3 * 2 * (tp - 1) * tokens * 4  # cross-entropy max, sum-exp, target
        if stage > 0:
            per_mb += (tp - 1) * n  # all-gather of the activation received from p − 1
        if stage < self.pp - 1:
            per_mb += (tp - 1) * n  # all-gather of the gradient received from p + 1
        return self.micro_batches * per_mb

    def dp_intra_bytes(self, stage: int, replicas_at_site: int) -> int:
        """In-site data-parallel bytes per iteration at one site holding `replicas_at_site`
        of the stage: reduce + broadcast of the gradient, and under `wan: outer` the
        broadcast of the mean pseudo-gradient once per H iterations (averaged, rounded up)."""
        c = replicas_at_site
        if c <= 1:
            return 0
        per_step = self.dp_intra_bytes_per_step(stage, c)
        # (c − 1)·⌈E·g·tp / H⌉: the broadcast per outer step ÷ H, rounded up, linear in c.
        per_sync = self.dp_intra_bytes_per_sync(stage, c) // (c - 1)
        return per_step + (c - 1) * -(-per_sync // self.outer_every)

    def dp_intra_bytes_per_step(self, stage: int, replicas_at_site: int) -> int:
        """In-site bytes of every iteration's gradient reduce + broadcast (any mode)."""
        c = replicas_at_site
        if c <= 1:
            return 0
        return 2 * (c - 1) * self.stage_numel(stage) * self.grad_bytes * self.tp

    def dp_intra_bytes_per_sync(self, stage: int, replicas_at_site: int) -> int:
        """Under `wan: outer`: the in-site broadcast of one outer step (else 0)."""
        c = replicas_at_site
        if c <= 1 or not self.outer:
            return 0
        return (c - 1) * self.stage_numel(stage) * self.grad_bytes * self.tp

    def sparse_params(self, stage: int) -> list[ParamShape]:
        """Parameters top-k compresses (with tp > 1: the sharded ones), in module order."""
        params = self.stage_params[stage]
        return params if self.tp == 1 else [p for p in params if p.sharded]

    def dense_params(self, stage: int) -> list[ParamShape]:
        """Parameters synced dense even under top-k (tp > 1: the ones held whole)."""
        return [] if self.tp == 1 else [p for p in self.stage_params[stage] if not p.sharded]

    def dense_numel(self, stage: int) -> int:
        return sum(p.numel for p in self.dense_params(stage))

    def payload_bytes(self, numel: int) -> int:
        """One leader's payload for a bucket of `numel` elements under `codec`."""
        if self.codec == "topk":
            return wire.sparse_payload_bytes(numel, self.density, SPARSE_VALUE_BYTES)
        return wire.quantized_bytes(numel, wire.QUANT_BITS[str(self.codec)])

    @cached_property
    def _sparse_payloads(self) -> list[int]:
        """Payload bytes (top-k or low-bit) per tensor-parallel rank and leader, per stage."""
        out = []
        for stage in range(self.pp):
            numels = [p.numel for p in self.sparse_params(stage)]
            out.append(
                sum(self.payload_bytes(n) for n in wire.bucket_numels(numels, self.bucket_elements))
            )
        return out

    def sparse_payload(self, stage: int) -> int:
        """Bytes one leader contributes per tensor-parallel rank in the payload exchange."""
        return self._sparse_payloads[stage] if self.sparse else 0

    def dp_wan_bytes_per_sync(self, stage: int, sites: int) -> int:
        """WAN bytes (all senders) of one exchange of `stage` across `sites` sites: every
        iteration's gradients, or under `wan: outer` one outer step's pseudo-gradients."""
        k = sites
        if k <= 1:
            return 0
        if self.sparse:
            sparse = k * (k - 1) * self.sparse_payload(stage)
            dense = 2 * (k - 1) * self.dense_numel(stage) * self.grad_bytes
            return (sparse + dense) * self.tp
        return 2 * (k - 1) * self.stage_numel(stage) * self.wan_grad_bytes * self.tp

    def dp_wan_bytes(self, stage: int, sites: int) -> int:
        """WAN bytes (all senders) per iteration to sync `stage` across `sites` sites.

        Under `wan: outer`, one exchange per H iterations: each term of the exchange's
        formula (per pair of sites, per site) is divided by H and rounded up, so that the
        figure stays linear or quadratic in the number of sites — convex, as the
        scheduler's formulations need — and at most a few bytes above exchange ÷ H.
        """
        k, h = sites, self.outer_every
        if k <= 1:
            return 0
        if h == 1:
            return self.dp_wan_bytes_per_sync(stage, sites)
        if self.sparse:
            pairs = -(-self.sparse_payload(stage) * self.tp // h)
            ring = -(-2 * self.dense_numel(stage) * self.grad_bytes * self.tp // h)
            return k * (k - 1) * pairs + (k - 1) * ring
        return (k - 1) * -(-2 * self.stage_numel(stage) * self.wan_grad_bytes * self.tp // h)

    def dp_wan_per_leader(self, stage: int, sites: int) -> float:
        """Bytes each site leader sends on its uplink (all tp ranks) per iteration with
        `sites` sites (one exchange ÷ H under `wan: outer`)."""
        k = sites
        if k <= 1:
            return 0.0
        if self.sparse:
            sparse = (k - 1) * self.sparse_payload(stage)
            dense = 2 * (k - 1) / k * self.dense_numel(stage) * self.grad_bytes
            return float((sparse + dense) * self.tp) / self.outer_every
        per_sync = 2 * (k - 1) / k * self.stage_numel(stage) * self.wan_grad_bytes * self.tp
        return per_sync / self.outer_every

    def dp_wan_steps(self, sites: int) -> int:
        """Sequential messages per leader: ring all-reduce 2(k−1), ring all-gather k−1
        (plus the dense ring of whole-held parameters under top-k with tp > 1)."""
        if sites <= 1:
            return 0
        if not self.sparse:
            return 2 * (sites - 1)
        return (sites - 1) * (3 if self.tp > 1 else 1)

    # -- memory and compute ---------------------------------------------------------------
    def memory_bytes(self, stage: int) -> int:
        """Peak memory of one GPU of `stage` under 1F1B.

        Activations per layer and micro-batch follow Korthikanti et al. 2022 (no sequence
        parallelism, no recomputation): s·b·h·(10 + 24/tp + 5·heads·s/(h·tp)) bytes in
        16-bit, scaled for fp32. 1F1B keeps min(m, pp − stage) micro-batches in flight.
        """
        mdl, t, tp = self.job.model, self.job.train, self.tp
        s, b, h = mdl.seq_len, t.micro_batch, mdl.hidden
        states = STATE_BYTES_PER_PARAM * self.stage_numel(stage)
        per_layer = s * b * h * (10 + 24 / tp + 5 * mdl.heads * s / (h * tp))
        per_layer *= self.act_bytes / 2
        in_flight = min(self.micro_batches, self.pp - stage)
        acts = per_layer * self.layers_in(stage) * in_flight
        if stage == 0:
            acts += s * b * h * self.act_bytes * in_flight
        if stage == self.pp - 1:
            acts += 2 * b * s * (padded_vocab(mdl.vocab, tp) // tp) * 4  # fp32 logits + grad
        return int(states + acts + RUNTIME_OVERHEAD_BYTES)

    def fits(self, stage: int, memory_gb: float) -> bool:
        return self.memory_bytes(stage) <= memory_gb * GIB

    def flops_per_microbatch(self, stage: int) -> float:
        """Forward + backward FLOPs of one tensor-parallel rank for one micro-batch."""
        mdl, t = self.job.model, self.job.train
        s, b, h = mdl.seq_len, t.micro_batch, mdl.hidden
        fwd = self.layers_in(stage) * (24 * b * s * h * h + 4 * b * s * s * h)
        if stage == self.pp - 1:
            fwd += 2 * b * s * h * padded_vocab(mdl.vocab, self.tp)
        return 3 * fwd / self.tp

    def compute_seconds(self, stage: int, node: NodeSpec) -> float:
        """One micro-batch, forward + backward, on a shard of `stage` placed on `node`."""
        flops = self.flops_per_microbatch(stage)
        seconds = flops / (node.gpu.tflops * 1e12 * EFFICIENCY)
        if self.tp > 1:
            per_rank = self.tp_bytes(stage) / self.micro_batches / self.tp
            seconds += per_rank * 8 / (node.intra_node_gbps * 1e9)
        return seconds

    def hop_seconds(self, route: Route | None, crossing: int, intra_site_gbps: float) -> float:
        """Per micro-batch: `crossing` replicas move activations and gradients over a hop.

        `route` None means both stages are in one site (the site's fabric at
        `intra_site_gbps`).
        """
        volume = crossing * self.activation_bytes
        if route is None:
            return 2 * volume * 8 / (intra_site_gbps * 1e9)
        return 2 * route.seconds(volume)

    def dp_intra_seconds(self, stage: int, intra_site_gbps: float) -> float:
        """In-site reduce + broadcast of one shard's gradients over the node's link."""
        nbytes = self.stage_numel(stage) * self.grad_bytes * self.tp
        return 2 * nbytes * 8 / (intra_site_gbps * 1e9)

    def dp_wan_seconds(self, stage: int, sites: int, routes: Iterable[Route]) -> float:
        """WAN phase of the stage's sync over `sites` sites: its slowest pair of sites.

        `routes` are the routes between the pairs of the stage's sites. Every leader sends
        `dp_wan_steps` sequential messages carrying `dp_wan_per_leader` bytes in all, so a
        pair takes `route.seconds(bytes, messages)`; the phase ends with the slowest pair.
        This is the one place the formula lives: `evaluate` calls it, and the CP-SAT time
        model takes its coefficients from `Route.seconds`, which is linear in both.
        """
        volume, steps = self.dp_wan_per_leader(stage, sites), self.dp_wan_steps(sites)
        return max((route.seconds(volume, steps) for route in routes), default=0.0)


@dataclass(frozen=True)
class Placement:
    """A shard placed on a node: what `evaluate` needs of a plan."""

    replica: int
    stage: int
    site: str
    node: str


@dataclass
class Evaluation:
    intra_node: int
    intra_site: int
    wan: int
    wan_links: dict[str, int]
    iteration_seconds: float
    compute: float
    pipeline: float
    dp_sync: float
    bubble: float
    price_per_hour: float
    gpus: int
    #: Under `wan: outer`: one outer exchange's bytes (the in-site broadcast and the WAN
    #: pseudo-gradients), which `intra_site` and `wan` above spread over H iterations
    #: (rounded up), and what every iteration sends besides (`step_*`). Together they give
    #: the exact bytes of any run prefix (`cpn.contracts.plan.BytesPerIteration.through`);
    #: None when the sync runs every step (then `intra_site` and `wan` are exact per step).
    exchange: Exchange | None = None


@dataclass(frozen=True)
class Exchange:
    """Bytes of one `wan: outer` exchange and of every iteration besides it."""

    every: int
    step_intra_site: int
    step_wan: int
    intra_site: int
    wan: int


def evaluate(
    workload: Workload,
    topology: Topology,
    graph: SiteGraph,
    shards: Sequence[Placement],
) -> Evaluation:
    """Bytes, time and price of a concrete placement (one entry per replica × stage)."""
    w = workload
    dp, pp, tp = w.dp, w.pp, w.tp
    node_spec = {(n.site, n.name): n.spec for n in topology.nodes()}
    site_spec = {s.name: s for s in topology.sites}
    where = {(sh.replica, sh.stage): sh for sh in shards}
    if len(where) != dp * pp:
        raise ValueError(f"shards: need {dp * pp} placements, got {len(where)}")

    per_stage = [0] * pp
    for sh in shards:
        per_stage[sh.stage] += 1
    intra_node = sum(c * w.tp_bytes(p) for p, c in enumerate(per_stage))
    intra_site = 0
    wan = 0
    # One outer exchange's bytes (0 unless `wan: outer`), beside the averaged figures.
    exchange_intra_site = 0
    exchange_wan = 0
    step_intra_site = 0  # every iteration's in-site bytes (the exchange's aside)
    step_wan = 0  # every iteration's WAN bytes: the pipeline hops
    links: dict[str, int] = defaultdict(int)

    def load(route: Route | None, nbytes: int) -> None:
        if route is None:
            return
        for key in route.links:
            links[key] += nbytes

    def route(a: str, b: str) -> Route:
        r = graph.route(a, b)
        if r is None:
            raise ValueError(f"sites {a!r} and {b!r} are not joined by any WAN path")
        return r

    # Pipeline hops.
    boundary = [0.0] * pp
    for p in range(pp - 1):
        crossing: dict[tuple[str, str], int] = defaultdict(int)
        for r in range(dp):
            crossing[(where[(r, p)].site, where[(r, p + 1)].site)] += 1
        for (a, b), count in crossing.items():
            nbytes = count * w.boundary_bytes
            if a == b:
                intra_site += nbytes
                step_intra_site += nbytes
                hop = w.hop_seconds(None, count, site_spec[a].intra_site_gbps)
            else:
                wan += nbytes
                step_wan += nbytes
                rt = route(a, b)
                load(rt, nbytes)
                hop = w.hop_seconds(rt, count, site_spec[a].intra_site_gbps)
            boundary[p] = max(boundary[p], hop)

    # Data-parallel sync, per stage: sites in ring order (by their lowest replica).
    dp_seconds = [0.0] * pp
    for p in range(pp):
        per_site: dict[str, int] = {}
        for r in range(dp):
            site = where[(r, p)].site
            per_site[site] = per_site.get(site, 0) + 1
        sites = list(per_site)  # insertion order = order of each site's first replica
        k = len(sites)
        intra_time = 0.0
        for site, c in per_site.items():
            intra_site += w.dp_intra_bytes(p, c)
            step_intra_site += w.dp_intra_bytes_per_step(p, c)
            exchange_intra_site += w.dp_intra_bytes_per_sync(p, c)
            if c >= 2:
                intra_time = max(intra_time, w.dp_intra_seconds(p, site_spec[site].intra_site_gbps))
        wan_time = 0.0
        if k >= 2:
            wan += w.dp_wan_bytes(p, k)
            exchange_wan += w.dp_wan_bytes_per_sync(p, k)
            # Per-link loads: leader i sends to leader i + 1 around the ring.
            e = w.stage_numel(p)
            for i, site in enumerate(sites):
                nxt = sites[(i + 1) % k]
                if w.sparse:
                    sent = (k - 1) * w.sparse_payload(p) * tp
                    sent += wire.ring_allreduce_bytes(w.dense_numel(p), w.grad_bytes, k, i) * tp
                else:
                    sent = wire.ring_allreduce_bytes(e, w.wan_grad_bytes, k, i) * tp
                load(route(site, nxt), -(-sent // w.outer_every))
            pairs = (route(a, b) for i, a in enumerate(sites) for b in sites[i + 1 :])
            wan_time = w.dp_wan_seconds(p, k, pairs)
        dp_seconds[p] = intra_time + wan_time

    # Compute: the slowest shard of each stage.
    compute = [0.0] * pp
    seconds: dict[tuple[int, str, str], float] = {}
    for sh in shards:
        at = (sh.stage, sh.site, sh.node)
        if at not in seconds:
            seconds[at] = w.compute_seconds(sh.stage, node_spec[(sh.site, sh.node)])
        compute[sh.stage] = max(compute[sh.stage], seconds[at])

    slot = [compute[p] + boundary[p] for p in range(pp)]
    worst = max(range(pp), key=lambda p: slot[p])
    m = w.micro_batches
    dp_sync = max(dp_seconds)
    iteration = (m + pp - 1) * slot[worst] + dp_sync

    gpu_price = sum(site_spec[sh.site].gpu_price_per_hour * tp for sh in shards)
    link_price = {link.key: link.price_per_gb for link in topology.links}
    per_iteration_egress = sum(link_price[k] * v / 1e9 for k, v in links.items())
    iterations_per_hour = 3600.0 / iteration if iteration > 0 else 0.0
    price = gpu_price + per_iteration_egress * iterations_per_hour

    return Evaluation(
        intra_node=intra_node,
        intra_site=intra_site,
        wan=wan,
        wan_links=dict(sorted(links.items())),
        iteration_seconds=iteration,
        compute=m * compute[worst],
        pipeline=m * boundary[worst],
        dp_sync=dp_sync,
        bubble=(pp - 1) * slot[worst],
        price_per_hour=price,
        gpus=dp * pp * tp,
        exchange=Exchange(
            every=w.outer_every,
            step_intra_site=step_intra_site,
            step_wan=step_wan,
            intra_site=exchange_intra_site,
            wan=exchange_wan,
        )
        if w.outer
        else None,
    )
