"""Honest ambiguity: hung-rank candidates the evidence cannot tell apart are reported tied, not ranked.

In Flight Recorder dumps that record no pipeline send or receive (gloo's keep none), a hung rank and
the pipeline neighbours waiting for it in a transfer look the same: each wrote its dump when asked
(alive) and none issued the collective its data-parallel peers wait in. Naming one of them with a
confidence would be a guess. When there are two to `MAX_TIED` such candidates, and no rank that left
no dump (a stopped or dead process, named confidently before them), they are marked `tied` with the
reason; with more, no rank is named (the job reads inconclusive, with the reason in a note). A single
such candidate is tied with the ranks that wait in no recorded call (`idle_ranks`), and several ranks
that wrote no dump with the candidates (`absent_dumpers`).
"""

from __future__ import annotations

MAX_TIED = 3
REASON = (
    "each of these ranks wrote its dump when asked (it was alive) and none issued the collective its "
    "peers wait in; these Flight Recorder dumps record no pipeline send or receive, so which one "
    "stopped and which wait for it in a transfer cannot be told"
)


def unseen_transfers(table) -> bool:
    """Every trace is a Flight Recorder dump and none records a pipeline transfer."""
    infos = table.ranks.values()
    return (
        bool(infos) and all(i.fmt == "flight-recorder" for i in infos) and not any(c.p2p for c in table.comms)
    )


def absent_dumpers(table, suspects: list) -> list[int]:
    """Ranks below the world size that wrote no dump while the others did, where ranks that answered
    are suspected and no rank that left no dump is named yet: a live process writes its dump when
    asked, so one that wrote none stopped or died (a process frozen inside a call writes none). Alone,
    it is named first; several are tied with the ranks that answered (ranks waiting in a transfer can
    miss the request too: in a PP 2 × FSDP 2 hang both ranks of the stage after the hung one wrote
    none). At most `MAX_TIED`; none when the world size is not known to hold them."""
    if not suspects or not unseen_transfers(table) or any(s.cause == "no_log" for s in suspects):
        return []
    absent = sorted(set(range(table.world_size)) - set(table.ranks))
    return absent if len(absent) <= MAX_TIED else []


def idle_ranks(table, suspects: list, blocked) -> list[int]:
    """Ranks that wrote their dump, have no call open and are no suspect, in transfer-less dumps where
    one rank that answered never issued a collective its peers wait in: in a pure data-parallel job
    every rank but the hung one waits in a collective, so a rank waiting in none is stopped in compute
    or waits in a send or receive the dumps do not record, and is as likely the hung rank as that one
    (a PP 2 × FSDP 2 hang: the hung stage-0 rank had every call complete, and the one rank its DP
    peer's partner waited for was its pipeline neighbour, named with confidence 0.99). Where two or
    three such ranks are tied already, the idle ranks are not added (they would make the set too
    large to name any)."""
    alive = [s for s in suspects if s.cause == "rank_missing"]
    if not unseen_transfers(table) or len(alive) != 1 or any(s.cause == "no_log" for s in suspects):
        return []
    named = {s.rank for s in suspects}
    return sorted(r for r in table.ranks if r not in blocked and r not in named)


def idle_evidence(rank: int) -> str:
    """What says a rank with no call open may be the hung one."""
    return (
        f"rank {rank} wrote its dump with no call open and issued nothing its peers wait in: it may be "
        "stopped in compute, or wait in a send or receive these dumps do not record."
    )


def absent_evidence(rank: int, suspects: list, absent: list[int]) -> str:
    """What says a rank that wrote no dump (one of `absent`) may be the hung one."""
    answered = ", ".join(str(s.rank) for s in suspects if s.cause == "rank_missing")
    others = "every other rank did"
    if len(absent) > 1:
        others = "the ranks but " + ", ".join(map(str, absent)) + " did"
    return (
        f"rank {rank} wrote no dump when {others}: it stopped or died (a process frozen inside a call "
        f"writes none), or missed the request waiting in a transfer; ranks {answered} never issued the "
        "collective their peers wait in, and may wait for it in a transfer these dumps do not record."
    )


def mark_ties(table, suspects: list, silent: list | None = None) -> tuple[list, str]:
    """(`suspects` with tied candidates marked and first, a note) — or, with more candidates than
    `MAX_TIED`, (no suspect, the note saying why none is named). Unchanged where nothing is tied.
    `silent`: suspects for several ranks that wrote no dump, tied with those that answered."""
    silent = silent or []
    if not unseen_transfers(table) or any(s.cause == "no_log" for s in suspects):
        return suspects, ""
    alive = [s for s in suspects if s.cause == "rank_missing"]
    candidates = alive + silent
    if len(candidates) < 2:
        return suspects, ""
    ranks = ", ".join(str(s.rank) for s in candidates)
    why = REASON
    if silent:
        quiet = [s for s in silent if s.cause == "rank_missing"]
        gone = [s for s in silent if s.cause == "no_log"]
        why = (
            f"rank(s) {', '.join(str(s.rank) for s in alive)} wrote their dump when asked (alive) and never "
            "issued the collective their peers wait in"
            + (f"; rank(s) {', '.join(str(s.rank) for s in quiet)} have no call open" if quiet else "")
            + (
                f"; rank(s) {', '.join(str(s.rank) for s in gone)} wrote none (stopped, died, or missed "
                "the request waiting in a transfer)"
                if gone
                else ""
            )
            + "; these Flight Recorder dumps record no pipeline send or receive, so which one stopped "
            "and which wait for it cannot be told"
        )
    if len(candidates) > MAX_TIED:
        return [s for s in suspects if s.cause != "rank_missing"], (
            f"ranks {ranks} never issued the collective their peers wait in or wrote no dump, and {why}: "
            f"with {len(candidates)} such ranks none is named"
        )
    for s in candidates:
        s.tied = True
        s.confidence = round(1.0 / len(candidates), 2)
    return candidates + [s for s in suspects if not s.tied], f"ranks {ranks} are tied: {why}"
