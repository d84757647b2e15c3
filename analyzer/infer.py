"""The job's parallel layout read from its traces: which TP × DP × PP (Megatron order) explains its groups.

Our ring files, hashed NCCL logs and Flight Recorder dumps name each communicator's members, and
point-to-point transfers pair pipeline neighbours. Every factorization of the world size into TP, DP
and PP sizes gives a set of groups (Megatron's order: TP fastest, then DP, then PP); the one under
which the most observed communicators are exactly a group (or a transfer falls inside a PP group)
wins; on a tie the larger TP (groups of consecutive ranks are TP groups in Megatron's order, and
memberships alone cannot tell them from DP groups). Groups no factorization explains (a CP or EP
group, an embedding group) are counted, not forced. A layout given by flags that explains fewer
communicators than the inferred one is reported as contradicted.
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


def observed_groups(table: TraceTable, layout_given: bool = False) -> set[tuple[int, ...]]:
    """Member sets of the communicators the traces show; with a layout given, not those of hash-less NCCL
    logs (the layout assigned them, so they cannot test it)."""
    world = table.world_size
    return {
        c.members
        for c in table.comms
        if not c.p2p
        and 2 <= len(c.members) < world
        and not (layout_given and c.key.startswith("('inferred'"))
    }


def observed_pairs(table: TraceTable) -> set[tuple[int, int]]:
    """Ranks that exchange point-to-point transfers (pipeline neighbours in a Megatron job); not those of
    hash-less NCCL logs, whose pairing is itself a guess."""
    return {
        c.members
        for c in table.comms
        if c.p2p and len(c.members) == 2 and not c.key.startswith("('inferred'")
    }


def _explained(
    layout: Layout, groups: set[tuple[int, ...]], pairs: set[tuple[int, int]] = frozenset()
) -> int:
    """Observed groups that are exactly a group of the layout, plus transfers inside one of its PP groups."""
    known = {g for dim in ("tp", "dp", "pp") if layout.sizes[dim] > 1 for g in layout.groups(dim)}
    stage_of = {r: set(layout.group(r, "pp")) for r in {r for pair in pairs for r in pair}}
    in_pp = sum(1 for a, b in pairs if b in stage_of[a] and layout.sizes["pp"] > 1)
    return len(groups & known) + in_pp


def infer_layout(table: TraceTable, gpus_per_node: int = 8) -> LayoutInference:
    world = table.world_size
    groups = observed_groups(table)
    pairs = {p for p in observed_pairs(table) if max(p) < world}
    if world < 2 or not (groups or pairs):
        return LayoutInference(None, 0, len(groups) + len(pairs))
    sizes = {len(g) for g in groups} | {d for d in range(2, world + 1) if pairs and not world % d}
    best: tuple[int, int, Layout] | None = None
    for tp in sorted({1, *sizes}):
        if world % tp:
            continue
        for pp in sorted({1, *sizes}, reverse=True):  # on a tie: the larger TP, the smaller PP
            if (world // tp) % pp:
                continue
            layout = resolve(LayoutConfig(world_size=world, tp=tp, pp=pp, gpus_per_node=gpus_per_node))
            score = _explained(layout, groups, pairs)
            if best is None or score >= best[0]:
                best = (score, tp, layout)
    assert best is not None
    return LayoutInference(best[2] if best[0] else None, best[0], len(groups) + len(pairs))


def check_given(given: Layout, inferred: LayoutInference, table: TraceTable) -> str | None:
    """A note when the traces contradict the given layout (the inferred one explains more groups)."""
    if inferred.layout is None:
        return None
    groups = observed_groups(table, layout_given=True)
    pairs = {p for p in observed_pairs(table) if max(p) < given.world_size}
    mine = _explained(given, groups, pairs)
    if mine >= inferred.explained:
        return None
    g, i = given.sizes, inferred.layout.sizes
    return (
        f"the layout given (tp {g['tp']}, dp {g['dp']}, pp {g['pp']}) matches {mine} of the "
        f"{len(groups) + len(pairs)} communicators and transfer pairs in the traces; "
        f"tp {i['tp']}, dp {i['dp']}, pp {i['pp']} matches "
        f"{inferred.explained}, and is used to judge pipeline stages: check the flags or the layout file"
    )
