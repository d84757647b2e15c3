"""Accuracy bench: the analyzer's verdicts scored per data source, each printed as its own table.

Usage: python bench/bench_analyzer_accuracy.py [--corpus DIR [--record]] [--megatrace-sample DIR]
                                                [--scenarios N] [--max-world W] [--seed S]

Sources, each scored apart (a figure on the simulator the code was tuned to proves little alone):
- ``simulator``: the project's own simulated jobs (tests/support/scenarios.py), 4 formats;
- ``real runs, ring``: real gloo jobs of the corpus (bench/corpus.py) read from our tracer's files;
- ``real runs, Flight Recorder``: the same runs read from the dumps torch itself wrote;
- ``Megatrace sample``: Megatrace's published 8-rank log_rank2_slow logs (rank 2 slow), fetched by the
  user from the public sii-research/Megatrace repository (trace/analysis/logs/log_rank2_slow).
Real runs are scored twice, without layout flags and with the layout the run used; a run whose
verdict changes between the two is counted. Per source: hang and slow precision/recall/F1 (a hit is
the right verdict with the culprit ranked first; a tied answer whose culprit is second counts as a
miss there), top-1 culprit accuracy over faulty runs, false verdicts on healthy runs, and the hang
answers split: confident ones (one rank named first, no tie) with their precision (right: a hang run,
its culprit first), and tied ones with how often the tied set holds the culprit. `--record` records
the corpus first (runs already recorded are kept).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatrace.analyzer import analyze
from megatrace.analyzer.layout import LayoutConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


@dataclass
class Score:
    """Answers of one data source, against the truth."""

    name: str
    counts: dict[str, list[int]] = field(default_factory=lambda: {"hang": [0, 0, 0], "slow": [0, 0, 0]})
    faulty: int = 0
    top1: int = 0
    healthy: int = 0
    false_on_healthy: int = 0
    runs: int = 0
    changed_by_flags: int = 0
    wrong: list[str] = field(default_factory=list)
    # hang answers: confident (one rank first) and right; tied (the analyzer could not tell them apart)
    # and holding the culprit
    confident: list[int] = field(default_factory=lambda: [0, 0])
    tied: list[int] = field(default_factory=lambda: [0, 0])

    def add(self, label: str, report: dict, kind: str, culprits: set[int]) -> None:
        """`kind`: healthy, hang or slow; `culprits`: the ranks to blame (empty when healthy)."""
        self.runs += 1
        verdict = report["verdict"]
        top = report["suspects"][0]["rank"] if report["suspects"] else None
        if kind == "healthy":
            self.healthy += 1
            if verdict != "healthy":
                self.false_on_healthy += 1
                self.wrong.append(f"{label}: healthy read as {verdict} {top}")
            if verdict in self.counts:
                self.counts[verdict][1] += 1
            return
        self.faulty += 1
        if verdict == "hang" and report.get("tie"):
            self.tied[0] += 1
            self.tied[1] += bool(set(report["tie"]["ranks"]) & culprits)
        elif verdict == "hang":
            self.confident[0] += 1
            self.confident[1] += kind == "hang" and top in culprits
        hit = verdict == kind and top in culprits
        self.top1 += top in culprits
        if hit:
            self.counts[kind][0] += 1
            return
        self.wrong.append(f"{label}: {kind} {sorted(culprits)} read as {verdict} {top}")
        self.counts[kind][2] += 1
        if verdict in self.counts:
            self.counts[verdict][1] += 1

    def print(self) -> None:
        print(f"== {self.name}: {self.runs} runs ({self.faulty} faulty, {self.healthy} healthy)")
        for kind, (tp, fp, fn) in self.counts.items():
            p = tp / (tp + fp) if tp + fp else 1.0
            r = tp / (tp + fn) if tp + fn else 1.0
            f1 = 2 * p * r / (p + r) if p + r else 0.0
            print(f"   {kind}: precision {p:.3f} recall {r:.3f} F1 {f1:.3f} (tp {tp}, fp {fp}, fn {fn})")
        if self.faulty:
            print(f"   top-1 culprit: {self.top1}/{self.faulty} = {self.top1 / self.faulty:.3f}")
        print(f"   false verdicts on healthy runs: {self.false_on_healthy}/{self.healthy}")
        answers = self.confident[0] + self.tied[0]
        if answers:
            right, total = self.confident[1], self.confident[0]
            print(
                f"   hang answers: {total} confident (precision {right / total if total else 1.0:.3f}), "
                f"{self.tied[0]} tied ({self.tied[0] / answers:.0%} of hang answers; culprit in the tied "
                f"set {self.tied[1]}/{self.tied[0]})"
            )
        if self.changed_by_flags:
            print(f"   verdict changed by giving the layout: {self.changed_by_flags} run(s)")


def score_simulator(args: argparse.Namespace) -> Score:
    """The project's own simulator: `args.scenarios` scenarios (healthy, slow, hang, stuck in turn)."""
    score = Score(f"simulator ({args.scenarios} scenarios, worlds up to {args.max_world})")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.scenarios):
            kind, sc = make(rng, i, args.max_world)
            report, truth, fmt = run_one(i, kind, sc, Path(tmp))
            expected = {"healthy": "healthy", "slow": "slow"}.get(kind, "hang")
            score.add(f"#{i} {fmt}", report, expected, set(truth))
    return score


def score_corpus(root: Path) -> list[Score]:
    """Every recorded run of the corpus, from our ring files and from torch's Flight Recorder dumps, each
    read without layout flags and with the layout the run used."""
    scores = {
        (source, flags): Score(f"real runs, {title}, {'layout given' if flags else 'no layout flags'}")
        for source, title in (("ring", "our tracer's ring files"), ("fr", "Flight Recorder dumps by torch"))
        for flags in (False, True)
    }
    runs = sorted(p for p in root.iterdir() if (p / "done").exists())
    unusable = [run.name for run in runs if not (run / "label.json").exists()]
    if unusable:
        print(f"skipped {len(unusable)} run(s) whose job never started (no label.json):", *unusable)
    for run in runs:
        if run.name in unusable:
            continue
        label = json.loads((run / "label.json").read_text())
        kind = "healthy" if label["fault"] == "none" else label["fault"].split("-")[0]
        culprits = set() if kind == "healthy" else {label["rank"]}
        layout = LayoutConfig(world_size=label["world"], tp=label["tp"], pp=label["pp"])
        for source, path in (("ring", run / "trace" / run.name), ("fr", run / "fr")):
            bare, given = analyze([path]), analyze([path], layout)
            scores[(source, False)].add(run.name, bare, kind, culprits)
            scores[(source, True)].add(run.name, given, kind, culprits)
            scores[(source, False)].changed_by_flags += bare["verdict"] != given["verdict"]
    return list(scores.values())


def score_converted(root: Path, min_pp: int = 4) -> list[Score]:
    """Runs of pipelines of `min_pp` stages or more, from Megatrace-format logs made from their ring
    files (bench/ring_to_nccl_log.py), without and with the layout flags."""
    import ring_to_nccl_log

    scores = [Score(f"real runs, Megatrace-format logs (converted), PP >= {min_pp}, {how}") for how in
              ("no layout flags", "layout given")]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for run in sorted(p for p in root.iterdir() if (p / "label.json").exists() and (p / "done").exists()):
            label = json.loads((run / "label.json").read_text())
            if label["pp"] < min_pp:
                continue
            logs = Path(tmp) / run.name
            ring_to_nccl_log.convert(run / "trace" / run.name, logs)
            kind = "healthy" if label["fault"] == "none" else label["fault"].split("-")[0]
            culprits = set() if kind == "healthy" else {label["rank"]}
            layout = LayoutConfig(world_size=label["world"], tp=label["tp"], pp=label["pp"])
            scores[0].add(run.name, analyze([logs]), kind, culprits)
            scores[1].add(run.name, analyze([logs], layout), kind, culprits)
    return scores


def noise_summary(root: Path) -> None:
    """The load average (1 min) the runs reached, quiet and noisy apart, from each run's noise.json."""
    for noisy in (False, True):
        loads = []
        for run in sorted(root.glob("*/noise.json")):
            noise = json.loads(run.read_text())
            if bool(noise["hogs"]) == noisy:
                loads.append((noise["load_mean"], noise["load_max"], noise.get("memory_limit_hits", 0)))
        if loads:
            means = sorted(m for m, _x, _h in loads)
            print(
                f"{'noisy' if noisy else 'quiet'} runs: {len(loads)}, load average mean per run "
                f"{means[0]:.1f}-{means[-1]:.1f} (median {means[len(means) // 2]:.1f}), max reached "
                f"{max(x for _m, x, _h in loads):.1f}, runs with memory limit hits "
                f"{sum(1 for _m, _x, h in loads if h)}"
            )


def score_megatrace_sample(folder: Path) -> Score:
    """Megatrace's published sample, rank 2 slowed: read with and without the layout it ran with."""
    score = Score("Megatrace's published sample (log_rank2_slow)")
    for label, layout in (("no flags", None), ("--tp 2 --pp 4", LayoutConfig(tp=2, pp=4))):
        score.add(label, analyze([folder], layout), "slow", {2})
    return score


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", type=int, default=200, help="simulated scenarios (0: none)")
    parser.add_argument("--max-world", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--corpus", type=Path, help="folder of the real-run corpus (bench/corpus.py)")
    parser.add_argument("--record", action="store_true", help="record the corpus's missing runs first")
    parser.add_argument("--megatrace-sample", type=Path, help="folder of Megatrace's log_rank2_slow logs")
    parser.add_argument("--verbose", action="store_true", help="print every wrong answer")
    parser.add_argument(
        "--converted", action="store_true", help="also score PP >= 4 runs as converted Megatrace logs"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    scores = []
    if args.corpus and args.record:
        sys.path.insert(0, str(Path(__file__).parent))
        import corpus

        corpus.main(["--out", str(args.corpus)])
    if args.scenarios:
        scores.append(score_simulator(args))
    if args.corpus:
        scores.extend(score_corpus(args.corpus))
        noise_summary(args.corpus)
    if args.corpus and args.converted:
        sys.path.insert(0, str(Path(__file__).parent))
        scores.extend(score_converted(args.corpus))
    if args.megatrace_sample:
        scores.append(score_megatrace_sample(args.megatrace_sample))
    for score in scores:
        score.print()
        if args.verbose:
            for line in score.wrong:
                print(f"     wrong: {line}")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
