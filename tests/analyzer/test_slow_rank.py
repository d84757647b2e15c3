"""Slow-rank localization on the arrival pattern a real gloo job shows (`tracer/example_train.py`)."""

from __future__ import annotations

import re

import numpy as np

from megatrace.analyzer.slow import detect_slow
from megatrace.analyzer.table import RankCalls, RankInfo, TableBuilder, TraceTable, empty_columns
from megatrace.tracer.format import OP_CODES

STEP_NS = 250_000_000
# Per communicator: calls per step and each member's mean arrival offset (ms) from the instance's
# median, as measured on a 4-rank job (TP 2) whose rank 0 ran 100% slower. Rank 0 is late in every
# communicator it is in, but in (0, 1), which it enters right after another collective, only by
# 1.9% of that communicator's call interval; rank 2 is late in the world communicator because it
# waited for rank 0 in (0, 2) just before.
COMMS: dict[tuple[int, ...], tuple[int, dict[int, float]]] = {
    (0, 2): (3, {0: 8.6, 2: -8.6}),
    (0, 1): (1, {0: 4.2, 1: -4.2}),
    (0, 1, 2, 3): (1, {0: 51.2, 1: -32.7, 2: 31.4, 3: -32.3}),
    (1, 3): (3, {1: 0.2, 3: -0.2}),
    (2, 3): (1, {2: 0.4, 3: -0.4}),
}


Offsets = dict[int, float] | list[dict[int, float]]  # one dict for every call, or one per call of a step


def _table(steps: int, seed: int, layout: dict[tuple[int, ...], tuple[int, Offsets]] = COMMS) -> TraceTable:
    rng = np.random.default_rng(seed)
    builder = TableBuilder()
    rows: dict[int, list[tuple[int, int, int, int]]] = {r: [] for r in range(4)}
    for index, (members, (per_step, offsets)) in enumerate(layout.items()):
        for seq in range(steps * per_step):
            start = seq * STEP_NS // per_step + index * 1_000_000
            now = offsets if isinstance(offsets, dict) else offsets[seq % per_step]
            arrivals = {m: start + int((now.get(m, 0.0) + rng.normal(0, 1.0)) * 1e6) for m in members}
            done = max(arrivals.values()) + 100_000
            for m in members:
                rows[m].append((index, seq, arrivals[m], done))
    for rank, calls in rows.items():
        cols = empty_columns(len(calls))
        cols["rank"][:] = rank
        cols["comm"][:] = [c for c, _s, _e, _d in calls]
        cols["seq"][:] = [s for _c, s, _e, _d in calls]
        cols["enqueue_ns"][:] = [e for _c, _s, e, _d in calls]
        cols["complete_ns"][:] = [d for _c, _s, _e, d in calls]
        cols["op"][:] = OP_CODES["all_reduce"]
        comms = [(members, members, False) for members in layout]
        info = RankInfo(rank, host="node-a", source="synthetic", fmt="ring", has_completion=True)
        builder.add(RankCalls(rank, cols, comms, info), f"rank-{rank}")
    return builder.build()


def test_a_straggler_only_slightly_late_where_it_calls_back_to_back_is_still_named() -> None:
    for seed in range(3):
        suspects = detect_slow(_table(steps=200, seed=seed)).suspects
        assert [s.rank for s in suspects] == [0]
        assert suspects[0].confidence >= 0.9
        assert "of every same-host communicator it is in" in suspects[0].evidence


def test_a_victim_that_waits_somewhere_is_not_named() -> None:
    table = _table(steps=200, seed=7)
    suspects = detect_slow(table).suspects
    assert 2 not in [s.rank for s in suspects]  # late in the world communicator, early in (0, 2)


# A 4-rank job (TP 2 × DP 2) whose rank 1 waits for its data loader before each microbatch: it is late,
# by a third of the interval, only in the first of the four TP all-reduces of a microbatch, so its
# median lateness there is nil. Its TP peer 0 waits for it there and is late in its own DP group after.
QUARTER_LATE = 20.0  # ms, of a 62.5 ms interval


def _loader(per_microbatch: int, late_ms: float) -> dict[tuple[int, ...], tuple[int, Offsets]]:
    """TP 2 × DP 2 whose rank 1 is `late_ms` late at the first of its `per_microbatch` TP all-reduces."""
    first: list[dict[int, float]] = [{1: late_ms, 0: -late_ms}] + [{} for _ in range(per_microbatch - 1)]
    return {
        (0, 1): (per_microbatch, first),
        (2, 3): (per_microbatch, {}),
        (0, 2): (1, {0: 6.0, 2: -6.0}),
        (1, 3): (1, {1: 6.0, 3: -6.0}),
        (0, 1, 2, 3): (1, {}),
    }


LOADER = _loader(4, QUARTER_LATE)


def test_a_rank_late_in_a_quarter_of_its_collectives_by_a_wide_margin_is_named_and_its_peer_is_not() -> None:
    for seed in range(3):
        suspects = detect_slow(_table(steps=100, seed=seed, layout=LOADER)).suspects
        assert [s.rank for s in suspects] == [1]
        shown = r"more of \d+ collectives than it arrived as early, [\d.]+% of the interval late on average"
        assert re.search(shown, suspects[0].evidence)


# A rank a little behind in its TP group (1.6 % of the interval, most of the time) and only as often
# ahead as behind elsewhere: as schedules make it in healthy jobs. Being seldom far from the median
# elsewhere clears a rank only where it was clearly late (by a wide margin, often).
SLIGHTLY_BEHIND: dict[tuple[int, ...], tuple[int, Offsets]] = {
    (0, 1): (4, {}),
    (2, 3): (4, {2: 1.0, 3: -1.0}),
    (0, 2): (1, {2: 0.3, 0: -0.3}),
    (1, 3): (1, {}),
    (0, 1, 2, 3): (1, {}),
}


def test_a_rank_slightly_behind_in_one_group_and_even_elsewhere_is_not_named() -> None:
    for seed in range(3):
        assert detect_slow(_table(steps=100, seed=seed, layout=SLIGHTLY_BEHIND)).suspects == []


# The same loader, where the TP peer's wait makes it late by a wide margin in its own DP group: the
# peer is clearly late there, but it waits for the loader in their TP group, so the world
# communicator (where the loader rank is neither late nor early) does not clear the peer and the
# loader together as ranks late for one shared cause.
LOADER_PEER_LATE: dict[tuple[int, ...], tuple[int, Offsets]] = {
    **LOADER,
    (0, 2): (1, {0: QUARTER_LATE, 2: -QUARTER_LATE}),
}


def test_a_loader_is_named_when_its_waiting_peer_is_clearly_late_elsewhere() -> None:
    for seed in range(3):
        suspects = detect_slow(_table(steps=100, seed=seed, layout=LOADER_PEER_LATE)).suspects
        assert [s.rank for s in suspects] == [1]


# A loader that holds up one TP all-reduce in eight (a microbatch with more layers): late by a wide
# margin in only 12 % more instances than early, too few to call it clearly late by that share alone,
# but its peer waits for it about 6 % of the call interval on average (its trimmed mean), which no
# healthy member does. Held up half as long (10 ms), its peer waits about 3 % on average: under the
# slow test's 5 % floor, where bursts of load leave healthy ranks (see `significance.MIN_EFFECT`).
EIGHTH_LATE = 20.0  # ms, of a 31.25 ms interval
LOADER_EVERY_EIGHTH = _loader(8, EIGHTH_LATE)


def test_a_loader_late_in_few_collectives_is_named_by_how_long_its_peer_waits_for_it() -> None:
    for seed in range(3):
        suspects = detect_slow(_table(steps=100, seed=seed, layout=LOADER_EVERY_EIGHTH)).suspects
        assert [s.rank for s in suspects] == [1]
        assert re.search(r"\b[5-8]\.\d% of the interval late on average", suspects[0].evidence)


def test_a_loader_holding_up_a_few_percent_of_the_interval_is_left_within_the_noise() -> None:
    result = detect_slow(_table(steps=100, seed=0, layout=_loader(8, EIGHTH_LATE / 2)))
    assert result.suspects == []
    assert any(note.startswith("rank 1 arrived late on average") for note in result.notes), result.notes
