"""Free GPUs of an instance, handed out tp at a time: what shard-by-shard placers share."""

from __future__ import annotations

from cpn.scheduler.instance import Instance


class FreeGpus:
    """First-fit allocation of tensor-parallel groups on the nodes of each site."""

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.tp = inst.workload.tp
        # Per site, its nodes in file order: (group index, node name, free GPU list).
        self.nodes: dict[str, list[tuple[int, str, list[int]]]] = {
            s: [(g.index, n.name, list(n.free_gpus)) for g in inst.groups_of(s) for n in g.nodes]
            for s in inst.sites
        }
        # Nodes before this index have fewer than tp free GPUs left: never look at them again.
        self.first = dict.fromkeys(inst.sites, 0)

    def take(self, site: str, stage: int) -> tuple[str, list[int]] | None:
        """tp GPUs of one node of `site` that fits `stage`, or None."""
        nodes, tp = self.nodes[site], self.tp
        while self.first[site] < len(nodes) and len(nodes[self.first[site]][2]) < tp:
            self.first[site] += 1
        for group, name, pool in nodes[self.first[site] :]:
            if len(pool) >= tp and self.inst.fits[stage][group]:
                gpus = pool[:tp]
                del pool[:tp]
                return name, gpus
        return None

    def give_back(self, site: str, node: str, gpus: list[int]) -> None:
        for i, (_, name, pool) in enumerate(self.nodes[site]):
            if name == node:
                pool[:0] = gpus
                self.first[site] = min(self.first[site], i)
                return
        raise KeyError((site, node))

    def slots(self, site: str, stage: int) -> int:
        return sum(
            len(pool) // self.tp
            for group, _, pool in self.nodes[site]
            if self.inst.fits[stage][group]
        )
