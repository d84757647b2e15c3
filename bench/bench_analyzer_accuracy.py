"""Accuracy bench: simulated jobs with known faults, written to disk and analyzed; prints precision/recall/F1.

Usage: python bench/bench_analyzer_accuracy.py [--scenarios N] [--max-world W] [--seed S]
The default run (200 scenarios, worlds 8 to 4096) takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

from megatrace.analyzer import analyze
from megatrace.analyzer.layout import LayoutConfig
from tests.support import scenarios as S

WORLDS = [(8, 2, 1), (16, 2, 2), (32, 4, 2), (64, 8, 2), (128, 8, 4), (512, 8, 4)]
LARGE = (4096, 8, 8)
HASH_MODES = ("full", "none", "zero", "truncated")
LARGE_EVERY = 40  # one scenario in 40 is a 4096-rank job (each takes ~15 s to simulate, write and analyze)


def make(rng: random.Random, i: int, max_world: int) -> tuple[str, S.Scenario]:
    large = i % LARGE_EVERY == LARGE_EVERY - 1 and LARGE[0] <= max_world
    world, tp, pp = LARGE if large else rng.choice([w for w in WORLDS if w[0] <= max_world])
    steps = 12 if world <= 512 else 4
    kind = ["healthy", "slow", "hang", "stuck"][i % 4]
    sc = S.Scenario(world=world, tp=tp, pp=pp, steps=steps, jitter=rng.uniform(0.0, 0.03), seed=i)
    sc.skew_ms = {n: rng.uniform(-5, 5) for n in range(world // 8)} if rng.random() < 0.5 else {}
    if kind == "slow":
        sc.slow = {
            r: rng.choice([0.05, 0.1, 0.2, 0.5, 1.0]) for r in rng.sample(range(world), rng.choice([1, 1, 2]))
        }
    elif kind == "hang":
        sc.hang_rank, sc.hang_at = rng.sample(range(world), rng.choice([1, 1, 2])), rng.randrange(5, 40)
    elif kind == "stuck":
        sc.stuck_at, sc.stuck_rank = rng.randrange(5, 40), rng.randrange(world)
    return kind, sc


def run_one(i: int, kind: str, sc: S.Scenario, tmp: Path) -> tuple[dict, set[int], str]:
    """Simulate scenario `i`, write it in one of the formats (with their malformations), analyze it."""
    trace = S.simulate(sc)
    fmt = ["ring", "nccl", "fr"][i % 3] if sc.world <= 512 else "ring"
    out = tmp / f"s{i}"
    if fmt == "ring":
        S.write_ring_files(S.lose_and_duplicate(trace, lose_oldest=0.3 * (i % 2), seed=i), out)  # wrapped
    elif fmt == "nccl":
        fmt = HASH_MODES[(i // 3) % len(HASH_MODES)]
        S.write_nccl_logs(trace, out, group_hash=fmt, duplicate_batches=True, seed=i)
        fmt = f"nccl/{fmt}"
    else:
        S.write_flight_recorder(trace, out)
    report = analyze([out], LayoutConfig(tp=sc.tp, pp=sc.pp))
    shutil.rmtree(out)
    return report, trace.truth_slow if kind == "slow" else trace.truth_hang, fmt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenarios", type=int, default=200)
    parser.add_argument("--max-world", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--verbose", action="store_true", help="print every scenario with a wrong answer")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    counts = {k: [0, 0, 0] for k in ("hang", "slow", "slow>=10%")}  # tp, fp, fn
    false_verdicts = [0, 0]  # faulty scenarios, healthy scenarios
    formats: dict[str, int] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.scenarios):
            kind, sc = make(rng, i, args.max_world)
            report, truth, fmt = run_one(i, kind, sc, Path(tmp))
            formats[fmt] = formats.get(fmt, 0) + 1
            got = {s["rank"] for s in report["suspects"]}
            expected = {"healthy": "healthy", "slow": "slow"}.get(kind, "hang")
            wrong_verdict = report["verdict"] != expected
            false_verdicts[kind == "healthy"] += wrong_verdict
            if args.verbose and (wrong_verdict or got != truth):
                print(f"#{i} {kind} {fmt} {sc}: verdict {report['verdict']}, named {sorted(got)[:12]}, "
                      f"truth {sorted(truth)[:12]}")  # fmt: skip
            if kind == "healthy":
                continue
            key = "slow" if kind == "slow" else "hang"
            keys = [key] + (["slow>=10%"] if kind == "slow" and min(sc.slow.values()) >= 0.1 else [])
            for k in keys:
                counts[k][0] += len(got & truth)
                counts[k][1] += len(got - truth)
                counts[k][2] += len(truth - got)
    print(
        f"{args.scenarios} scenarios, worlds up to {args.max_world}, formats {formats}, "
        f"{time.perf_counter() - started:.0f} s"
    )
    for k, (tp, fp, fn) in counts.items():
        p = tp / (tp + fp) if tp + fp else 1.0
        r = tp / (tp + fn) if tp + fn else 1.0
        f1 = 2 * p * r / (p + r) if p + r else 0.0
        print(f"{k:>10}: precision {p:.3f} recall {r:.3f} F1 {f1:.3f} (tp {tp}, fp {fp}, fn {fn})")
    print(f"healthy scenarios with a false verdict: {false_verdicts[1]}")
    print(f"faulty scenarios with a wrong or missing verdict: {false_verdicts[0]}")


if __name__ == "__main__":
    main()
