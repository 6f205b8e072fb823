"""torchft's DiLoCo as a peer in the WAN sync frontier (`bench/wan_frontier.py`).

    .venv/bin/pip install torchft 'torch==2.13.0'     # optional; not a dependency of cpn
    .venv/bin/python bench/wan_frontier.py --quick --configs ddp,torchft-diloco32

The same six ranks as `bench/wan_sync.py`'s worker — 3 sites × 2 ranks, site-major, the
same GPT, seed, token shards, AdamW and learning-rate schedule — but the sync is torchft's
(`torchft.local_sgd.DiLoCo`, torchft 0.2.0): each site is a torchft *replica group*
whose two ranks reduce their gradients every step with plain DDP over a site-local gloo
group (the LAN), and every H steps torchft's `Manager` all-reduces the pseudo-gradients
across the three replica groups (rank r of each site with rank r of the others: both
ranks of a site cross the WAN, each with the whole model, as torchft does with DDP inside
a replica) and applies the outer optimizer, Nesterov SGD lr 0.7 / momentum 0.9 (torchft's
own example and DiLoCo's). The quorum comes from a `LighthouseServer` in the benchmark's
process (min 3 replicas); `init_sync=False` because every replica starts from the same
seed (no checkpoint transfer at step 0).

WAN bytes: torchft's pseudo-gradient all-reduce is counted as it is issued
(`Manager.allreduce`, wrapped): for each tensor, what this member sends in a ring
all-reduce among the participants (`cpn.wire.ring_allreduce_bytes`, the convention DDP's
bytes follow; every member of that ring is at another site). torchft's control traffic —
quorum and commit RPCs to the lighthouse and the managers — is not counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from wan_sync import RANKS_PER_SITE, SITES, RankFailed, Run, Setup, SyncConfig, held_out_loss

from cpn import wire
from cpn.listen_ports import free_port
from cpn.train.data import BatchSource
from cpn.train.model import GPTConfig, GPTStage
from cpn.train.trainer import learning_rate

#: DiLoCo's outer optimizer, as in torchft's example.
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


def unavailable() -> str | None:
    """Why torchft's DiLoCo cannot run here (None: it can)."""
    if find_spec("torchft") is None:
        return "torchft is not installed (optional: pip install torchft 'torch==2.13.0')"
    return None


def worker(spec_path: Path, rank: int) -> None:
    """One rank: site `rank // 2`'s replica group, group rank `rank % 2`."""
    # torchft is optional: imported only where it runs.
    from torchft.local_sgd import DiLoCo  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: PLC0415
    from torchft.manager import Manager  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: PLC0415
    from torchft.process_group import ProcessGroupGloo  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: PLC0415

    spec = json.loads(spec_path.read_text())
    setup = Setup(**spec["setup"])
    every: int = spec["every"]
    out = Path(spec["out"])
    site, local = divmod(rank, RANKS_PER_SITE)
    world = len(SITES) * RANKS_PER_SITE
    timeout = timedelta(seconds=spec["timeout_s"])
    torch.set_num_threads(1)
    torch.manual_seed(setup.seed)
    port = spec["store_ports"][site]
    # The site's LAN: DDP over the replica group's own gloo group, whose TCPStore (on
    # group rank 0) is also the store torchft's Manager of this replica group uses.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=local,
        world_size=RANKS_PER_SITE,
        timeout=timeout,
    )
    model = GPTStage(
        GPTConfig(setup.layers, setup.hidden, setup.heads, setup.seq_len, setup.vocab),
        seed=setup.seed,
    )
    ddp = DistributedDataParallel(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    inner = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=setup.lr,
        betas=(0.9, 0.95),
    )
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=len(SITES),
        use_async_quorum=False,  # DiLoCo requires it
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=local,
        world_size=RANKS_PER_SITE,
        store_addr="127.0.0.1",
        store_port=port,
        lighthouse_addr=spec["lighthouse"],
        replica_id=f"site-{SITES[site]}",
        port=0,
        hostname="127.0.0.1",
        init_sync=False,  # same seed everywhere: nothing to heal at step 0
    )
    wan_sent = [0]
    allreduce = manager.allreduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        n, position = manager.num_participants(), manager.participating_rank()
        if position is not None:
            wan_sent[0] += wire.ring_allreduce_bytes(
                tensor.numel(), tensor.element_size(), n, position
            )
        return allreduce(tensor, *args, **kwargs)

    manager.allreduce = counted
    data = BatchSource(
        setup.seq_len, setup.vocab, world * setup.batch, setup.batch, world, setup.seed
    )
    steps: int = spec["steps"]
    losses: list[float] = []
    seconds: list[float] = []
    wan: list[int] = []
    with DiLoCo(
        manager, [model], inner, outer, sync_every=every, pin_memory=False,
        use_bucketization=True,
    ):  # fmt: skip
        for step in range(steps):
            began = time.perf_counter()
            before = wan_sent[0]
            for group in inner.param_groups:
                group["lr"] = learning_rate(setup.lr, step, steps)
            ((x, y),) = data.for_replica(step, rank)
            loss = ddp(x, y)
            loss.backward()
            inner.step()  # every H steps: torchft's outer step, in the optimizer's hook
            inner.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - began)
            losses.append(loss.item())
            wan.append(wan_sent[0] - before)
    eval_loss = None
    if rank == 0:
        eval_loss = held_out_loss(model, setup)
    result = {
        "rank": rank,
        "losses": losses,
        "seconds": seconds,
        "wan_bytes": wan,
        "intra_site_bytes": [0] * steps,
        "uplink_tx_bytes": None,
        "eval_loss": eval_loss,
        "bucket_bytes": [],
        "parameters": sum(p.numel() for p in model.parameters()),
        "committed_outer_steps": manager.current_step(),
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def launch(config: SyncConfig, setup: Setup, workdir: Path) -> Run:
    """Run `config` (compression "torchft", `every` = H) with six local processes and a
    lighthouse in this process; raises RankFailed if a rank fails or hangs."""
    from torchft._torchft import LighthouseServer  # type: ignore[import-untyped,import-not-found,unused-ignore]  # noqa: PLC0415

    if setup.steps % config.every:
        raise ValueError(f"{config.key}: {setup.steps} steps are not a multiple of H")
    workdir.mkdir(parents=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=len(SITES))
    spec = {
        "setup": asdict(setup),
        "every": config.every,
        "steps": setup.steps,
        "out": str(workdir),
        "timeout_s": 300.0,
        "lighthouse": lighthouse.address(),
        "store_ports": [free_port("127.0.0.1") for _ in SITES],
    }
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    world = len(SITES) * RANKS_PER_SITE
    procs: list[subprocess.Popen[bytes]] = []
    began = time.monotonic()
    deadline = began + 120 + setup.steps * 30
    try:
        for rank in range(world):
            with (workdir / f"rank-{rank}.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "--worker", str(spec_path), str(rank)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                tail = (workdir / f"rank-{failed[0]}.log").read_text()[-3000:]
                raise RankFailed(f"{config.name}: rank {failed[0]} failed:\n{tail}")
            reported = all((workdir / f"rank-{r}.json").exists() for r in range(world))
            if reported:  # a rank hanging in teardown is given 20 s, then ended
                break
            if time.monotonic() > deadline:
                raise RankFailed(f"{config.name}: still running at the deadline ({workdir})")
            time.sleep(0.2)
    finally:
        grace = time.monotonic() + 20
        for p in procs:
            try:
                p.wait(max(0.1, grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    reports = [json.loads((workdir / f"rank-{r}.json").read_text()) for r in range(world)]
    return Run(reports, time.monotonic() - began)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(Path(sys.argv[2]), int(sys.argv[3]))
