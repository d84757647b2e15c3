"""Scenario generator with known ground truth, for the accuracy bench and the analyzer's tests.

Simulates a Megatron-style job (TP all-reduces per layer, pipeline send/recv between stages, a DP
all-reduce per step) rank by rank with vectorized timing: a collective completes when its last
member has arrived, plus the transfer time. Faults: slow ranks (compute stretched), a compute hang
(a rank stops issuing), a stuck communication (an instance nobody completes), clock skew per node,
jitter, lost and duplicated records. Writes our ring files (through the tracer's `RingWriter`),
Megatrace NCCL logs, or Flight Recorder JSON dumps.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatrace.analyzer.layout import Layout, LayoutConfig, resolve
from megatrace.tracer.format import OP_CODES, OP_NAMES, op_name
from megatrace.tracer.ringfile import (
    RECORD_DTYPE,
    W_CALLS_BY_OP,
    W_WRITER_FLAGS,
    RankIdentity,
    RingWriter,
    comm_id,
)

T0_NS = 1_755_000_000_000_000_000
NCCL_NAMES = {
    "all_reduce": "AllReduce",
    "all_gather": "AllGather",
    "reduce_scatter": "ReduceScatter",
    "send": "Send",
    "recv": "Recv",
}


@dataclass
class Scenario:
    world: int
    tp: int = 1
    pp: int = 1
    steps: int = 20
    layers: int = 2
    compute_ms: float = 10.0
    comm_ms: float = 1.0
    jitter: float = 0.02
    # host noise as a busy node imposes it: at every compute, a rank not already delayed starts a burst of
    # load with this chance; a burst lasts a geometric number of computes (mean `burst_len`) and stretches
    # each by an exponential extra time of mean `burst_ms` drawn once per burst
    burst_chance: float = 0.0
    burst_ms: float = 0.0
    burst_len: float = 5.0
    slow: dict[int, float] = field(default_factory=dict)  # rank -> slowdown (0.1 = 10 % slower)
    skew_ms: dict[int, float] = field(default_factory=dict)  # node -> clock offset
    hang_rank: list[int] = field(default_factory=list)  # compute hang of these ranks ...
    hang_at: int = -1  # ... from this op slot on
    stuck_at: int = -1  # op slot whose TP (or DP) instance of `stuck_rank`'s group never completes
    stuck_rank: int = 0
    seed: int = 0
    gpus_per_node: int = 8

    @property
    def layout(self) -> Layout:
        return resolve(
            LayoutConfig(world_size=self.world, tp=self.tp, pp=self.pp, gpus_per_node=self.gpus_per_node)
        )


@dataclass
class Trace:
    """Simulated calls of all ranks (rows grouped by rank, time-ordered) and the truth."""

    rank: np.ndarray
    comm_key: np.ndarray  # index into comms
    seq: np.ndarray
    op: np.ndarray
    nbytes: np.ndarray
    enqueue_ns: np.ndarray
    complete_ns: np.ndarray
    peer: np.ndarray
    step: np.ndarray
    comms: list[tuple[int, ...]]
    truth_hang: set[int]
    truth_slow: set[int]
    end_ns: int


def simulate(sc: Scenario) -> Trace:
    lay = sc.layout
    rng = np.random.default_rng(sc.seed)
    w = sc.world
    factor = np.ones(w)
    for r, s in sc.slow.items():
        factor[r] = 1.0 + s
    t_free = np.zeros(w)
    blocked = np.zeros(w, dtype=bool)
    comms: list[tuple[int, ...]] = []
    comm_index: dict[tuple, int] = {}
    seqs: dict[int, int] = {}
    out: list[tuple] = []
    slot = [0]
    stuck_members: list[int] = []

    def cid(key: tuple, members: tuple[int, ...]) -> int:
        if key not in comm_index:
            comm_index[key] = len(comms)
            comms.append(members)
        return comm_index[key]

    burst_left = np.zeros(w, dtype=np.int64)
    burst_extra = np.zeros(w)

    def compute(ranks: np.ndarray, ms: float) -> None:
        noise = 1.0 + sc.jitter * rng.standard_normal(len(ranks))
        t_free[ranks] += ms * 1e6 * factor[ranks] * np.clip(noise, 0.5, 1.5)
        if sc.burst_chance:
            start = ranks[(burst_left[ranks] == 0) & (rng.random(len(ranks)) < sc.burst_chance)]
            burst_left[start] = rng.geometric(1.0 / sc.burst_len, len(start))
            burst_extra[start] = rng.exponential(sc.burst_ms * 1e6, len(start))
            busy = ranks[burst_left[ranks] > 0]
            t_free[busy] += burst_extra[busy] * rng.random(len(busy))
            burst_left[busy] -= 1

    def next_slot() -> int:
        if slot[0] == sc.hang_at:
            blocked[sc.hang_rank] = True
        slot[0] += 1
        return slot[0] - 1

    def collective(groups: list[tuple[int, ...]], kind: str, op: str, nbytes: int, step: int) -> None:
        here = next_slot()
        for g in groups:
            c = cid((kind, g), g)
            s = seqs.get(c, 0)
            seqs[c] = s + 1
            members = np.array(g)
            issued = members[~blocked[members]]
            enq = t_free[issued].copy()
            stuck = 0 <= sc.stuck_at <= here and sc.stuck_rank in g and not stuck_members
            if stuck:
                stuck_members.extend(g)
            if len(issued) == len(members) and not stuck:
                done = enq.max() + sc.comm_ms * 1e6
                t_free[members] = done
                comp = np.full(len(issued), done)
            else:
                blocked[issued] = True
                comp = np.zeros(len(issued))
            out.append((issued, c, s, OP_CODES[op], nbytes, enq, comp, np.full(len(issued), -1), step))

    def p2p(src: np.ndarray, dst: np.ndarray, nbytes: int, step: int) -> None:
        next_slot()
        for a, b in zip(src.tolist(), dst.tolist(), strict=True):
            c = cid(("p2p", min(a, b), max(a, b)), (min(a, b), max(a, b)))
            s = seqs.get(c, 0)
            seqs[c] = s + 1
            ok_a, ok_b = not blocked[a], not blocked[b]
            done = max(t_free[a], t_free[b]) + sc.comm_ms * 1e6 if ok_a and ok_b else 0.0
            for r, peer, op, ok in ((a, b, "send", ok_a), (b, a, "recv", ok_b)):
                if ok:
                    out.append(
                        (np.array([r]), c, s, OP_CODES[op], nbytes, np.array([t_free[r]]), np.array([done]),
                         np.array([peer]), step)
                    )  # fmt: skip
            if done:
                t_free[[a, b]] = done
            else:
                blocked[[a, b]] = True

    coords = [lay.coords(r) for r in range(w)]
    stage_ranks = [np.array([r for r in range(w) if coords[r]["pp"] == p]) for p in range(sc.pp)]
    tp_groups = lay.groups("tp")
    dp_groups = lay.groups("dp")
    stage_tp = [[g for g in tp_groups if coords[g[0]]["pp"] == p] for p in range(sc.pp)]

    def next_stage(p: int, q: int) -> tuple[np.ndarray, np.ndarray]:
        return stage_ranks[p], np.array([lay.group(r, "pp")[q] for r in stage_ranks[p]])

    for step in range(sc.steps):
        for direction in (1, -1):
            order = range(sc.pp) if direction == 1 else range(sc.pp - 1, -1, -1)
            for p in order:
                for _layer in range(sc.layers):
                    compute(stage_ranks[p], sc.compute_ms * (1 if direction == 1 else 2))
                    if sc.tp > 1:
                        collective(stage_tp[p], "tp", "all_reduce", 1 << 20, step)
                q = p + direction
                if 0 <= q < sc.pp:
                    src, dst = next_stage(p, q)
                    p2p(src, dst, 1 << 18, step)
        compute(np.arange(w), sc.compute_ms / 2)
        if len(dp_groups[0]) > 1:
            collective(dp_groups, "dp", "all_reduce", 1 << 24, step)

    rank = np.concatenate([o[0] for o in out])
    n = [len(o[0]) for o in out]
    cols = {
        "rank": rank,
        "comm_key": np.repeat([o[1] for o in out], n),
        "seq": np.repeat([o[2] for o in out], n),
        "op": np.repeat([o[3] for o in out], n).astype(np.uint8),
        "nbytes": np.repeat([o[4] for o in out], n),
        "enqueue_ns": np.concatenate([o[5] for o in out]),
        "complete_ns": np.concatenate([o[6] for o in out]),
        "peer": np.concatenate([o[7] for o in out]),
        "step": np.repeat([o[8] for o in out], n),
    }
    end = float(max(cols["enqueue_ns"].max(), cols["complete_ns"].max()))
    skew = np.array([sc.skew_ms.get(r // sc.gpus_per_node, 0.0) * 1e6 for r in range(w)])
    for name in ("enqueue_ns", "complete_ns"):
        raw = cols[name]
        shifted = T0_NS + (raw + skew[rank]).astype(np.int64)
        cols[name] = np.where(raw > 0, shifted, 0) if name == "complete_ns" else shifted
    order = np.lexsort((cols["enqueue_ns"], rank))
    cols = {k: v[order] for k, v in cols.items()}
    truth_hang: set[int] = set()
    if sc.hang_at >= 0 and sc.hang_rank:
        truth_hang = set(sc.hang_rank)
    elif stuck_members:
        truth_hang = set(stuck_members)
    return Trace(
        comms=comms,
        truth_hang=truth_hang,
        truth_slow={r for r, s in sc.slow.items() if s > 0},
        # a stuck job is looked at 30 s after it stopped; a running one right after its last call
        end_ns=T0_NS + int(end) + (30_000_000_000 if truth_hang else 50_000_000),
        **cols,
    )


def lose_and_duplicate(trace: Trace, lose_oldest: float = 0.0, seed: int = 0) -> Trace:
    """Drop each rank's oldest share of records (a ring that wrapped)."""
    if lose_oldest <= 0:
        return trace
    keep = np.ones(len(trace.rank), dtype=bool)
    _ranks, starts, counts = np.unique(trace.rank, return_index=True, return_counts=True)
    rng = np.random.default_rng(seed)
    for s, c in zip(starts, counts, strict=True):
        drop = int(c * lose_oldest * rng.uniform(0.5, 1.0))
        keep[s : s + drop] = False
    names = ("rank", "comm_key", "seq", "op", "nbytes", "enqueue_ns", "complete_ns", "peer", "step")
    fields = {k: getattr(trace, k)[keep] for k in names}
    return Trace(
        comms=trace.comms,
        truth_hang=trace.truth_hang,
        truth_slow=trace.truth_slow,
        end_ns=trace.end_ns,
        **fields,
    )


def _spans(trace: Trace):
    uniq, starts = np.unique(trace.rank, return_index=True)
    ends = np.append(starts[1:], len(trace.rank))
    return zip(uniq.tolist(), starts.tolist(), ends.tolist(), strict=True)


def write_ring_files(
    trace: Trace, job_dir: Path, gpus_per_node: int = 8, job: str = "sim", repeat: int = 1
) -> list[Path]:
    """One ring file per rank, written with the tracer's `RingWriter` (records filled in bulk).

    `repeat` > 1 replays each rank's calls that many times back to back (sequence numbers and times
    continue), which makes long traces of a healthy job cheaply (the scale bench).
    """
    job_dir.mkdir(parents=True, exist_ok=True)
    world = max(max(c) for c in trace.comms) + 1
    ids = [comm_id(m) for m in trace.comms]
    op_map = np.array([c if c in OP_NAMES else OP_CODES["barrier"] for c in range(256)], np.uint8)
    instances = np.bincount(trace.comm_key, minlength=len(trace.comms))  # rows per comm, all ranks
    period = int(max(trace.enqueue_ns.max(), trace.complete_ns.max()) - T0_NS) + 1_000_000
    members = np.array([len(c) for c in trace.comms])
    seq_steps = instances // np.maximum(members, 1)
    paths = []
    for rank, lo, hi in _spans(trace):
        n = (hi - lo) * repeat
        rows = np.tile(np.arange(lo, hi), repeat)
        turn = np.repeat(np.arange(repeat), hi - lo)
        seq_step = seq_steps[trace.comm_key[rows]]
        host = f"node{rank // gpus_per_node}"
        identity = RankIdentity(job, rank, rank % gpus_per_node, world, host, 1000 + rank, T0_NS)
        path = job_dir / f"rank-{rank}.trace"
        writer = RingWriter(path, identity, capacity=max(n, 1), comm_table_bytes=1 << 16)
        keys = np.unique(trace.comm_key[lo:hi])
        for k in keys.tolist():
            writer.add_communicator(ids[k], trace.comms[k])
        rec = np.ndarray(n, dtype=RECORD_DTYPE, buffer=writer.rec_b)
        rec["comm_id"] = np.array(ids, dtype=np.uint64)[trace.comm_key[rows]]
        rec["seq"] = trace.seq[rows] + turn * seq_step
        rec["nbytes"] = trace.nbytes[rows]
        shift = turn * period
        rec["enqueue_ns"] = trace.enqueue_ns[rows] + shift
        rec["complete_ns"] = np.where(trace.complete_ns[rows] > 0, trace.complete_ns[rows] + shift, 0)
        rec["step"] = trace.step[rows] + turn * (int(trace.step.max()) + 1)
        rec["rank"] = rank
        rec["peer"] = trace.peer[rows]
        rec["op"] = op_map[trace.op[rows]]
        rec["serial"] = np.arange(1, n + 1)
        calls = np.bincount(rec["op"], minlength=256)
        del rec
        writer.serial = n
        for code in np.flatnonzero(calls).tolist():
            writer.header[W_CALLS_BY_OP + code] = int(calls[code])
        writer.close()
        # a snapshot of a job still running: no lock flag, so readers take the trace as of now
        with open(path, "r+b") as handle:
            handle.seek(W_WRITER_FLAGS * 8)
            handle.write((0).to_bytes(8, "little"))
        end = trace.end_ns + (repeat - 1) * period
        os.utime(path, ns=(end, end))
        paths.append(path)
    return paths


def write_nccl_logs(
    trace: Trace, log_dir: Path, group_hash: str = "full", duplicate_batches: bool = False, seed: int = 0
) -> list[Path]:
    """Megatrace NCCL logs, one per rank. `group_hash`: "full", "none" (old builds), "zero" (split comms),
    or "truncated" (some lines' hashes cut short). Optionally repeat records across save batches."""
    log_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hashes = [int(comm_id(m)) - (1 << 62) for m in trace.comms]
    streams = [0x5600_0000_0000 + 0x1000 * i for i in range(len(trace.comms))]
    paths = []
    for rank, lo, hi in _spans(trace):
        lines = []
        for i in range(lo, hi):
            k = int(trace.comm_key[i])
            ns = int(trace.enqueue_ns[i])
            name = NCCL_NAMES.get(op_name(int(trace.op[i])), "AllReduce")
            stamp = f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"
            stream = hex(streams[k] + rank * 0x10_0000_0000)
            line = (
                f"[save_count {1 + (i - lo) // 500}] [{stamp}] [Rank {rank}] "
                f"Fun {name} Data {int(trace.nbytes[i]) // 2} stream {stream} opCount {int(trace.seq[i])}"
            )
            if group_hash == "full" or (group_hash == "truncated" and rng.random() > 0.3):
                line += f" groupHash {hashes[k]}"
            elif group_hash == "truncated":
                line += f" groupHash {str(hashes[k])[: rng.integers(4, 12)]}"
            elif group_hash == "zero":
                line += " groupHash 0"
            lines.append(line)
        if duplicate_batches and len(lines) > 20:
            cut = len(lines) // 2
            lines = lines[:cut] + lines[cut - 10 : cut] + lines[cut:]
        path = log_dir / f"rank_{rank}.log"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.utime(path, ns=(trace.end_ns, trace.end_ns))
        paths.append(path)
    return paths


def write_flight_recorder(trace: Trace, out_dir: Path) -> list[Path]:
    """Flight Recorder JSON dumps (``nccl_trace_rank_<r>.json``), one per rank."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pg_config = {
        str(k): {"name": str(k), "desc": "sim", "ranks": str(list(m))} for k, m in enumerate(trace.comms)
    }
    paths = []
    for rank, lo, hi in _spans(trace):
        entries = []
        for i in range(lo, hi):
            k = int(trace.comm_key[i])
            name = op_name(int(trace.op[i]))
            members = trace.comms[k]
            if name in ("send", "recv"):
                me, peer = members.index(rank), members.index(int(trace.peer[i]))
                prof = f"nccl:{name} {me}->{peer}" if name == "send" else f"nccl:{name} {me}<-{peer}"
            else:
                prof = f"nccl:{name}"
            done = int(trace.complete_ns[i])
            entries.append(
                {
                    "record_id": i - lo,
                    "pg_id": k,
                    "process_group": [str(k), "sim"],
                    "collective_seq_id": int(trace.seq[i]),
                    "p2p_seq_id": 0,
                    "profiling_name": prof,
                    "time_created_ns": int(trace.enqueue_ns[i]),
                    "input_sizes": [[int(trace.nbytes[i]) // 4]],
                    "input_dtypes": ["Float"],
                    "state": "completed" if done else "started",
                    "time_discovered_completed_ns": done or None,
                    "retired": bool(done),
                    "is_p2p": name in ("send", "recv"),
                }
            )
        path = out_dir / f"nccl_trace_rank_{rank}.json"
        path.write_text(
            json.dumps({"version": "2.5", "rank": rank, "pg_config": pg_config, "entries": entries})
        )
        os.utime(path, ns=(trace.end_ns, trace.end_ns))
        paths.append(path)
    return paths
