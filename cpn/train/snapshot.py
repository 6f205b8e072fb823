"""One worker's training state in `torch.distributed.checkpoint` form, and its way back.

Every tensor is keyed by what it is in the whole model, never by rank:
  - `model/<name>`, `optim/<name>/exp_avg`, `optim/<name>/exp_avg_sq`: the worker's piece of
    each parameter (and its AdamW moments) as a DTensor of the whole logical parameter
    (`cpn.train.parallelize.ShardLayout`), replicated over the stage's data-parallel
    replicas and split over its tensor-parallel group — so a run with any dp × tp × pp
    loads it, each worker reading exactly the pieces it holds;
  - `comm/residual/<site>/<name>`, `comm/velocity/<site>/<name>`: top-k error feedback is
    a site's memory (the leader of each site keeps what its site has not sent yet), keyed
    by site name and split like the parameter;
  - `train/step`, `optim/step`, `comm/step`, `comm/skipped`: counters, equal on every rank.

Under `wan: outer` (DiLoCo) a checkpoint is written only right after an outer step, when
every replica holds the same parameters (they are the outer anchor then). The inner
AdamW moments still differ by site: they are saved per site,
`optim/site/<site>/<name>/exp_avg`, and a site that is not in the checkpoint starts from
the first saved site's. The outer optimizer's Nesterov momentum is the same everywhere
(`outer/<name>/momentum`); the outer error feedback is a site's memory like the per-step
one (`comm/outer/<site>/<name>`), dropped with a log line when its site is gone.

A run that resumes on another layout gets every parameter and moment exactly. Error
feedback of a site that no longer holds the stage (or of a parameter now synced dense) has
no place to go: its mass is added once to the gradient of the first site's leader and
that step is synced dense, so nothing the old run held back is lost ("flushed with one
dense step"); DGC velocities of such sites are dropped (they only smooth).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from cpn.errors import InputError
from cpn.train.checkpoint import CheckpointStore
from cpn.train.data_parallel import DataParallelSync
from cpn.train.layout import Layout
from cpn.train.parallelize import ShardLayout

if TYPE_CHECKING:
    # torch.distributed.checkpoint, DTensor and DeviceMesh cost about half a second of
    # import per worker (a third of its start-up) and only checkpoints use them: they are
    # imported where a checkpoint is written or read.
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

log = logging.getLogger("cpn.train")


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def _dtensor(local: torch.Tensor, layout: ShardLayout, mesh: DeviceMesh, lead: int) -> DTensor:
    """`local` (already the logical piece) as a DTensor on `mesh`, whose last dimension is
    the tensor-parallel group and whose `lead` first dimensions replicate it."""
    from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: PLC0415

    split = Shard(layout.dim) if layout.dim is not None else Replicate()
    return DTensor.from_local(
        local,
        mesh,
        [*([Replicate()] * lead), split],
        run_check=False,
        shape=torch.Size(layout.shape),
        stride=_strides(layout.shape),
    )


@dataclass
class Resumed:
    """What loading a checkpoint found (the trainer logs it)."""

    step: int
    flushed_sites: list[str] = field(default_factory=list)
    dropped_velocity_sites: list[str] = field(default_factory=list)
    dropped_outer_sites: list[str] = field(default_factory=list)


class WorkerSnapshot:
    """Builds the worker's state dict for `dcp.save` and restores one with `dcp.load`."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sync: DataParallelSync,
        layout: Layout,
        shards: dict[str, ShardLayout],
        device: torch.device,
    ) -> None:
        self.module, self.optimizer, self.sync = module, optimizer, sync
        self.layout, self.shards, self.device = layout, shards, device
        self.params = dict(module.named_parameters())
        self.names = list(self.params)
        self._mesh: DeviceMesh | None = None

    # -- meshes --------------------------------------------------------------------------
    def mesh(self) -> DeviceMesh:
        """(pp, dp, tp) over the world: the plan's rank layout is this row-major order.
        Collective on first use (every worker checkpoints at the same steps)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

            p = self.layout.plan.parallel
            self._mesh = init_device_mesh(
                self.device.type, (p.pp, p.dp, p.tp), mesh_dim_names=("pp", "dp", "tp")
            )
        return self._mesh

    def _stage_mesh(self) -> DeviceMesh:
        return self.mesh()["dp", "tp"]

    def _tp_mesh(self) -> DeviceMesh:
        return self.mesh()["tp"]

    # -- what is saved ---------------------------------------------------------------------
    def _params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        yield from self.params.items()

    def _site_state(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(kind, parameter name, local buffer) of the error feedback this worker keeps."""
        state = self.sync.main
        if state.groups.leaders is None:
            return
        outer = self.sync.outer_steps[0].residuals if self.sync.outer_steps else {}
        for slot, position in enumerate(self.sync.sparse_positions):
            name = self.names[position]
            if slot in state.residuals:
                yield "residual", name, state.residuals[slot]
            if slot in state.velocities:
                yield "velocity", name, state.velocities[slot]
            if slot in outer:
                yield "outer", name, outer[slot]

    def _outer_momenta(self) -> Iterator[tuple[str, torch.optim.SGD, torch.Tensor]]:
        """(parameter name, outer optimizer, its anchor) for every parameter under
        `wan: outer`."""
        positions = [self.sync.sparse_positions, self.sync.dense_positions]
        for outer, where in zip(self.sync.outer_steps, positions, strict=False):
            for anchor, position in zip(outer.anchors, where, strict=True):
                yield self.names[position], outer.optimizer, anchor

    def _moment_key(self, name: str, moment: str) -> str:
        if self.sync.outer:
            return f"optim/site/{self.layout.me.site}/{name}/{moment}"
        return f"optim/{name}/{moment}"

    def state_dict(self, step: int, *, copy: bool) -> dict[str, Any]:
        """The tensors to save; `copy` for an asynchronous save (training goes on)."""

        def piece(name: str, t: torch.Tensor) -> torch.Tensor:
            view = self.shards[name].local_view(t.detach().view(self._param_shape(name)))
            return view.clone() if copy else view

        out: dict[str, Any] = {"train/step": torch.tensor(step, device="cpu")}
        stage_mesh = self._stage_mesh()
        optimizer_step = 0.0
        for name, p in self._params():
            out[f"model/{name}"] = _dtensor(piece(name, p), self.shards[name], stage_mesh, 1)
            st = self.optimizer.state.get(p, {})
            for moment in ("exp_avg", "exp_avg_sq"):
                if moment in st:
                    out[self._moment_key(name, moment)] = _dtensor(
                        piece(name, st[moment]), self.shards[name], stage_mesh, 1
                    )
            if "step" in st:
                optimizer_step = float(st["step"])
        out["optim/step"] = torch.tensor(optimizer_step, device="cpu")
        out["comm/step"] = torch.tensor(self.sync.main.step, device="cpu")
        out["comm/skipped"] = torch.tensor(self.sync.skipped_steps, device="cpu")
        for name, opt, anchor in self._outer_momenta():
            buf = opt.state.get(anchor, {}).get("momentum_buffer")
            if buf is not None:
                out[f"outer/{name}/momentum"] = _dtensor(
                    piece(name, buf), self.shards[name], stage_mesh, 1
                )
        if self.sync.outer_steps:
            first = self.sync.outer_steps[0]
            out["outer/steps"] = torch.tensor(first.outer_steps, device="cpu")
            out["outer/skipped"] = torch.tensor(first.skipped, device="cpu")
        site = self.layout.me.site
        scale = self.sync.main.feedback_scale
        for kind, name, buf in self._site_state():
            # In sums of gradients, whatever this run's group size (`feedback_scale`).
            # (Outer-step residuals are in shares of the mean pseudo-gradient already.)
            unscaled = scale == 1.0 or kind == "outer"
            kept = piece(name, buf) if unscaled else piece(name, buf) * scale
            out[f"comm/{kind}/{site}/{name}"] = _dtensor(
                kept, self.shards[name], self._tp_mesh(), 0
            )
        return out

    def _param_shape(self, name: str) -> torch.Size:
        return self.params[name].shape

    # -- loading ---------------------------------------------------------------------------
    def load(self, store: CheckpointStore, step: int) -> Resumed:
        metadata = store.metadata(step)
        keys = metadata.state_dict_metadata
        target: dict[str, Any] = {
            "train/step": torch.tensor(0, device="cpu"),
            "optim/step": torch.tensor(0.0, device="cpu"),
            "comm/step": torch.tensor(0, device="cpu"),
            "comm/skipped": torch.tensor(0, device="cpu"),
        }
        stage_mesh = self._stage_mesh()
        for name, p in self._params():
            key = f"model/{name}"
            self._check_shape(metadata, key, self.shards[name], store, step)
            target[key] = _dtensor(
                self.shards[name].local_view(p.data), self.shards[name], stage_mesh, 1
            )
            st = self.optimizer.state[p]
            # AdamW keeps its step count on the CPU (it is not capturable here).
            st["step"] = torch.zeros((), dtype=torch.float32, device="cpu")
            for moment in ("exp_avg", "exp_avg_sq"):
                st[moment] = torch.zeros_like(p, memory_format=torch.preserve_format)
                saved = self._saved_moment_key(keys, name, moment)
                if saved is None:
                    continue
                target[saved] = _dtensor(
                    self.shards[name].local_view(st[moment]), self.shards[name], stage_mesh, 1
                )
        for name, opt, anchor in self._outer_momenta():
            key = f"outer/{name}/momentum"
            if key in keys:
                buf = torch.zeros_like(anchor, memory_format=torch.contiguous_format)
                opt.state[anchor]["momentum_buffer"] = buf
                target[key] = _dtensor(
                    self.shards[name].local_view(buf), self.shards[name], stage_mesh, 1
                )
        if self.sync.outer_steps and "outer/steps" in keys:
            target["outer/steps"] = torch.tensor(0, device="cpu")
            target["outer/skipped"] = torch.tensor(0, device="cpu")
        resumed = Resumed(step=step)
        pending = self._site_targets(keys, target, resumed)
        self._read(store, step, target)
        optimizer_step = float(target["optim/step"])
        for _, p in self._params():
            self.optimizer.state[p]["step"].fill_(optimizer_step)
        for outer in self.sync.outer_steps:
            # Saved right after an outer step: the parameters are the anchor.
            with torch.no_grad():
                for anchor, param in zip(outer.anchors, outer.params, strict=True):
                    anchor.copy_(param)
            outer.inner_steps = 0
            if "outer/steps" in target:
                outer.outer_steps = int(target["outer/steps"])
                outer.skipped = int(target["outer/skipped"])
        main = self.sync.main
        main.step = int(target["comm/step"])
        main.skipped_steps = int(target["comm/skipped"])
        if main.feedback_scale != 1.0:  # stored in sums of gradients
            for store_ in (main.residuals, main.velocities):
                for buf in store_.values():
                    buf.div_(main.feedback_scale)
        if pending is not None:
            mass = {
                self.names.index(name): torch.stack([t.to_local() for t in parts]).sum(0)
                for name, parts in pending.items()
            }
            self.sync.flush(mass)
        elif resumed.flushed_sites:
            self.sync.flush({})  # another leader carries the mass; sync this step dense too
        resumed.step = int(target["train/step"])
        return resumed

    def _site_targets(
        self, keys: dict[str, Any], target: dict[str, Any], resumed: Resumed
    ) -> dict[str, list[DTensor]] | None:
        """Add this worker's error-feedback entries to `target`; return the pieces of other
        sites' residuals it must flush (first site's leader only), or None."""
        state = self.sync.main
        groups = state.groups
        mine = set(self.names)
        site = self.layout.me.site
        sparse_names = {self.names[i]: slot for slot, i in enumerate(self.sync.sparse_positions)}
        is_leader = groups.leaders is not None
        flusher = is_leader and groups.site == groups.sites[0]
        pending: dict[str, list[DTensor]] = {}
        for key in keys:
            parts = key.split("/", 3)
            if len(parts) != 4 or parts[0] != "comm" or parts[3] not in mine:
                continue
            _, kind, owner, name = parts
            if kind == "outer":
                outer = self.sync.outer_steps[0].residuals if self.sync.outer_steps else None
                if outer is not None and owner == site and is_leader and name in sparse_names:
                    target[key] = self._site_dtensor(
                        name, self._buffer(outer, sparse_names[name], name)
                    )
                elif (
                    owner not in groups.sites or outer is None
                ) and owner not in resumed.dropped_outer_sites:
                    resumed.dropped_outer_sites.append(owner)
                continue
            here = owner in groups.sites and name in sparse_names and state.feedback
            if kind == "velocity":
                if here and owner == site and is_leader:
                    buf = self._buffer(state.velocities, sparse_names[name], name)
                    target[key] = self._site_dtensor(name, buf)
                elif not here and owner not in resumed.dropped_velocity_sites:
                    resumed.dropped_velocity_sites.append(owner)
                continue
            if here:
                if owner == site and is_leader:
                    buf = self._buffer(state.residuals, sparse_names[name], name)
                    target[key] = self._site_dtensor(name, buf)
                continue
            if owner not in resumed.flushed_sites:
                resumed.flushed_sites.append(owner)
            if flusher:
                scratch = torch.zeros_like(self.params[name], memory_format=torch.contiguous_format)
                target[key] = self._site_dtensor(name, scratch)
                pending.setdefault(name, []).append(target[key])
        return pending if flusher and pending else None

    def _saved_moment_key(self, keys: dict[str, Any], name: str, moment: str) -> str | None:
        """Where this worker's AdamW moment of `name` is in the checkpoint: its own site's
        (outer-step runs save them per site), else the first saved site's, else the
        replicated one; None if the checkpoint has none (saved before the first step)."""
        mine = self._moment_key(name, moment)
        if mine in keys:
            return mine
        plain = f"optim/{name}/{moment}"
        if plain in keys:
            return plain
        suffix = f"/{name}/{moment}"
        per_site = sorted(k for k in keys if k.startswith("optim/site/") and k.endswith(suffix))
        return per_site[0] if per_site else None

    def _buffer(self, store: dict[int, torch.Tensor], slot: int, name: str) -> torch.Tensor:
        numel = self.params[name].numel()
        return self.sync.main.buffer(store, slot, numel, self.device)

    def _site_dtensor(self, name: str, buf: torch.Tensor) -> DTensor:
        view = self.shards[name].local_view(buf.view(self._param_shape(name)))
        return _dtensor(view, self.shards[name], self._tp_mesh(), 0)

    def _check_shape(
        self, metadata: Metadata, key: str, layout: ShardLayout, store: CheckpointStore, step: int
    ) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415

        meta = metadata.state_dict_metadata.get(key)
        where = f"checkpoint {store.step_path(step)}"
        if not isinstance(meta, TensorStorageMetadata):
            raise InputError(f"{where}: has no {key} (written for another model?)")
        if tuple(meta.size) != layout.shape:
            raise InputError(
                f"{where}: {key} is {tuple(meta.size)}, this model's is {layout.shape}"
            )

    def _read(self, store: CheckpointStore, step: int, target: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict_loader import load  # noqa: PLC0415

        try:
            load(target, storage_reader=store.reader(step))
        except InputError:
            raise
        except Exception as exc:  # a corrupt or truncated data file: name the checkpoint
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InputError(
                f"checkpoint {store.step_path(step)}: cannot be read ({first})"
            ) from None
