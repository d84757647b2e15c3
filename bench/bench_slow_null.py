"""Null table of the slow verdict: how often healthy jobs are called slow, by job size and data source.

Usage: python bench/bench_slow_null.py [--seeds 8:200,64:100,512:30,4096:5] [--corpus DIR ...]

Synthetic null traces: the project's simulator (tests/support/scenarios.py) with no fault, written as
our ring files and analyzed with the layout, at 8, 64, 512 and 4,096 ranks, one job per seed; each seed
draws its noise: compute jitter (1-5 %), bursts of host load (a rank starts one with a chance of up to
8 % a compute, lasting 5 computes on average, each up to 40 % longer), and clock skew between nodes.
Real runs: the healthy runs of recorded corpora (bench/corpus.py), from our ring files and torch's
Flight Recorder dumps, with and without the layout flags. Per row: jobs, false `slow` verdicts, that
rate with its exact 95 % upper bound (Clopper-Pearson), and, for comparison, how many jobs the
corrected p-value alone would have called slow (the smallest corrected p of any rank that looked late
at or under the bound): the difference is what the effect floor and the consistency rule add.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from megatrace.analyzer import analyze
from megatrace.analyzer.layout import LayoutConfig
from megatrace.analyzer.significance import FAMILY_ALPHA

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support import scenarios as S

SHAPES = {8: [(2, 1), (2, 2), (1, 2)], 64: [(8, 2), (4, 2)], 512: [(8, 4)], 4096: [(8, 8)]}


def upper_bound(false: int, runs: int, level: float = 0.95) -> float:
    """Exact (Clopper-Pearson) one-sided upper confidence bound of a rate seen `false` times in `runs`."""
    if runs == 0:
        return 1.0
    if false >= runs:
        return 1.0
    lo, hi = false / runs, 1.0
    for _ in range(60):  # bisection: the rate at which seeing `false` or fewer has chance 1 - level
        mid = (lo + hi) / 2
        below = sum(math.comb(runs, k) * mid**k * (1 - mid) ** (runs - k) for k in range(false + 1))
        lo, hi = (mid, hi) if below > 1 - level else (lo, mid)
    return hi


class Row:
    """Healthy jobs of one kind and what the analyzer called them."""

    def __init__(self, name: str) -> None:
        self.name, self.runs, self.slow, self.other, self.p_alone = name, 0, 0, 0, 0
        self.wrong: list[str] = []

    def add(self, label: str, report: dict) -> None:
        self.runs += 1
        verdict = report["verdict"]
        self.slow += verdict == "slow"
        self.other += verdict not in ("slow", "healthy")
        self.p_alone += report.get("slow_test", {}).get("least_p", 1.0) <= FAMILY_ALPHA
        if verdict != "healthy":
            top = report["suspects"][0] if report["suspects"] else {}
            self.wrong.append(f"{label}: {verdict} {top.get('rank')} {top.get('evidence', '')[:160]}")

    def line(self) -> str:
        rate = self.slow / self.runs if self.runs else 0.0
        bound = upper_bound(self.slow, self.runs)
        cells = [self.name, self.runs, self.slow, f"{rate:.3f}", f"{bound:.3f}", self.p_alone, self.other]
        return "| " + " | ".join(map(str, cells)) + " |"


def synthetic(world: int, seeds: int) -> Row:
    """`seeds` healthy simulated jobs of `world` ranks, each with its own noise."""
    row = Row(f"synthetic, {world} ranks")
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(seeds):
            rng = random.Random(world * 100_003 + seed)
            tp, pp = rng.choice(SHAPES[world])
            sc = S.Scenario(
                world=world, tp=tp, pp=pp, steps=12 if world <= 512 else 4, seed=seed,
                jitter=rng.uniform(0.01, 0.05), burst_chance=rng.uniform(0.0, 0.08),
                burst_ms=rng.uniform(0.0, 4.0),
            )  # fmt: skip
            if rng.random() < 0.5:
                sc.skew_ms = {n: rng.uniform(-5, 5) for n in range(max(1, world // 8))}
            out = Path(tmp) / f"s{seed}"
            S.write_ring_files(S.simulate(sc), out)
            row.add(f"seed {seed} tp {tp} pp {pp}", analyze([out], LayoutConfig(tp=tp, pp=pp)))
            shutil.rmtree(out)
    return row


def real(corpora: list[Path]) -> list[Row]:
    """The healthy runs of recorded corpora, per source and with or without the layout flags."""
    rows = {
        (source, flags): Row(f"real runs, {source}, {'layout given' if flags else 'no flags'}")
        for source in ("ring files", "Flight Recorder")
        for flags in (False, True)
    }
    for root in corpora:
        for run in sorted(p for p in root.iterdir() if (p / "label.json").exists()):
            label = json.loads((run / "label.json").read_text())
            if label["fault"] != "none":
                continue
            layout = LayoutConfig(world_size=label["world"], tp=label["tp"], pp=label["pp"])
            for source, path in (("ring files", run / "trace" / run.name), ("Flight Recorder", run / "fr")):
                rows[(source, False)].add(f"{root.name}/{run.name}", analyze([path]))
                rows[(source, True)].add(f"{root.name}/{run.name}", analyze([path], layout))
    return [row for row in rows.values() if row.runs]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="8:200,64:100,512:30,4096:5", help="world:seeds,… (synthetic)")
    parser.add_argument("--corpus", type=Path, nargs="*", default=[], help="recorded corpus folders")
    parser.add_argument("--verbose", action="store_true", help="print every healthy job called otherwise")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = []
    for item in filter(None, args.seeds.split(",")):
        world, seeds = (int(x) for x in item.split(":"))
        rows.append(synthetic(world, seeds))
        print(f"({rows[-1].name}: {time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    rows += real(args.corpus)
    print(f"bound: per-job false-alarm rate of a slow verdict <= {FAMILY_ALPHA}")
    print("| null jobs | jobs | false slow | rate | 95 % upper bound | p alone <= bound | other verdicts |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(row.line())
    if args.verbose:
        for row in rows:
            for line in row.wrong:
                print(f"   {row.name}: {line}")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
