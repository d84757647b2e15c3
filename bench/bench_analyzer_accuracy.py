"""Accuracy bench: simulated jobs with known faults, written to disk and analyzed; prints precision/recall/F1.

Usage: python bench/bench_analyzer_accuracy.py [--scenarios N] [--max-world W] [--seed S]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from megatrace.analyzer import analyze
from megatrace.analyzer import scenarios as S
from megatrace.analyzer.layout import LayoutConfig

WORLDS = [(8, 2, 1), (16, 2, 2), (32, 4, 2), (64, 8, 2), (128, 8, 4), (512, 8, 4), (4096, 8, 8)]


def make(rng: random.Random, i: int, max_world: int) -> tuple[str, S.Scenario]:
    world, tp, pp = rng.choice([w for w in WORLDS if w[0] <= max_world])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenarios", type=int, default=200)
    parser.add_argument("--max-world", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    counts = {k: [0, 0, 0] for k in ("hang", "slow", "slow>=10%")}  # tp, fp, fn
    false_verdicts = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.scenarios):
            kind, sc = make(rng, i, args.max_world)
            trace = S.simulate(sc)
            fmt = ["ring", "nccl", "fr"][i % 3] if sc.world <= 512 else "ring"
            out = Path(tmp) / f"s{i}"
            {"ring": S.write_ring_files, "nccl": S.write_nccl_logs, "fr": S.write_flight_recorder}[fmt](
                trace, out
            )
            report = analyze([out], LayoutConfig(tp=sc.tp, pp=sc.pp))
            got = {s["rank"] for s in report["suspects"]}
            truth = trace.truth_slow if kind == "slow" else trace.truth_hang
            key = "slow" if kind == "slow" else "hang"
            if kind == "healthy":
                false_verdicts += report["verdict"] != "healthy"
                continue
            keys = [key] + (["slow>=10%"] if kind == "slow" and min(sc.slow.values()) >= 0.1 else [])
            for k in keys:
                counts[k][0] += len(got & truth)
                counts[k][1] += len(got - truth)
                counts[k][2] += len(truth - got)
            for other in ("hang", "slow"):
                if other != key and report["verdict"] == other:
                    false_verdicts += 1
    print(f"{args.scenarios} scenarios, worlds up to {args.max_world}")
    for k, (tp, fp, fn) in counts.items():
        p = tp / (tp + fp) if tp + fp else 1.0
        r = tp / (tp + fn) if tp + fn else 1.0
        f1 = 2 * p * r / (p + r) if p + r else 0.0
        print(f"{k:>10}: precision {p:.3f} recall {r:.3f} F1 {f1:.3f} (tp {tp}, fp {fp}, fn {fn})")
    print(f"false verdicts (healthy called faulty, or wrong fault kind): {false_verdicts}")


if __name__ == "__main__":
    main()
