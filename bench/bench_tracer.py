"""Cost of the tracer: ns added per traced call vs the same bare gloo collective, and the record path alone.

``python bench/bench_tracer.py [--calls N] [--rounds R]`` runs a world-size-2 gloo job on the CPU
with tiny tensors. Each round times N bare ``all_reduce`` calls, then N traced ones (tracer installed
in the same processes), alternating so drift hits both; the figure is the median over rounds of
(traced - bare) / N. Because a gloo call's own jitter can dwarf the tracer, the whole wrapper path is
also timed around a no-op function with all_reduce's signature (same wrapper, real ring file), and
the record path alone (begin + end on a ring, no torch). All three are printed by one run. Wall
and CPU (thread) time are both given: on a shared machine wall time includes time spent preempted.
Prints figures; it is not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatrace.tracer import runtime, wrappers
from megatrace.tracer.recorder import Recorder
from megatrace.tracer.ringfile import DTYPE_CODES, OP_CODES, RankIdentity, RingWriter, comm_id
from megatrace.tracer.settings import FaultSettings, TraceSettings


def _per_call(calls: int, run) -> tuple[float, float]:
    """(wall, CPU) ns per call of `run()` doing `calls` calls; CPU time is this thread's, so time the
    thread spends preempted on a loaded machine does not count."""
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    run()
    return (time.perf_counter_ns() - wall) / calls, (time.thread_time_ns() - cpu) / calls


def _summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    walls, cpus = [s[0] for s in samples], [s[1] for s in samples]
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus), "cpu_min": min(cpus)}


def record_path_ns(calls: int, trace_dir: Path) -> dict[str, float]:
    """ns of one begin+end pair on a ring file (what a traced call adds besides argument reading)."""
    identity = RankIdentity("bench", 0, 0, 1, "localhost", os.getpid(), time.time_ns())
    writer = RingWriter(trace_dir / "record-path.trace", identity, capacity=65536)
    recorder = Recorder(writer, rank=0)
    cid = comm_id([0, 1])
    op, dtype = OP_CODES["all_reduce"], DTYPE_CODES["float32"]

    def run() -> None:
        for _ in range(calls):
            recorder.end(recorder.begin(cid, op, 16, dtype, -1, 0))

    samples = [_per_call(calls, run) for _ in range(9)]
    writer.close()
    return _summary(samples)


def _noop_all_reduce(tensor, op=None, group=None, async_op=False):
    return None


def wrapper_path_ns(calls: int, tensor: torch.Tensor) -> dict[str, float]:
    """ns added per call by the wrapper around a no-op with all_reduce's signature: the whole
    traced-call overhead (argument binding, communicator lookup, record, completion) without network
    noise. Bare and traced batches alternate; the figures are traced minus bare."""
    tracer = runtime.current()
    assert tracer is not None
    traced = wrappers.make_wrapper(tracer, _noop_all_reduce, wrappers.OP_SPECS["all_reduce"])

    def bare_run() -> None:
        for _ in range(calls):
            _noop_all_reduce(tensor)

    def traced_run() -> None:
        for _ in range(calls):
            traced(tensor)

    added = []
    for _ in range(9):
        bare = _per_call(calls, bare_run)
        added.append(tuple(t - b for t, b in zip(_per_call(calls, traced_run), bare, strict=True)))
    return _summary(added)


def _timed(calls: int, tensor: torch.Tensor) -> int:
    dist.barrier()
    start = time.perf_counter_ns()
    for _ in range(calls):
        dist.all_reduce(tensor)
    return time.perf_counter_ns() - start


def _worker(rank: int, port: int, calls: int, rounds: int, trace_dir: str, results: dict) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    tensor = torch.ones(4)
    settings = TraceSettings(enable=True, dir=trace_dir, job="bench", stall_ms=600_000, capacity=65536)
    _timed(calls // 10 + 1, tensor)
    bare, traced = [], []
    for _ in range(rounds):
        bare.append(_timed(calls, tensor) / calls)
        runtime.install(settings, FaultSettings())
        traced.append(_timed(calls, tensor) / calls)
        runtime.uninstall()
    if rank == 0:
        runtime.install(settings, FaultSettings())
        results["noop"] = wrapper_path_ns(calls, tensor)
        runtime.uninstall()
        results["bare"] = statistics.median(bare)
        results["traced"] = statistics.median(traced)
        results["added"] = statistics.median(t - b for t, b in zip(traced, bare, strict=True))
    dist.destroy_process_group()


def _line(figures: dict[str, float]) -> str:
    return (
        f"   wall {figures['wall']:6.0f} ns/call   CPU {figures['cpu']:6.0f} ns/call"
        f" (median; min {figures['cpu_min']:.0f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20000, help="calls per timed batch")
    parser.add_argument("--rounds", type=int, default=7, help="alternating bare/traced rounds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        record = record_path_ns(args.calls, Path(tmp))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(port, args.calls, args.rounds, tmp, results), nprocs=2)
    print(f"load average at the end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    print("1. gloo all_reduce, 4 floats, world size 2 (wall time, median of alternating rounds):")
    print(f"   bare   {results['bare']:10.0f} ns/call")
    print(f"   traced {results['traced']:10.0f} ns/call")
    print(f"   added  {results['added']:10.0f} ns/call (gloo's own jitter included: noise at this size)")
    noop = results["noop"]
    print("2. added by the whole wrapper around a no-op with all_reduce's signature (target <= 2000 ns):")
    print(_line(noop))
    print("3. record path alone (Recorder.begin + Recorder.end on a ring file, no torch):")
    print(_line(record))


if __name__ == "__main__":
    main()
