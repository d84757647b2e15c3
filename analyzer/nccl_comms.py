"""Communicator inference for Megatrace NCCL logs: which calls on different ranks are the same collective.

A full ``groupHash`` names the communicator directly; a truncated hash is mapped to the one full
hash it is a prefix of. Calls without a usable hash (older builds, or ``groupHash 0`` written for
communicators made by ``ncclCommSplit``) are grouped per rank by CUDA stream (each process group has
its own stream, and ``opCount`` counts per communicator), then matched across ranks by their call
signature (the most frequent ``(op, count)``). Parallel groups with identical signatures (all TP
groups, say) are split with the layout when one is given: among the layout dimensions whose groups
tile the ranks, the one whose members issue each call closest together wins. Without a layout they
stay one merged group, which still lets the detectors find the rank behind or late.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from megatrace.analyzer.layout import DIMS, Layout
from megatrace.analyzer.nccl_log import NcclRankLog
from megatrace.analyzer.table import OP_CODE, P2P_OPS, RankCalls, RankInfo, empty_columns

DTYPE_BYTES = 2  # counts are elements; fp16/bf16 is the common case for training traffic


def _hash_canonical(logs: list[NcclRankLog]) -> dict[int, int]:
    """Map every hash value seen to the full hash it abbreviates (itself when it is full)."""
    digits: dict[int, int] = {}
    for log in logs:
        usable = log.has_hash & (log.group_hash != 0)
        for value, nd in zip(log.group_hash[usable].tolist(), log.hash_digits[usable].tolist(), strict=True):
            digits[value] = max(digits.get(value, 0), nd)
    texts = sorted(str(value) for value in digits)
    canonical: dict[int, int] = {}
    for i, text in enumerate(texts):
        longer = []
        j = i + 1
        while j < len(texts) and texts[j].startswith(text):
            longer.append(texts[j])
            j += 1
        full = [t for t in longer if not any(o != t and o.startswith(t) for o in longer)]
        canonical[int(text)] = int(full[0]) if len(full) == 1 else int(text)
    return canonical


def _signature(log: NcclRankLog, rows: np.ndarray) -> tuple[int, int]:
    pairs = Counter(zip(log.op[rows].tolist(), log.count[rows].tolist(), strict=True))
    return max(pairs.items(), key=lambda item: (item[1], item[0]))[0]


def _spread(groups: list[tuple[int, ...]], times: dict[int, dict[int, int]]) -> float:
    """Median over groups and shared opCounts of the time between first and last member's call."""
    spreads = []
    for group in groups:
        series = [times[r] for r in group if r in times]
        if len(series) < 2:
            continue
        shared = set.intersection(*(set(s) for s in series))
        for op_count in sorted(shared)[-64:]:
            values = [s[op_count] for s in series]
            spreads.append(max(values) - min(values))
    return float(np.median(spreads)) if spreads else float("inf")


def _split_class(
    ranks: set[int], times: dict[int, dict[int, int]], layout: Layout | None
) -> list[tuple[int, ...]]:
    if layout is None:
        return [tuple(sorted(ranks))]
    best: tuple[float, list[tuple[int, ...]]] | None = None
    for dim in DIMS:
        if layout.sizes[dim] < 2:
            continue
        groups = [g for g in layout.groups(dim) if set(g) & ranks]
        if any(not set(g) <= ranks for g in groups) or len(groups) < 2:
            continue
        score = _spread(groups, times)
        if best is None or score < best[0]:
            best = (score, groups)
    return best[1] if best else [tuple(sorted(ranks))]


def nccl_rank_calls(logs: list[NcclRankLog], layout: Layout | None = None) -> list[RankCalls]:
    """Turn parsed logs into `RankCalls` whose communicators are identified across ranks."""
    canonical = _hash_canonical(logs)
    hashed_members: dict[int, set[int]] = defaultdict(set)
    local: dict[tuple[int, int], np.ndarray] = {}
    classes: dict[tuple[int, int], set[int]] = defaultdict(set)
    class_of: dict[tuple[int, int], tuple[int, int]] = {}
    times: dict[tuple[int, int], dict[int, dict[int, int]]] = defaultdict(dict)
    for i, log in enumerate(logs):
        usable = log.has_hash & (log.group_hash != 0)
        for value in np.unique(log.group_hash[usable]).tolist():
            hashed_members[canonical.get(value, value)].add(log.rank)
        for stream in np.unique(log.stream[~usable]).tolist():
            rows = np.flatnonzero(~usable & (log.stream == stream))
            sig = _signature(log, rows)
            local[(i, stream)] = rows
            classes[sig].add(log.rank)
            class_of[(i, stream)] = sig
            times[sig][log.rank] = dict(
                zip(log.op_count[rows].tolist()[-256:], log.enqueue_ns[rows].tolist()[-256:], strict=True)
            )
    group_of: dict[tuple[tuple[int, int], int], tuple[int, ...]] = {}
    for sig, ranks in classes.items():
        for group in _split_class(ranks, times[sig], layout):
            for rank in group:
                group_of[(sig, rank)] = group

    out = []
    for i, log in enumerate(logs):
        n = len(log.enqueue_ns)
        cols = empty_columns(n)
        cols["rank"][:] = log.rank
        cols["seq"][:] = log.op_count
        cols["op"][:] = log.op
        cols["nbytes"][:] = log.count * DTYPE_BYTES
        cols["enqueue_ns"][:] = log.enqueue_ns
        comms: list[tuple[object, tuple[int, ...], bool]] = []
        usable = log.has_hash & (log.group_hash != 0)
        for value in np.unique(log.group_hash[usable]).tolist():
            full = canonical.get(value, value)
            rows = usable & (log.group_hash == value)
            cols["comm"][rows] = len(comms)
            comms.append((("hash", full), tuple(sorted(hashed_members[full])), _all_p2p(log.op[rows])))
        for (j, _stream), rows in local.items():
            if j != i:
                continue
            sig = class_of[(j, _stream)]
            group = group_of[(sig, log.rank)]
            cols["comm"][rows] = len(comms)
            comms.append((("inferred", sig, group), group, _all_p2p(log.op[rows])))
        info = RankInfo(
            rank=log.rank,
            source=log.path,
            fmt="nccl-log",
            has_completion=False,
            observed_until_ns=int(log.enqueue_ns.max()) if n else 0,
        )
        out.append(RankCalls(log.rank, cols, comms, info))
    return out


def _all_p2p(ops: np.ndarray) -> bool:
    return bool(len(ops)) and bool(np.isin(ops, list(P2P_OPS)).all())


__all__ = ["OP_CODE", "nccl_rank_calls"]
