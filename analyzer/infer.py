"""The job's parallel layout read from its traces: which TP × DP × PP (Megatron order) explains its groups.

Our ring files, hashed NCCL logs and Flight Recorder dumps name each communicator's members. Every
factorization of the world size into TP, DP and PP sizes gives a set of groups (Megatron's order:
TP fastest, then DP, then PP); the one under which the most observed communicators are exactly a
group wins, the smaller TP first on a tie. Groups no factorization explains (a CP or EP group, an
embedding group) are counted, not forced. A layout given by flags that explains fewer communicators
than the inferred one is reported as contradicted.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrace.analyzer.layout import Layout, LayoutConfig, resolve
from megatrace.analyzer.table import TraceTable


@dataclass
class LayoutInference:
    """The inferred layout (None when the traces show no group to go by) and how well it fits."""

    layout: Layout | None
    explained: int
    observed: int

    def as_dict(self) -> dict | None:
        if self.layout is None:
            return None
        return {
            **{d: self.layout.sizes[d] for d in ("tp", "dp", "pp")},
            "explains": f"{self.explained}/{self.observed}",
        }


def observed_groups(table: TraceTable) -> set[tuple[int, ...]]:
    """Member sets of the communicators whose members the traces name (not those the layout assigned)."""
    world = table.world_size
    return {
        c.members
        for c in table.comms
        if not c.p2p and 2 <= len(c.members) < world and not (c.key.startswith("('inferred'"))
    }


def _explained(layout: Layout, groups: set[tuple[int, ...]]) -> int:
    known = {g for dim in ("tp", "dp", "pp") if layout.sizes[dim] > 1 for g in layout.groups(dim)}
    return len(groups & known)


def infer_layout(table: TraceTable, gpus_per_node: int = 8) -> LayoutInference:
    world = table.world_size
    groups = observed_groups(table)
    if world < 2 or not groups:
        return LayoutInference(None, 0, len(groups))
    sizes = {len(g) for g in groups}
    best: tuple[int, int, Layout] | None = None
    for tp in sorted({1, *sizes}):
        if world % tp:
            continue
        for pp in sorted({1, *sizes}):
            if (world // tp) % pp:
                continue
            layout = resolve(LayoutConfig(world_size=world, tp=tp, pp=pp, gpus_per_node=gpus_per_node))
            score = _explained(layout, groups)
            if best is None or score > best[0]:
                best = (score, tp, layout)
    assert best is not None
    return LayoutInference(best[2] if best[0] else None, best[0], len(groups))


def check_given(given: Layout, inferred: LayoutInference, table: TraceTable) -> str | None:
    """A note when the traces contradict the given layout (the inferred one explains more groups)."""
    if inferred.layout is None:
        return None
    groups = observed_groups(table)
    mine = _explained(given, groups)
    if mine >= inferred.explained:
        return None
    g, i = given.sizes, inferred.layout.sizes
    return (
        f"the layout given (tp {g['tp']}, dp {g['dp']}, pp {g['pp']}) matches {mine} of the "
        f"{len(groups)} communicators in the traces; tp {i['tp']}, dp {i['dp']}, pp {i['pp']} matches "
        f"{inferred.explained}: check the flags or the layout file"
    )
