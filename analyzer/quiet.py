"""When ranks that made no call for a while before their traces end are quiet, measured against the job.

A rank's trace ends at an observation (a dump, the last sign of life of its ring). It is *quiet* when
the time from its last call to that end is longer than the stall threshold, than `GAP_MULTIPLE`
times the longest gap between calls seen earlier in the same job (any rank's): the job's own rhythm,
gaps at step boundaries included (optimizer steps, data loading, evaluation, checkpoints), and than
`USUAL_MULTIPLE` of its median gap (a gap inside a step, alone blind to those pauses). Ranks that
are all quiet after the same collective call, which completed, ended or paused together there:
nothing in the traces waits (`ended_together`).
"""

from __future__ import annotations

import numpy as np

from megatrace.analyzer.table import TraceTable
from megatrace.tracer.format import op_name

GAP_MULTIPLE = 3.0
USUAL_MULTIPLE = 20.0  # and never less than this many of the rank's median gaps


def longest_gap_ns(table: TraceTable) -> float:
    """The longest gap between two consecutive calls of one rank, over every rank of the job."""
    longest = 0.0
    for rank in table.ranks:
        lo, hi = table.rank_span(rank)
        if hi - lo > 1:
            gaps = np.diff(table["enqueue_ns"][lo:hi])
            if gaps.min() < 0:  # rows out of time order (several sources of one rank)
                gaps = np.diff(np.sort(table["enqueue_ns"][lo:hi]))
            longest = max(longest, float(gaps.max()))
    return longest


def silent_ranks(table: TraceTable, stall_s: float) -> dict[int, float]:
    """rank -> seconds between its last call and the end of its trace, where that is longer than the
    job's rhythm allows (see the module's docstring)."""
    rhythm = max(stall_s * 1e9, GAP_MULTIPLE * longest_gap_ns(table))
    out = {}
    for rank, info in table.ranks.items():
        lo, hi = table.rank_span(rank)
        if info.finished or info.observed_live or hi == lo:
            continue
        times = np.sort(table["enqueue_ns"][lo:hi])
        usual = float(np.median(np.diff(times))) if hi - lo > 2 else 0.0
        quiet = info.observed_until_ns - int(times[-1])
        if quiet > max(rhythm, USUAL_MULTIPLE * usual):
            out[rank] = quiet / 1e9
    return out


def ended_together(table: TraceTable, silent: dict[int, float]) -> str:
    """A note when every rank with a trace is quiet after the same completed collective call (the same
    instance of one communicator, every member's last call); "" otherwise."""
    if not silent or set(silent) != set(table.ranks):
        return ""
    cols = table.columns
    last = set()
    for rank in table.ranks:
        lo, hi = table.rank_span(rank)
        row = lo + int(np.argmax(cols["enqueue_ns"][lo:hi]))
        if cols["complete_ns"][row] <= 0 or table.comms[int(cols["comm"][row])].p2p:
            return ""
        last.add((int(cols["comm"][row]), int(cols["seq"][row]), int(cols["op"][row])))
    if len(last) != 1:
        return ""
    ((comm, seq, op),) = last
    members = table.comms[comm].members
    return (
        f"every rank's trace ends after the same completed call, {op_name(op)} #{seq} on a communicator of "
        f"{len(members)} ranks, and none made a call in the {min(silent.values()):.0f} s or more after it: "
        "the traces end there (the job finished or paused together; nothing in them waits)"
    )
