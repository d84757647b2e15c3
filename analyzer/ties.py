"""Honest ambiguity: hung-rank candidates the evidence cannot tell apart are reported tied, not ranked.

In Flight Recorder dumps that record no pipeline send or receive (gloo's keep none), a hung rank and
the pipeline neighbours waiting for it in a transfer look the same: each wrote its dump when asked
(alive) and none issued the collective its data-parallel peers wait in. Naming one of them with a
confidence would be a guess. When there are two to `MAX_TIED` such candidates, and no rank that left
no dump (a stopped or dead process, named confidently before them), they are marked `tied` with the
reason; with more, no rank is named (the job reads inconclusive, with the reason in a note).
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
    """Ranks below the world size that wrote no dump while every other rank did, where ranks that
    answered are suspected and no rank that left no dump is named yet: a live process writes its dump
    when asked, so these stopped or died (a process frozen inside a call writes none). At most
    `MAX_TIED` of them; none when the world size is not known to hold them."""
    if not suspects or not unseen_transfers(table) or any(s.cause == "no_log" for s in suspects):
        return []
    absent = sorted(set(range(table.world_size)) - set(table.ranks))
    return absent if len(absent) <= MAX_TIED else []


def absent_evidence(rank: int, suspects: list) -> str:
    answered = ", ".join(str(s.rank) for s in suspects if s.cause == "rank_missing")
    return (
        f"rank {rank} wrote no dump when every other rank did: it stopped or died (a process frozen "
        f"inside a call writes none); ranks {answered} never issued the collective their peers wait in, "
        "and may wait for it in a transfer these dumps do not record."
    )


def mark_ties(table, suspects: list) -> tuple[list, str]:
    """(`suspects` with tied candidates marked and first, a note) — or, with more candidates than
    `MAX_TIED`, (no suspect, the note saying why none is named). Unchanged where nothing is tied."""
    if not unseen_transfers(table) or any(s.cause == "no_log" for s in suspects):
        return suspects, ""
    alive = [s for s in suspects if s.cause == "rank_missing"]
    if len(alive) < 2:
        return suspects, ""
    ranks = ", ".join(str(s.rank) for s in alive)
    if len(alive) > MAX_TIED:
        return [s for s in suspects if s.cause != "rank_missing"], (
            f"ranks {ranks} never issued the collective their peers wait in, and {REASON}: with "
            f"{len(alive)} such ranks none is named"
        )
    for s in alive:
        s.tied = True
        s.confidence = round(1.0 / len(alive), 2)
    return alive + [s for s in suspects if not s.tied], f"ranks {ranks} are tied: {REASON}"
