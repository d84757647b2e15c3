"""Convert our tracer's ring files into the Megatrace NCCL log format, to score the analyzer on it.

Usage: python bench/ring_to_nccl_log.py RING_DIR OUT_DIR

The patched NCCL that writes Megatrace's logs cannot run here (no GPU), so its format is made from real
gloo runs recorded by our tracer: one ``rank_<r>.log`` per ring file, a line per collective or
point-to-point call in the order the rank issued it, as ``/work/shared/reference/formats.md`` gives it:

    [save_count 1] [<sec>.<ns>] [Rank <r>] Fun <Op> Data <count> stream <0x…> opCount <n> groupHash <h>

What the format does not carry is dropped: the peer of a send or receive and the completion time (the
line's time is the enqueue time). ``Data`` is the element count (bytes over the element size);
``opCount`` is the tracer's sequence number (per communicator, and per neighbour for transfers: the
same call has the same one on every member); ``groupHash`` a signed 64-bit hash of the communicator's
id, the same on all members, and 0 for transfers (a split communicator's, as torch splits the pipeline
group off the default one); ``stream`` a per-rank address per communicator (and neighbour, for
transfers: a middle stage's two neighbours are two streams). Lines are cut at 127 characters, as the
patched NCCL cuts them (a long hash loses digits). Calls NCCL has no line for (barriers, gathers,
all-to-all) are left out.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import numpy as np

from megatrace.tracer.ringfile import DTYPE_NAMES, OP_NAMES, read_ring

NCCL_OPS = {
    "all_reduce": "AllReduce",
    "all_gather": "AllGather",
    "reduce_scatter": "ReduceScatter",
    "broadcast": "Broadcast",
    "reduce": "Reduce",
    "send": "Send",
    "recv": "Recv",
}
ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1, "int16": 2, "int64": 8}
LINE_CUT = 127


def group_hash(comm_id: int, p2p: bool) -> int:
    """A signed 64-bit hash of a communicator id, the same on every member; 0 for pipeline transfers,
    as the patched NCCL writes for communicators made by ``ncclCommSplit`` (torch splits the pipeline
    group off the default communicator; the tracer names a group by its members, so a 4-rank
    pipeline's group and the world's would share one hash otherwise)."""
    if p2p:
        return 0
    raw = int(comm_id).to_bytes(8, "little", signed=False)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)


def stream_of(rank: int, comm_id: int, peer: int) -> str:
    """A CUDA-stream-like pointer: per process (rank), communicator and, for transfers, neighbour (a
    middle pipeline stage talks to each of its two neighbours on its own stream); never shared across
    ranks. The peer itself is not written."""
    return f"0x{0x55D000000000 + rank * 0x100000 + (int(comm_id) % 0xFFF) * 0x100 + (peer + 1) * 0x10:x}"


def lines_of(path: Path) -> tuple[int, list[str]]:
    """(rank, the log's lines) for one ring file."""
    snap = read_ring(path)
    rank = snap.header.rank
    records = np.sort(snap.records, order="serial")
    out = []
    for rec in records:
        op = NCCL_OPS.get(OP_NAMES.get(int(rec["op"]), ""))
        if op is None:
            continue
        dtype = DTYPE_NAMES.get(int(rec["dtype"]), "float32")
        count = int(rec["nbytes"]) // ELEMENT_BYTES.get(dtype, 4)
        sec, ns = divmod(int(rec["enqueue_ns"]), 1_000_000_000)
        comm, p2p = int(rec["comm_id"]), op in ("Send", "Recv")
        stream = stream_of(rank, comm, int(rec["peer"]) if p2p else -1)
        line = (
            f"[save_count 1] [{sec}.{ns:09d}] [Rank {rank}] Fun {op} Data {count} "
            f"stream {stream} opCount {int(rec['seq'])} groupHash {group_hash(comm, p2p)}"
        )
        out.append(line[:LINE_CUT])
    return rank, out


def convert(ring_dir: Path, out_dir: Path) -> list[Path]:
    """Write ``rank_<r>.log`` under `out_dir` for every ``rank-*.trace`` in `ring_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(ring_dir.glob("rank-*.trace")):
        rank, lines = lines_of(path)
        target = out_dir / f"rank_{rank}.log"
        target.write_text("".join(line + "\n" for line in lines))
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("ring_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    written = convert(args.ring_dir, args.out_dir)
    print(f"{len(written)} log(s) written to {args.out_dir}")
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
