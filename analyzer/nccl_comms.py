"""Communicator inference for Megatrace NCCL logs: which calls on different ranks are the same collective.

A full ``groupHash`` names the communicator directly; a truncated hash is mapped to the one full
hash it is a prefix of. Calls without a usable hash (older builds, or ``groupHash 0`` written for
communicators made by ``ncclCommSplit``) are grouped per rank by CUDA stream (each process group has
its own stream, and ``opCount`` counts per communicator), then matched across ranks by their call
signature (the most frequent ``(op, count)``). Parallel groups with identical signatures (all TP
groups, say) are split with the layout when one is given (see `_assign_groups`). Without a layout
they stay one merged group, which still lets the detectors find the rank behind or late.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from megatrace.analyzer.layout import Layout
from megatrace.analyzer.nccl_log import NcclRankLog, looks_like_nccl_log, parse_nccl_bytes
from megatrace.analyzer.reader_api import Parsed, Reader, ReaderError
from megatrace.analyzer.table import RankCalls, RankInfo, empty_columns
from megatrace.tracer.format import OP_CODES, P2P_OPS

P2P_SIGNATURE = 255  # op of a send/receive stream's signature
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
    """The most frequent (op, count) of a stream; sends and receives count as one op (`P2P_SIGNATURE`)."""
    ops = np.where(np.isin(log.op[rows], list(P2P_OPS)), P2P_SIGNATURE, log.op[rows])
    pairs = Counter(zip(ops.tolist(), log.count[rows].tolist(), strict=True))
    return max(pairs.items(), key=lambda item: (item[1], item[0]))[0]


def _assign_groups(
    classes: dict[tuple[int, int], set[int]], calls: dict[tuple[int, int], int], layout: Layout | None
) -> dict[tuple[int, int], list[tuple[int, ...]]]:
    """Split every class of calls into the groups of one layout dimension.

    Timing cannot tell which dimension a class belongs to (TP peers are synchronized by their own
    collectives, so they also call the DP all-reduce together), so the layout decides: a rank is in
    one group per dimension, so classes sharing ranks get different dimensions; the class with the most
    calls per rank takes the innermost dimension of the order string (Megatron issues TP collectives
    per layer, DP ones per step), the next class the next dimension. Sends and receives go to PP.
    """
    out: dict[tuple[int, int], list[tuple[int, ...]]] = {
        sig: [tuple(sorted(r))] for sig, r in classes.items()
    }
    if layout is None:
        return out
    used: list[tuple[set[int], str]] = []
    for sig in sorted(classes, key=lambda sig: (-calls[sig] / len(classes[sig]), sig)):
        ranks = classes[sig]
        dims = ("pp",) if sig[0] == P2P_SIGNATURE else tuple(d for d in layout.order if d != "pp")
        for dim in dims:
            if layout.sizes[dim] < 2 or max(ranks) >= layout.world_size:
                continue
            if sig[0] != P2P_SIGNATURE and any(d == dim and ranks & r for r, d in used):
                continue
            out[sig] = [g for g in layout.groups(dim) if set(g) & ranks]
            used.append((ranks, dim))
            break
    return out


TIMING_SAMPLES = 32
TIMING_NEIGHBOURS = 64
TIMING_LINK = 0.3  # ranks call the same collective within this share of the mean call interval


def _split_by_timing(
    sig: tuple[int, int], logs: list[NcclRankLog], local: dict, class_of: dict
) -> list[tuple[int, ...]]:
    """Split the ranks sharing a call signature into communicators by when they make the same calls.

    Members of one communicator issue its n-th call together (a collective holds them together), while
    parallel groups of the same kind drift apart (other stages, other timing). At up to 32 sequence
    numbers most ranks share, ranks whose median time difference is under 0.3 of the mean interval
    between calls are linked; the groups are the linked components. Ranks are compared with their 64
    nearest in time, so thousands of ranks cost little. Sends and receives, and classes too short to
    judge, stay one group.
    """
    series = {}
    for (i, _stream), rows in local.items():
        if class_of[(i, _stream)] == sig:
            log = logs[i]
            series[log.rank] = (log.op_count[rows], log.enqueue_ns[rows])
    ranks = sorted(series)
    if sig[0] == P2P_SIGNATURE or len(ranks) < 3:
        return [tuple(ranks)]
    lo = max(int(counts.min()) for counts, _t in series.values())
    hi = min(int(counts.max()) for counts, _t in series.values())
    if hi - lo < 4:
        return [tuple(ranks)]
    picks = np.unique(np.linspace(lo, hi, TIMING_SAMPLES).astype(np.int64))
    times = np.full((len(ranks), len(picks)), np.nan)
    spans = []
    for j, rank in enumerate(ranks):
        counts, enq = series[rank]
        order = np.argsort(counts, kind="stable")
        counts, enq = counts[order], enq[order]
        at = np.searchsorted(counts, picks)
        found = (at < len(counts)) & (counts[np.minimum(at, len(counts) - 1)] == picks)
        times[j, found] = enq[at[found]]
        if len(enq) > 1:
            spans.append((float(enq.max()) - float(enq.min())) / (len(enq) - 1))
    link = TIMING_LINK * float(np.median(spans)) if spans else 0.0
    parent = list(range(len(ranks)))

    def root(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    middle = times[:, len(picks) // 2]
    order = np.argsort(np.where(np.isnan(middle), np.inf, middle), kind="stable")
    for pos, a in enumerate(order.tolist()):
        for b in order[pos + 1 : pos + 1 + TIMING_NEIGHBOURS].tolist():
            diff = np.abs(times[a] - times[b])
            if np.isfinite(diff).any() and float(np.nanmedian(diff)) < link:
                parent[root(a)] = root(b)
    groups: dict[int, list[int]] = defaultdict(list)
    for j, rank in enumerate(ranks):
        groups[root(j)].append(rank)
    return sorted(tuple(g) for g in groups.values())


def _pipelines_by_streams(logs: list[NcclRankLog], local: dict, class_of: dict) -> list[tuple[int, ...]]:
    """The pipelines of a job whose layout is not given, from how many send/receive streams each rank
    has: a stage in the middle of a pipeline talks to two neighbours, the first and the last to one.
    In Megatron's order (PP outermost) the first stage is the first `world / pp` ranks and the last the
    last as many; a stage's neighbours sit `world / pp` ranks away. Empty when the streams do not fit
    that shape (a rank with no transfer or more than two streams, or ends elsewhere): the transfers
    then pair consecutive ranks, as before."""
    world = len(logs)
    streams: Counter[int] = Counter()
    for (i, _stream), sig in class_of.items():
        if sig[0] == P2P_SIGNATURE:
            streams[logs[i].rank] += 1
    if sorted(streams) != list(range(world)) or any(n > 2 for n in streams.values()):
        return []
    ends = {r for r, n in streams.items() if n == 1}
    if not ends or len(ends) % 2 or world % (len(ends) // 2):
        return []
    block = len(ends) // 2
    if ends != set(range(block)) | set(range(world - block, world)):
        return []
    return [tuple(range(r, world, block)) for r in range(block)]


def _pipelines_by_groups(world: int, groups: list[set[int]]) -> list[tuple[int, ...]]:
    """The pipelines where the streams cannot show their ends (interleaved schedules close a ring: the
    last stage sends back to the first), from the collectives' groups smaller than the world (TP and DP
    stay inside a stage): when they split the ranks into equal blocks of consecutive ranks, a stage is
    a block (Megatron's order) and a stage's neighbours sit a block away. Empty otherwise."""
    inner = [g for g in groups if 2 <= len(g) < world]
    block = max((max(g) - min(g) + 1 for g in inner), default=0)
    if not block or world % block or block == world:
        return []
    if any(min(g) // block != max(g) // block for g in inner):
        return []
    return [tuple(range(r, world, block)) for r in range(block)]


def _pipeline_pair(log: NcclRankLog, rows: np.ndarray, group: tuple[int, ...]) -> tuple[int, ...]:
    """The two neighbouring stages a send/receive stream connects, out of the rank's pipeline group.

    A pipeline channel's first transfer (opCount 0) carries activations forward: the rank that
    received it is the later stage. Without the first record the whole group stays the channel.
    """
    first = rows[log.op_count[rows] == 0]
    here = group.index(log.rank)
    if not len(first):
        return group
    other = here - 1 if int(log.op[first[0]]) == OP_CODES["recv"] else here + 1
    if not 0 <= other < len(group):
        return group
    return tuple(sorted((log.rank, group[other])))


def nccl_rank_calls(logs: list[NcclRankLog], layout: Layout | None = None) -> list[RankCalls]:
    """Turn parsed logs into `RankCalls` whose communicators are identified across ranks."""
    canonical = _hash_canonical(logs)
    hashed_members: dict[int, set[int]] = defaultdict(set)
    collective_hashes: set[int] = set()
    local: dict[tuple[int, int], np.ndarray] = {}
    classes: dict[tuple[int, int], set[int]] = defaultdict(set)
    class_of: dict[tuple[int, int], tuple[int, int]] = {}
    calls: dict[tuple[int, int], int] = defaultdict(int)
    for i, log in enumerate(logs):
        usable = log.has_hash & (log.group_hash != 0)
        for value in np.unique(log.group_hash[usable]).tolist():
            full = canonical.get(value, value)
            hashed_members[full].add(log.rank)
            if not _all_p2p(log.op[usable & (log.group_hash == value)]):
                collective_hashes.add(full)
        for stream in np.unique(log.stream[~usable]).tolist():
            rows = np.flatnonzero(~usable & (log.stream == stream))
            sig = _signature(log, rows)
            local[(i, stream)] = rows
            classes[sig].add(log.rank)
            class_of[(i, stream)] = sig
            calls[sig] += len(rows)
    if layout is not None:
        for full in collective_hashes:
            hashed_members[full] = set(layout.group_holding(hashed_members[full]))
    group_of: dict[tuple[tuple[int, int], int], tuple[int, ...]] = {}
    assigned = _assign_groups(classes, calls, layout)
    if layout is None:
        pipelines = _pipelines_by_streams(logs, local, class_of) or _pipelines_by_groups(
            len(logs), [hashed_members[h] for h in collective_hashes]
        )
        assigned = {
            sig: [g for g in pipelines if set(g) & classes[sig]]
            if pipelines and sig[0] == P2P_SIGNATURE
            else _split_by_timing(sig, logs, local, class_of)
            for sig in classes
        }
    for sig, groups in assigned.items():
        for group in groups:
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
            if sig[0] == P2P_SIGNATURE and len(group) > 2:
                group = _pipeline_pair(log, rows, group)
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


def _parse(path: Path, _settings: None) -> Parsed:
    log = parse_nccl_bytes(path.read_bytes(), str(path))
    if log.rank < 0 or not len(log.enqueue_ns):
        raise ReaderError(f"no readable NCCL log lines ({log.skipped} skipped)")
    return Parsed(log, log.skipped, log.duplicates)


READER = Reader("nccl-log", 1, looks_like_nccl_log, _parse, nccl_rank_calls)
