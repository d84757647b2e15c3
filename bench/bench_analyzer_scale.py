"""Scale bench: RANKS ring files × RECORDS records (our format) and a LINES-line Megatrace NCCL log.

Prints load time, analysis time, peak memory of the analyzing process (the files are generated in a
child process, so its memory does not count), and NCCL log parse throughput (wall and CPU time; the
CPU figure is per core). Usage:
python bench/bench_analyzer_scale.py [--ranks 4096] [--records 10000] [--lines 1000000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from megatrace.analyzer.hang import detect_hang
from megatrace.analyzer.layout import LayoutConfig, resolve
from megatrace.analyzer.loader import load
from megatrace.analyzer.nccl_log import read_nccl_log
from megatrace.analyzer.slow import detect_slow

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import scenarios as S

TP, LAYERS, TEMPLATE_STEPS = 8, 4, 12


def generate(job_dir: Path, ranks: int, records: int, slow_rank: int) -> None:
    """A healthy TP×DP job with one 20 % slow rank, replayed until each rank has `records` records."""
    sc = S.Scenario(
        world=ranks, tp=TP, steps=TEMPLATE_STEPS, layers=LAYERS, slow={slow_rank: 0.2}, jitter=0.01
    )
    trace = S.simulate(sc)
    per_rank = len(trace.rank) // ranks
    S.write_ring_files(trace, job_dir, repeat=max(1, records // per_rank))


def nccl_throughput(tmp: Path, lines: int) -> None:
    small = S.simulate(S.Scenario(world=8, tp=2, steps=40, layers=2))
    S.write_nccl_logs(small, tmp / "nccl")
    path = tmp / "nccl" / "rank_0.log"
    text = path.read_text().splitlines()
    reps = int(np.ceil(lines / len(text)))
    path.write_text("\n".join(text * reps) + "\n")
    n = len(text) * reps
    wall, cpu = time.perf_counter(), time.process_time()
    log = read_nccl_log(path)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(
        f"NCCL log: {n:,} lines parsed in {wall:.2f} s wall = {n / wall / 1e6:.2f} M lines/s; "
        f"CPU {cpu:.2f} s = {n / cpu / 1e6:.2f} M lines/s per core ({len(log.op_count):,} unique calls kept)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--records", type=int, default=10000)
    parser.add_argument("--lines", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job"
        slow_rank = args.ranks // 3
        t = time.perf_counter()
        child = multiprocessing.get_context("spawn").Process(
            target=generate, args=(job, args.ranks, args.records, slow_rank)
        )
        child.start()
        child.join()
        files = list(job.iterdir())
        size = sum(f.stat().st_size for f in files)
        print(
            f"generated {len(files)} ring files ({size / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s"
        )
        layout = resolve(LayoutConfig(world_size=args.ranks, tp=TP))
        t, cpu = time.perf_counter(), time.process_time()
        table, _ = load([job], layout)
        t_load, cpu_load = time.perf_counter() - t, time.process_time() - cpu
        t, cpu = time.perf_counter(), time.process_time()
        hang = detect_hang(table)
        slow = detect_slow(table, layout)
        t_an, cpu_an = time.perf_counter() - t, time.process_time() - cpu
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(
            f"our format: {len(table):,} records of {len(table.ranks)} ranks: load {t_load:.1f} s, analysis "
            f"{t_an:.1f} s, total {t_load + t_an:.1f} s wall (CPU {cpu_load:.1f} + {cpu_an:.1f} s), "
            f"peak RSS {peak:.2f} GiB; slow suspects "
            f"{[s.rank for s in slow.suspects]} (injected {slow_rank}), "
            f"hang suspects {[s.rank for s in hang.suspects]}"
        )
        del table
        nccl_throughput(Path(tmp), args.lines)


if __name__ == "__main__":
    main()
