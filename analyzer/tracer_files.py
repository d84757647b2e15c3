"""Our tracer's ring files and stall dumps, read through the tracer's own `read_ring`/`read_dump`."""

from __future__ import annotations

import numpy as np

from megatrace.analyzer.table import OP_CODE, P2P_OPS, RankCalls, RankInfo, empty_columns
from megatrace.tracer.ringfile import OP_NAMES, RingSnapshot

# tracer op code -> analyzer op code
_OP_MAP = np.full(256, OP_CODE["other"], dtype=np.uint8)
for _code, _name in OP_NAMES.items():
    _OP_MAP[_code] = OP_CODE.get(_name, OP_CODE["other"])


def snapshot_calls(snapshot: RingSnapshot, path: str, fmt: str) -> RankCalls:
    """Columns of one rank's snapshot; P2P ops go to directed channels ``(comm, src, dst)``."""
    rec = snapshot.records
    header = snapshot.header
    n = len(rec)
    cols = empty_columns(n)
    rank = header.rank
    cols["rank"][:] = rank
    cols["seq"][:] = rec["seq"]
    ops = _OP_MAP[rec["op"]]
    cols["op"][:] = ops
    cols["nbytes"][:] = rec["nbytes"].astype(np.int64)
    cols["enqueue_ns"][:] = rec["enqueue_ns"]
    cols["complete_ns"][:] = rec["complete_ns"]
    cols["step"][:] = np.clip(rec["step"], -1, np.iinfo(np.int32).max)
    cols["peer"][:] = rec["peer"]
    comms: list[tuple[object, tuple[int, ...], bool]] = []
    index: dict[object, int] = {}
    is_p2p = np.isin(ops, list(P2P_OPS)) & (rec["peer"] >= 0)
    is_send = ops == OP_CODE["send"]
    src = np.where(is_send, rank, rec["peer"])
    dst = np.where(is_send, rec["peer"], rank)
    cids, cid_index = np.unique(rec["comm_id"], return_inverse=True)
    keys = np.stack(
        [cid_index.reshape(-1), is_p2p, np.where(is_p2p, src, -1), np.where(is_p2p, dst, -1)], axis=1
    )
    uniq, inverse = np.unique(keys.astype(np.int64), axis=0, return_inverse=True)
    local = np.empty(len(uniq), dtype=np.int32)
    for i, (ci, p2p, s, d) in enumerate(uniq.tolist()):
        cid = int(cids[ci])
        if p2p:
            key: object = ("p2p", cid, int(s), int(d))
            members = tuple(sorted({int(s), int(d)}))
        else:
            key = ("comm", cid)
            members = snapshot.communicators.get(cid, ())
        local[i] = index.setdefault(key, len(comms))
        if local[i] == len(comms):
            comms.append((key, members, bool(p2p)))
    cols["comm"][:] = local[inverse.reshape(-1)]
    info = RankInfo(
        rank=rank,
        host=header.host,
        source=path,
        fmt=fmt,
        has_completion=True,
        finished=header.finished,
        observed_until_ns=snapshot.taken_ns,
    )
    return RankCalls(rank, cols, comms, info)
