"""A hang behind sends the program never waited for (an interleaved pipeline waits for its sends only at
the end of a step): a send whose receive completed on the peer is not where its rank is stuck."""

from __future__ import annotations

from megatrace.analyzer.hang import detect_hang
from megatrace.analyzer.table import RankCalls, RankInfo, TableBuilder, TraceTable, empty_columns
from megatrace.tracer.format import OP_CODES

MS = 1_000_000
CHANNEL = ("p2p", 7, 0, 1)
GROUP = ("comm", 9)


def _table(delivered: bool) -> TraceTable:
    """Rank 0 sends to rank 1 without waiting, both finish all-reduce 0, rank 1 waits in all-reduce 1,
    which rank 0 never issues (stuck in compute)."""
    calls = {
        0: [("send", CHANNEL, 0, 10 * MS, 0), ("all_reduce", GROUP, 0, 20 * MS, 21 * MS)],
        1: [
            ("recv", CHANNEL, 0, 5 * MS, 11 * MS if delivered else 0),
            ("all_reduce", GROUP, 0, 19 * MS, 21 * MS),
            ("all_reduce", GROUP, 1, 30 * MS, 0),
        ],
    }
    builder = TableBuilder()
    for rank, rows in calls.items():
        keys = [CHANNEL, GROUP]
        cols = empty_columns(len(rows))
        cols["rank"][:] = rank
        cols["op"][:] = [OP_CODES[op] for op, *_ in rows]
        cols["comm"][:] = [keys.index(key) for _op, key, *_ in rows]
        cols["seq"][:] = [seq for _op, _key, seq, _e, _d in rows]
        cols["enqueue_ns"][:] = [e for *_rest, e, _d in rows]
        cols["complete_ns"][:] = [d for *_rest, d in rows]
        comms = [(CHANNEL, (0, 1), True), (GROUP, (0, 1), False)]
        info = RankInfo(
            rank, source="synthetic", fmt="ring", has_completion=True, observed_until_ns=10_000 * MS
        )
        builder.add(RankCalls(rank, cols, comms, info), f"rank-{rank}")
    return builder.build()


def test_a_send_the_peer_received_is_not_where_its_rank_waits() -> None:
    result = detect_hang(_table(delivered=True))
    assert [s.rank for s in result.suspects] == [0]
    assert "all_reduce #1" in result.suspects[0].evidence


def test_a_send_the_peer_never_received_still_counts_as_open() -> None:
    # the data never arrived: both ends sit in the transfer, which is itself stuck
    result = detect_hang(_table(delivered=False))
    assert {(s.rank, s.cause) for s in result.suspects} == {
        (0, "communication_stuck"),
        (1, "communication_stuck"),
    }
    assert all("send #0" in s.evidence for s in result.suspects)
