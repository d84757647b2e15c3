"""Scale bench: RANKS ring files × RECORDS records (our format) and a LINES-line Megatrace NCCL log.

Prints load time, analysis time and peak memory. Usage:
python bench/bench_analyzer_scale.py [--ranks 4096] [--records 10000] [--lines 1000000]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from megatrace.analyzer import scenarios as S
from megatrace.analyzer.hang import detect_hang
from megatrace.analyzer.layout import LayoutConfig, resolve
from megatrace.analyzer.loader import load
from megatrace.analyzer.nccl_log import read_nccl_log
from megatrace.analyzer.slow import detect_slow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--records", type=int, default=10000)
    parser.add_argument("--lines", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tp = 8
        layers = 4
        per_step = 2 * layers + 1
        sc = S.Scenario(world=args.ranks, tp=tp, steps=max(1, args.records // per_step), layers=layers,
                        slow={args.ranks // 3: 0.2}, jitter=0.01)  # fmt: skip
        t = time.perf_counter()
        trace = S.simulate(sc)
        S.write_ring_files(trace, Path(tmp) / "job")
        print(
            f"generated {len(trace.rank):,} records for {args.ranks} ranks in {time.perf_counter() - t:.1f} s"
        )
        del trace
        layout = resolve(LayoutConfig(world_size=args.ranks, tp=tp))
        t = time.perf_counter()
        table, _ = load([Path(tmp) / "job"], layout)
        t_load = time.perf_counter() - t
        t = time.perf_counter()
        hang = detect_hang(table)
        slow = detect_slow(table, layout)
        t_an = time.perf_counter() - t
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / 1024
        print(f"our format: load {t_load:.1f} s, analysis {t_an:.1f} s, total {t_load + t_an:.1f} s, "
              f"peak RSS {peak:.2f} GiB; slow suspects {[s.rank for s in slow.suspects]}, "
              f"hang suspects {[s.rank for s in hang.suspects]}")  # fmt: skip
        small = S.simulate(S.Scenario(world=8, tp=2, steps=max(1, args.lines // 8 // 5), layers=2))
        S.write_nccl_logs(small, Path(tmp) / "nccl")
        path = Path(tmp) / "nccl" / "rank_0.log"
        lines = path.read_text().splitlines()
        reps = int(np.ceil(args.lines / len(lines)))
        path.write_text("\n".join(lines * reps) + "\n")
        n = len(lines) * reps
        t = time.perf_counter()
        log = read_nccl_log(path)
        dt = time.perf_counter() - t
        print(f"NCCL log: {n:,} lines parsed in {dt:.2f} s = {n / dt / 1e6:.2f} M lines/s on one core "
              f"({len(log.op_count):,} unique calls kept)")  # fmt: skip


if __name__ == "__main__":
    main()
