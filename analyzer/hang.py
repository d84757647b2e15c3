"""Hang localization: which rank(s) everybody else is waiting for, told apart from their victims.

Per communicator, each member's last sequence number shows how far it got. A rank is *blocked* at
the oldest call that never completed (logs with completion times, once it has been stuck for
``stall_s``) or, for enqueue-only logs, at the first call of a communicator that some member never
issued, provided that call is among its last few records. A blocked rank waits for the members that
never issued its call. Ranks waited on that are not blocked themselves (busy in compute, or dead)
are the culprits; blocked ranks are victims. A call every member issued and none completed means
the communication itself is stuck. Ranks waiting on each other in a cycle are a deadlock.

Flight Recorder dumps are written on request by every live process (the launcher's or the watchdog's
call): a rank waited on that wrote none stopped or died, and one that wrote its dump was alive. Where
such a dump records no pipeline send or receive (gloo's keeps none), a rank that answered but never
issued the call its peers wait in may itself wait in a transfer the dumps do not show, so the rank
that left no dump is named first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatrace.analyzer import quiet, stopped_first, ties
from megatrace.analyzer.table import TraceTable
from megatrace.tracer.format import OP_CODES, OP_OTHER, op_name

ASYNC_WINDOW = 16  # records a rank may enqueue past a call it is stuck in (NCCL calls are asynchronous)


@dataclass
class HangSuspect:
    rank: int
    confidence: float
    evidence: str
    cause: str  # "rank_missing" | "communication_stuck" | "deadlock" | "no_log"
    waited_by: list[int] = field(default_factory=list)
    group: tuple[int, ...] = ()  # the communicator's members, for a stuck communication
    # enqueue-only logs that end with the suspect one call behind, right where every log ends: a hang
    # there cannot be told from logs cut at that moment; it yields to a slow rank found in the same logs
    tentative: bool = False
    tied: bool = False  # the evidence cannot tell it from the other tied suspects (`ties`)


@dataclass
class HangResult:
    suspects: list[HangSuspect]
    victims: list[int]
    blocked_at: dict[int, tuple[int, int]]  # rank -> (comm, seq)
    notes: list[str]
    # ranks that made no call for a long while before their traces end (longer than the stall threshold
    # and the job's rhythm, `quiet`), though none is open: they wait somewhere the traces do not show
    silent: dict[int, float] = field(default_factory=dict)
    tie: str = ""  # why tied suspects could not be told apart (`ties`)


def last_seq_per_member(table: TraceTable) -> dict[tuple[int, int], int]:
    """(comm, rank) -> highest sequence number that rank issued in that communicator."""
    if not len(table):
        return {}
    world = max(table.world_size, int(table["rank"].max()) + 1, 1)
    key = table["comm"].astype(np.int64) * world + table["rank"]
    cells = len(table.comms) * world
    if cells <= 64 * len(table) + (1 << 20):  # a dense cell per (comm, rank): no sort of the rows
        best = np.full(cells, np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(best, key, table["seq"])
        uniq = np.flatnonzero(best != np.iinfo(np.int64).min)
        values = best[uniq]
    else:
        uniq, inverse = np.unique(key, return_inverse=True)
        values = np.full(len(uniq), np.iinfo(np.int64).min, dtype=np.int64)
        np.maximum.at(values, inverse.reshape(-1), table["seq"])
    return {
        (int(k // world), int(k % world)): int(v) for k, v in zip(uniq.tolist(), values.tolist(), strict=True)
    }


def _label(table: TraceTable, comm: int) -> str:
    c = table.comms[comm]
    members = list(c.members)
    shown = ",".join(map(str, members[:8])) + (",…" if len(members) > 8 else "")
    if c.p2p:
        return f"P2P channel {members[0]}<->{members[-1]}"
    return f"communicator [{shown}] ({len(members)} ranks)"


def _usable(table: TraceTable, comm: int) -> bool:
    c = table.comms[comm]
    return len(c.members) >= 2 and (not c.p2p or len(c.members) == 2)


def _delivered_sends(table: TraceTable) -> np.ndarray:
    """Rows of sends whose receive completed on the peer: the data arrived, so the sender waits in no
    such send (a program that never waits for its sends, as an interleaved pipeline may not, leaves
    them open in its trace)."""
    cols = table.columns
    send, recv = cols["op"] == OP_CODES["send"], cols["op"] == OP_CODES["recv"]
    if not send.any():
        return np.zeros(len(table), dtype=bool)
    key = cols["comm"].astype(np.int64) << 32 | (cols["seq"] & 0xFFFFFFFF)
    received = key[recv & (cols["complete_ns"] > 0)]
    return send & np.isin(key, received)


def detect_hang(table: TraceTable, stall_s: float = 1.0) -> HangResult:
    """Who the blocked ranks wait for: phases `_blocked_in_open_calls` and `_blocked_at_frontiers` find
    where each rank is blocked, `_waits_for` whom it waits for, `_culprit_suspects` and
    `_stuck_communication_suspects` name the culprits, `_ordered` ranks them."""
    members_last: dict[int, dict[int, int]] = {}
    for (comm, rank), seq in last_seq_per_member(table).items():
        members_last.setdefault(comm, {})[rank] = seq
    notes: list[str] = []
    blocked, pending_age = _blocked_in_open_calls(table, stall_s)
    blocked.update(_blocked_at_frontiers(table, members_last, notes))
    waits, stuck_comms = _waits_for(table, blocked, members_last)
    suspects = _culprit_suspects(table, waits, blocked, pending_age, members_last)
    suspects += _stuck_communication_suspects(table, stuck_comms, pending_age, stall_s)
    suspects, tie = _ordered(table, suspects, waits, blocked)
    named = {s.rank for s in suspects}
    victims = sorted(r for r in blocked if r not in named)
    return HangResult(suspects, victims, blocked, notes, _silent_ranks(table, stall_s), tie)


def _blocked_in_open_calls(
    table: TraceTable, stall_s: float
) -> tuple[dict[int, tuple[int, int]], dict[int, float]]:
    """Ranks whose logs have completion times, blocked at their oldest call still open after `stall_s`:
    rank -> (comm, seq), and rank -> how long that call has been open (s)."""
    blocked: dict[int, tuple[int, int]] = {}
    pending_age: dict[int, float] = {}
    if not len(table):
        return blocked, pending_age
    cols = table.columns
    has_comp = np.zeros(max(table.world_size, 1), dtype=bool)
    for rank, info in table.ranks.items():
        has_comp[rank] = info.has_completion and not info.finished
    # a call still open in a rank's last snapshot was open until the job was last seen at all: a rank
    # that froze or died with it leaves no later sign of its own
    job_end = max((info.observed_until_ns for info in table.ranks.values()), default=0)
    pending = (cols["complete_ns"] == 0) & has_comp[cols["rank"]]
    pending &= ~_delivered_sends(table)
    rows = np.flatnonzero(pending)
    order = rows[np.lexsort((cols["enqueue_ns"][rows], cols["rank"][rows]))]
    first = np.ones(len(order), dtype=bool)
    first[1:] = cols["rank"][order][1:] != cols["rank"][order][:-1]
    for row in order[first].tolist():
        rank = int(cols["rank"][row])
        comm = int(cols["comm"][row])
        age = (job_end - int(cols["enqueue_ns"][row])) / 1e9
        if age >= stall_s and _usable(table, comm):
            blocked[rank] = (comm, int(cols["seq"][row]))
            pending_age[rank] = age
    return blocked, pending_age


def _blocked_at_frontiers(
    table: TraceTable, members_last: dict[int, dict[int, int]], notes: list[str]
) -> dict[int, tuple[int, int]]:
    """Enqueue-only ranks: blocked at the first call of a communicator some member never issued, if that
    call is among their last `ASYNC_WINDOW` records (else a note says the logs end at different times)."""
    ranks_present = set(table.ranks)
    frontier_block: dict[int, list[tuple[int, int]]] = {}
    for comm, seen in members_last.items():
        members = table.comms[comm].members
        if _unmatched_channel(table, comm):
            # a send/recv no peer ever logged: its rank waits in the first one (the peer is unknown)
            (m,) = members
            if m in ranks_present and not table.ranks[m].has_completion:
                frontier_block.setdefault(m, []).append((comm, _first_seq(table, m, comm)))
            continue
        if not _usable(table, comm):
            continue
        lasts = [seen.get(m, -1) for m in members]
        stuck = min(lasts) + 1
        if stuck > max(lasts):
            continue
        for m, value in zip(members, lasts, strict=True):
            if value >= stuck and m in ranks_present and not table.ranks[m].has_completion:
                frontier_block.setdefault(m, []).append((comm, stuck))
    blocked: dict[int, tuple[int, int]] = {}
    for rank, frontiers in frontier_block.items():
        comm, seq = _frontier(table, rank, frontiers)
        tail = _records_after(table, rank, _first_time(table, rank, comm, seq))
        if tail <= ASYNC_WINDOW:
            blocked[rank] = (comm, seq)
        else:
            notes.append(
                f"rank {rank} went {tail} calls past {op_name(_op_at(table, rank, comm, seq))} #{seq} on "
                f"{_label(table, comm)} that some members never logged: their logs end earlier "
                "(saved at different times), not a hang"
            )
    return blocked


def _waits_for(
    table: TraceTable, blocked: dict[int, tuple[int, int]], members_last: dict[int, dict[int, int]]
) -> tuple[dict[int, set[int]], dict[tuple[int, int], list[int]]]:
    """The waits-for graph (blocked rank -> the members that never issued its call), and the calls every
    member issued that still block some of them ((comm, seq) -> those ranks)."""
    waits: dict[int, set[int]] = {}
    stuck_comms: dict[tuple[int, int], list[int]] = {}
    for rank, (comm, seq) in blocked.items():
        members = table.comms[comm].members
        missing = {m for m in members if members_last.get(comm, {}).get(m, -1) < seq}
        if missing:
            waits[rank] = missing
        elif not _unmatched_channel(table, comm):
            stuck_comms.setdefault((comm, seq), []).append(rank)
    return waits, stuck_comms


def _culprit_suspects(
    table: TraceTable,
    waits: dict[int, set[int]],
    blocked: dict[int, tuple[int, int]],
    pending_age: dict[int, float],
    members_last: dict[int, dict[int, int]],
) -> list[HangSuspect]:
    """The ranks waited on that are not blocked themselves, most waiters first."""
    culprits: dict[int, list[int]] = {}
    for rank, targets in waits.items():
        for target in targets:
            if target not in blocked:
                culprits.setdefault(target, []).append(rank)
    entered_last = _all_entered_last(table, culprits)
    suspects = []
    for target, waiters in sorted(culprits.items(), key=lambda item: (-len(item[1]), item[0])):
        if target in entered_last:
            suspects.append(_entered_together_suspect(table, target, waiters, *entered_last[target]))
        else:
            suspects.append(_missing_rank_suspect(table, target, waiters, blocked, pending_age, members_last))
    return suspects


def _entered_together_suspect(
    table: TraceTable, target: int, waiters: list[int], comm: int, seq: int
) -> HangSuspect:
    """A rank waited on whose communicator's members all entered its last call (enqueue-only logs)."""
    members = table.comms[comm].members
    return HangSuspect(
        target,
        round(0.5 + 0.3 / len(members), 2),
        f"all {len(members)} members of {_label(table, comm)} entered "
        f"{op_name(_op_at(table, target, comm, seq))} #{seq} as their last logged call and none "
        f"logged anything after it while {len(waiters)} peer(s) wait on rank {target}: the "
        "communication "
        "itself is likely stuck (these logs have no completion times to confirm it).",
        "communication_stuck",
        sorted(waiters),
        members,
    )


def _missing_rank_suspect(
    table: TraceTable,
    target: int,
    waiters: list[int],
    blocked: dict[int, tuple[int, int]],
    pending_age: dict[int, float],
    members_last: dict[int, dict[int, int]],
) -> HangSuspect:
    """A rank waited on that never issued the call its peers wait in, or left no log."""
    comm, seq = blocked[waiters[0]]
    op = op_name(_op_at(table, waiters[0], comm, seq))
    age = max((pending_age.get(w, 0.0) for w in waiters), default=0.0)
    waited = f" for {age:.1f} s" if age else ""
    tentative = False
    if target not in table.ranks:
        cause, what = "no_log", f"rank {target} left no trace log"
    else:
        cause, what = "rank_missing", f"rank {target} never issued {op} #{seq} on {_label(table, comm)}"
        tentative = _cut_at_the_end(table, target, waiters, comm, seq, members_last)
    return HangSuspect(
        target,
        round(
            min(
                0.99,
                0.75 + 0.25 * min(1.0, len(waiters) / max(1, len(table.comms[comm].members) - 1)),
            ),
            2,
        )
        if cause == "rank_missing"
        else 0.7,
        f"{what}; {len(waiters)} peer(s) have waited in it{waited} (first: rank {min(waiters)})."
        + (
            " It is one call behind exactly where every log ends, so logs cut at that moment "
            "would look the same."
            if tentative
            else ""
        ),
        cause,
        sorted(waiters),
        tentative=tentative,
    )


def _stuck_communication_suspects(
    table: TraceTable,
    stuck_comms: dict[tuple[int, int], list[int]],
    pending_age: dict[int, float],
    stall_s: float,
) -> list[HangSuspect]:
    """Calls every member entered and none completed: the communication is stuck, unless one member's
    tracer fell silent first (that process stopped inside the call)."""
    suspects = []
    for (comm, seq), ranks in stuck_comms.items():
        members = table.comms[comm].members
        if not set(ranks) >= set(members):
            continue
        op = op_name(_op_at(table, ranks[0], comm, seq))
        age = max(pending_age.get(r, 0.0) for r in ranks)
        silent = _fell_silent(table, members, stall_s)
        for m in sorted(members, key=lambda m: (m not in silent, m)):
            what = (
                f"rank {m}'s tracer fell silent {silent[m]:.1f} s before its peers' while all "
                f"{len(members)} members of {_label(table, comm)} sat in {op} #{seq}: the process "
                "stopped inside the call (frozen, or stuck in a kernel or driver)."
                if m in silent
                else f"all {len(members)} members of {_label(table, comm)} entered {op} #{seq} and "
                f"none completed it in {age:.1f} s: the communication itself is stuck "
                "(network/NCCL), no rank is missing."
            )
            confidence = 0.8 if m in silent else 0.5 + 0.4 / len(members) - (0.2 if silent else 0.0)
            suspects.append(HangSuspect(m, round(confidence, 2), what, "communication_stuck", group=members))
    return suspects


def _ordered(
    table: TraceTable,
    suspects: list[HangSuspect],
    waits: dict[int, set[int]],
    blocked: dict[int, tuple[int, int]],
) -> tuple[list[HangSuspect], str]:
    """The suspects most likely first: a deadlock when no one else explains the waits, the rank that
    stopped first ahead, ranks that wrote no dump ahead, ties marked (and why)."""
    if not suspects and waits:
        suspects = _deadlock(table, waits, blocked)
    suspects = stopped_first.order(table, suspects)
    absent = ties.absent_dumpers(table, suspects)
    found = [HangSuspect(r, 0.8, ties.absent_evidence(r, suspects, absent), "no_log") for r in absent]
    if len(found) == 1:
        suspects = found + suspects
        found = []
    idle = ties.idle_ranks(table, suspects, blocked)
    found += [HangSuspect(r, 0.5, ties.idle_evidence(r), "rank_missing") for r in idle]
    _answered_the_dump(table, suspects)
    return ties.mark_ties(table, suspects, found)


def _answered_the_dump(table: TraceTable, suspects: list[HangSuspect]) -> None:
    """In Flight Recorder dumps with no pipeline transfer, rank a waited-on rank that wrote no dump
    above the ones that wrote theirs and never issued the call (see the module's docstring)."""
    dumps = table.ranks and all(info.fmt == "flight-recorder" for info in table.ranks.values())
    silent = [s for s in suspects if s.cause == "no_log"]
    if not dumps or not silent or any(c.p2p for c in table.comms):
        return
    for s in silent:
        s.confidence = 0.9
        s.evidence += " Every other rank wrote its dump when asked: this one stopped or died."
    for s in suspects:
        if s.cause == "rank_missing":
            s.confidence = min(s.confidence, 0.6)
            s.evidence += (
                " It wrote its dump, so it was alive: it may wait in a send or receive these dumps do "
                "not record."
            )
    suspects.sort(key=lambda s: -s.confidence)


def _silent_ranks(table: TraceTable, stall_s: float) -> dict[int, float]:
    """rank -> seconds between its last call and the end of its trace, where that is far too long for
    the job's own rhythm (`megatrace.analyzer.quiet`)."""
    return quiet.silent_ranks(table, stall_s)


def _fell_silent(table: TraceTable, members: tuple[int, ...], stall_s: float) -> dict[int, float]:
    """Members whose last sign of life (record, header update or stall dump) came more than the stall
    threshold (at least 1 s) before the others': rank -> how much earlier, in seconds. A rank blocked in a
    call keeps its tracer's watchdog running (it writes a stall dump); a frozen process writes nothing."""
    seen = {m: table.ranks[m].observed_until_ns for m in members if m in table.ranks}
    if len(seen) < 2:
        return {}
    latest = float(np.median(list(seen.values())))
    margin = max(stall_s, 1.0) * 1e9
    return {m: (latest - t) / 1e9 for m, t in seen.items() if latest - t > margin}


def _cut_at_the_end(
    table: TraceTable, target: int, waiters: list[int], comm: int, seq: int, members_last: dict
) -> bool:
    """Enqueue-only logs where `target` is exactly one call behind on `comm`, every waiter logged that
    call as its very last record, and `target` fell silent no more than a few of its usual gaps before
    the waiters entered it: nothing shows that anybody waited."""
    info = table.ranks.get(target)
    if info is None or info.has_completion or members_last.get(comm, {}).get(target, -1) != seq - 1:
        return False
    lo, hi = table.rank_span(target)
    times = np.sort(table["enqueue_ns"][lo:hi])
    if len(times) < 3:
        return False
    gap = float(np.median(np.diff(times))) or 1.0
    entered = 0
    for w in waiters:
        wlo, whi = table.rank_span(w)
        row = _find(table, w, comm, seq)
        if row < 0 or int(table["enqueue_ns"][row]) != int(table["enqueue_ns"][wlo:whi].max()):
            return False
        entered = max(entered, int(table["enqueue_ns"][row]))
    return entered - int(times[-1]) <= 3 * gap


def _deadlock(table: TraceTable, waits: dict[int, set[int]], blocked: dict) -> list[HangSuspect]:
    """Ranks in a waits-for cycle: every rank waited on is itself blocked."""
    in_cycle = set()
    for start in waits:
        seen: list[int] = []
        node = start
        while node in waits and node not in seen:
            seen.append(node)
            node = min(waits[node])
        if node in seen:
            in_cycle.update(seen[seen.index(node) :])
    out = []
    for rank in sorted(in_cycle):
        comm, seq = blocked[rank]
        out.append(
            HangSuspect(
                rank,
                0.6,
                f"rank {rank} is blocked in {op_name(_op_at(table, rank, comm, seq))} #{seq} on "
                f"{_label(table, comm)} waiting for rank(s) {sorted(waits[rank])}, which wait on it in turn: "
                "a deadlock (calls issued in a different order).",
                "deadlock",
            )
        )
    return out


def _all_entered_last(table: TraceTable, culprits: dict[int, list[int]]) -> dict[int, tuple[int, int]]:
    """Culprits with enqueue-only logs whose last call is one collective instance that every member of
    its communicator logged as its last call too: (comm, seq) per such culprit."""
    last: dict[int, tuple[int, int]] = {}
    for rank in culprits:
        info = table.ranks.get(rank)
        lo, hi = table.rank_span(rank)
        if info is None or info.has_completion or hi == lo:
            continue
        row = lo + int(np.argmax(table["enqueue_ns"][lo:hi]))
        last[rank] = (int(table["comm"][row]), int(table["seq"][row]))
    out = {}
    for rank, (comm, seq) in last.items():
        members = table.comms[comm].members
        if _usable(table, comm) and all(last.get(m) == (comm, seq) for m in members):
            out[rank] = (comm, seq)
    return out


def _frontier(table: TraceTable, rank: int, frontiers: list[tuple[int, int]]) -> tuple[int, int]:
    """Of the calls some peer never issued, the one `rank` is blocked at: the earliest among its last
    `ASYNC_WINDOW` records, else the earliest of all (an old one: the logs were saved at different
    times). An inferred pipeline channel whose peer ended early must not hide a collective it waits in."""
    frontiers = sorted(frontiers, key=lambda f: _first_time(table, rank, *f))
    recent = [
        f for f in frontiers if _records_after(table, rank, _first_time(table, rank, *f)) <= ASYNC_WINDOW
    ]
    return (recent or frontiers)[0]


def _unmatched_channel(table: TraceTable, comm: int) -> bool:
    c = table.comms[comm]
    return c.p2p and len(c.members) == 1


def _first_seq(table: TraceTable, rank: int, comm: int) -> int:
    lo, hi = table.rank_span(rank)
    return int(table["seq"][lo:hi][table["comm"][lo:hi] == comm].min())


def _find(table: TraceTable, rank: int, comm: int, seq: int) -> int:
    lo, hi = table.rank_span(rank)
    hit = np.flatnonzero((table["comm"][lo:hi] == comm) & (table["seq"][lo:hi] == seq))
    return lo + int(hit[0]) if len(hit) else -1


def _first_time(table: TraceTable, rank: int, comm: int, seq: int) -> int:
    row = _find(table, rank, comm, seq)
    return int(table["enqueue_ns"][row]) if row >= 0 else np.iinfo(np.int64).max


def _op_at(table: TraceTable, rank: int, comm: int, seq: int) -> int:
    row = _find(table, rank, comm, seq)
    return int(table["op"][row]) if row >= 0 else OP_OTHER


def _records_after(table: TraceTable, rank: int, t_ns: int) -> int:
    lo, hi = table.rank_span(rank)
    return int((table["enqueue_ns"][lo:hi] > t_ns).sum())
