"""Enqueue-only logs (Megatrace's NCCL logs): of several hung-rank suspects, the one that stopped first.

These logs have no completion time and no peer, so a pipeline hang leaves two kinds of suspects that
their peers wait on: the hung rank, stopped in compute, and its pipeline neighbour, waiting in a
transfer to or from it (it never issued its next collective either). The hung rank's last record
comes first — by many compute intervals, far more than clock skew between nodes — and its last call is
not a transfer; the neighbour's last call is the send or receive it waits in. Suspects are ordered by
when they stopped; within `SKEW_NS` of each other, a suspect whose last call is a transfer goes after
one whose last call is not.
"""

from __future__ import annotations

import numpy as np

from megatrace.tracer.format import OP_CODES

SKEW_NS = 5_000_000  # clock skew between nodes is milliseconds
TRANSFERS = (OP_CODES["send"], OP_CODES["recv"])


def last_call(table, rank: int) -> tuple[int, bool]:
    """(time of `rank`'s last logged call, whether that call is a send or receive)."""
    lo, hi = table.rank_span(rank)
    row = lo + int(np.argmax(table["enqueue_ns"][lo:hi]))
    return int(table["enqueue_ns"][row]), int(table["op"][row]) in TRANSFERS


def order(table, suspects: list) -> list:
    """`suspects` (those that are ranks waited on, with a log) ordered by when they stopped, where the
    logs are enqueue-only and there are several; others unchanged, after them."""
    ranks = [s for s in suspects if s.cause == "rank_missing" and s.rank in table.ranks]
    if len(ranks) < 2 or any(table.ranks[s.rank].has_completion for s in ranks):
        return suspects
    stops = {s.rank: last_call(table, s.rank) for s in ranks}
    earliest = min(t for t, _transfer in stops.values())

    def key(s) -> tuple[int, bool, int]:
        t, transfer = stops[s.rank]
        return (int((t - earliest) // SKEW_NS), transfer, t)

    ranked = sorted(ranks, key=key)
    first_t = stops[ranked[0].rank][0]
    for s in ranked[1:]:
        gap = (stops[s.rank][0] - first_t) / 1e6
        s.confidence = min(s.confidence, 0.6)
        s.evidence += f" It stopped {gap:.0f} ms after rank {ranked[0].rank}" + (
            ", in a send or receive: it may wait there for it." if stops[s.rank][1] else "."
        )
    return ranked + [s for s in suspects if s not in ranked]
