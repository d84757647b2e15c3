"""Slow ranks nothing compares with, judged against their own earlier steps.

The lateness detector (`slow.py`) compares a rank with peers doing the same work: its tensor- or
data-parallel group, or the same pipeline transfer of another replica. A single pipeline (one rank a
stage) has none, and its stages differ by design (the first carries the embedding, the last the
loss), so there a stage heavier than the others says nothing. What does say something is a stage
that got slower: a GPU that throttles, a link that degrades, a data loader that falls behind, from
some step on.

A rank's *own time* in a step is the time it spends neither waiting for nor issuing communication:
the sum, over its calls of the step, of the quiet time before each call (since the rank's previous
event, a call issued or a call completed). A call issued after a wait starts the clock at the
wait's end; a call issued while others are still in flight (asynchronous sends, receives posted
ahead) still counts the compute in between. Steps are told apart by the job's step-wide collective
(the communicator with the most members; the loss or gradient-norm all-reduce), and the same calls
are summed in every step (the first step's before its first call is not seen).

A rank whose own time rose by `MIN_RISE` or more from some step on, in most steps after it and few
before, while the other ranks' stayed level, slowed down there. The rise must also stand well clear
of the job's step-to-step noise (`NOISE_SIGMAS` times it): where compute shares a machine with other
work, a stage's own time can swing by tens of percent from step to step, and a run of high steps is
chance. A rank slow from its first step on cannot be told from a stage heavier by design, and is not
named.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import numpy as np

from megatrace.analyzer.table import TraceTable

MIN_RISE = 0.05  # own time up by this much against the rank's earlier steps, beyond the others' change
MIN_AFTER = 4  # steps a slowdown must last
MIN_SHARE = 0.8  # of the steps after the change above the threshold (and of those before, below it)
MIN_OWN_NS = 1_000_000  # a rank with less own time a step than this has too little to measure
MIN_REGULAR = 0.6  # share of steps with the usual number of calls
NOISE_SIGMAS = 5.0  # a rise must exceed the job's step-to-step noise this many times


@dataclass
class Rise:
    """A rank whose own time per step rose from `step` on (an index into the steps seen)."""

    rank: int
    step: int
    before_ns: float
    after_ns: float
    excess: float  # the rise beyond the other ranks' over the same steps
    others: float  # the other ranks' median rise
    steps: int
    noise: float = 0.0  # the job's step-to-step noise at this split, as a share


def step_marker(table: TraceTable, ranks: set[int]) -> int | None:
    """The communicator whose instances end the steps of `ranks`: the collective communicator holding
    them all with the most members (the world's loss or norm all-reduce), the fewest calls breaking
    ties. None when no collective holds them all."""
    calls = np.bincount(table.columns["comm"], minlength=len(table.comms)) if len(table) else None
    best = None
    for i, comm in enumerate(table.comms):
        if comm.p2p or not ranks <= set(comm.members) or calls is None or not calls[i]:
            continue
        key = (-len(comm.members), int(calls[i]))
        if best is None or key < best[0]:
            best = (key, i)
    return None if best is None else best[1]


def own_times(enq: np.ndarray, done: np.ndarray, seq: np.ndarray, ends_step: np.ndarray) -> dict[int, float]:
    """One rank's own time in each step, keyed by the sequence number of the step's marker call.

    `enq`, `done` (0: not completed), `seq` and `ends_step` (the call is the marker) are the rank's rows.
    Steps with another number of calls than usual are left out (a partial last step, an evaluation)."""
    order = np.argsort(enq, kind="stable")
    enq, done, seq, ends_step = enq[order], done[order], seq[order], ends_step[order]
    events = np.sort(np.concatenate([enq, done[done > 0]]))
    before = np.searchsorted(events, enq, "left") - 1
    quiet = np.where(before >= 0, enq - events[np.maximum(before, 0)], 0).astype(np.float64)
    ends = np.flatnonzero(ends_step)
    if len(ends) < 2:
        return {}
    counts = np.diff(np.concatenate([[-1], ends]))
    usual, seen = Counter(counts[1:].tolist()).most_common(1)[0]
    if seen < MIN_REGULAR * (len(ends) - 1) or usual < 2:
        return {}
    span = min(usual, int(counts[0]))  # the first step's calls before its first are not seen
    if span < max(2, usual // 2):
        span, first = usual, 1
    else:
        first = 0
    cum = np.concatenate([[0.0], np.cumsum(quiet)])
    out = {}
    for k in range(first, len(ends)):
        if k and counts[k] != usual:
            continue
        end = int(ends[k])
        # the quiet time before each of the step's last `span` calls but the first of them
        out[int(seq[end])] = float(cum[end + 1] - cum[end - span + 2])
    return out


def timed(table: TraceTable) -> bool:
    """Whether the traces time their calls' completion (most calls complete after they were issued).
    Without it (Megatrace's NCCL logs, torch's gloo dumps) the gap between two calls holds the wait in
    the first: a rank's own time cannot be told from its waits, and is not judged."""
    cols = table.columns
    return bool(len(table)) and float((cols["complete_ns"] > cols["enqueue_ns"]).mean()) >= 0.5


def own_time_matrix(table: TraceTable, ranks: list[int]) -> np.ndarray | None:
    """Own times, ranks × steps, over the steps every rank has (None: too few of them, or no completion
    times to tell own time from waits)."""
    marker = step_marker(table, set(ranks))
    if marker is None or not timed(table):
        return None
    cols = table.columns
    per_rank = []
    for rank in ranks:
        rows = slice(*table.rank_span(rank))
        ends_step = cols["comm"][rows] == marker
        enq, done, seq = cols["enqueue_ns"][rows], cols["complete_ns"][rows], cols["seq"][rows]
        per_rank.append(own_times(enq, done, seq, ends_step))
    steps = sorted(set.intersection(*(set(s) for s in per_rank))) if per_rank else []
    if len(steps) < 1 + MIN_AFTER:
        return None
    return np.array([[s[k] for k in steps] for s in per_rank])


def noise(times: np.ndarray, split: int) -> float:
    """The job's step-to-step noise in own time, as a share: the median over the rows of each row's
    robust spread (scaled median absolute deviation) around its medians before and after `split`."""
    parts = [times[:, :split], times[:, split:]]
    spread = np.concatenate(
        [part / np.maximum(np.median(part, axis=1, keepdims=True), 1.0) - 1.0 for part in parts], axis=1
    )
    return float(np.median(1.4826 * np.median(np.abs(spread), axis=1)))


def rises(times: np.ndarray) -> dict[int, Rise]:
    """Rows of `times` (ranks × steps) whose own time rose from some step on, beyond the other rows'
    change over the same steps; per row the split where the rise is largest."""
    found: dict[int, Rise] = {}
    rows, steps = times.shape
    for split in range(1, steps - MIN_AFTER + 1):
        base = np.median(times[:, :split], axis=1)
        after = np.median(times[:, split:], axis=1)
        rise = after / np.maximum(base, 1.0) - 1.0
        spread = noise(times, split)
        least = max(MIN_RISE, NOISE_SIGMAS * spread)
        for r in range(rows):
            if base[r] < MIN_OWN_NS:
                continue
            others = float(np.median(np.delete(rise, r))) if rows > 1 else 0.0
            excess = (1.0 + rise[r]) / (1.0 + others) - 1.0
            # steps before the split against the rank's own level; steps after against it moved as
            # the others' moved (the job's change happens at the split, not before it)
            line = base[r] * (1.0 + MIN_RISE / 2)
            above, below = (
                (times[r, split:] > line * (1.0 + others)).mean(),
                (times[r, :split] <= line).mean(),
            )
            held = above >= MIN_SHARE and below >= MIN_SHARE
            if excess >= least and held and (r not in found or excess > found[r].excess):
                found[r] = Rise(
                    r, split, float(base[r]), float(after[r]), float(excess), others, steps, spread
                )
    return found


def slowed_down(table: TraceTable, ranks: list[int]) -> list[Rise]:
    """Which of `ranks` slowed down against their own earlier steps; `Rise.rank` is the global rank."""
    if len(ranks) < 2:
        return []
    times = own_time_matrix(table, ranks)
    if times is None:
        return []
    found = rises(times)
    # a change most ranks share is the job's (a new phase, the machine's load), not a rank's
    if len(found) * 2 > len(ranks):
        return []
    return [dataclasses.replace(rise, rank=ranks[r]) for r, rise in sorted(found.items())]
