"""Time to page: from a rank's hang to the first P0 card naming the culprit, at real speed; and no
page for a healthy job's checkpoint, evaluation pass or slow data load.

The local stack (`megatrace stack`: Prometheus with the project's rules, Alertmanager, the node agent,
the alert bot) runs at real speed (time compression 1) with a 5 s scrape interval, the chart's tracer
scrape interval. Each run is a real 4-rank gloo job (TP 2 × DP 2) under `megatrace trace`:

- hang runs: a random rank hangs at a random step (half of them inside `optimizer.step()`, one in
  four in the step right after a 90 s checkpoint on rank 0); timed from the fault, as the job's log
  reports it, to the first P0 card in the bot's output; the card must name the hung rank;
- pause runs: no fault; rank 0 writes a 90 s checkpoint (`torch.save` to a slow file), or runs a 60 s
  evaluation pass (`model.eval()`), or waits 45 s on its data loader; watched for 60 s past the pause,
  every P0 card counts as a false page.

Printed: per run, and the median and maximum time to page, how many pages named the culprit, and the
false pages. The issue's targets: median ≤ 45 s, maximum ≤ 60 s, ≥ 9 of 10 culprits, 0 false pages.
About 40-60 minutes for 10 + 10 runs on 2 cores. Usage:
python bench/bench_time_to_page.py [--hang-runs 10] [--pause-runs 10] [--seed 1] [--state-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrace.config import load_config
from megatrace.demo import Scenario
from megatrace.stack import down, up
from megatrace.stack_config import StackConfig
from tests.support.page_runs import PageRun, run_job
from tests.support.services import free_port

PAUSES = (("checkpoint", 90.0), ("eval", 60.0), ("dataloader", 45.0))
STEPS_BEFORE = (5, 40)  # a fault or pause comes at a random step in this range
PAGE_WAIT_S = 180.0  # a hang run that has not paged by then counts as a miss
START_S = 30.0  # time for the job to start and reach its step


def stack_config(state: Path) -> StackConfig:
    ports = {
        name: free_port() for name in ("prometheus", "alertmanager", "node_exporter", "exporter", "alertbot")
    }
    sysfs = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sysfs" / "infiniband"
    overrides = {
        "state_dir": str(state),
        "ports": ports,
        "scrape_interval": "5s",
        "time_compression": 1,
        "sysfs_root": str(sysfs),
    }
    return load_config(StackConfig, environ={}, overrides=overrides)


def hang_run(
    config: StackConfig, index: int, rng: random.Random, scenario: Scenario
) -> tuple[PageRun, int, str]:
    rank, step = rng.randrange(scenario.nprocs), rng.randint(*STEPS_BEFORE)
    where = ("collective", "optimizer", "after-checkpoint", "optimizer")[index % 4]
    env: dict[str, str] = {}
    args: list[str] = []
    if where == "optimizer":
        args.append(f"--hang-in-optimizer={rank}:{step}")
    else:
        if where == "after-checkpoint":
            args.append(f"--pause=checkpoint:0:{step}:90")
            step += 1
        env = {"MEGATRACE_FAULT_HANG_RANK": str(rank), "MEGATRACE_FAULT_HANG_AT_STEP": str(step)}
    watch = START_S + (90.0 if where == "after-checkpoint" else 0.0) + PAGE_WAIT_S
    run = run_job(config, f"ttp-hang-{index}", scenario, env, args, watch)
    return run, rank, f"rank {rank} hangs {where} at step {step}"


def pause_run(config: StackConfig, index: int, rng: random.Random, scenario: Scenario) -> tuple[PageRun, str]:
    kind, seconds = PAUSES[index % len(PAUSES)]
    step = rng.randint(*STEPS_BEFORE)
    args = [f"--pause={kind}:0:{step}:{seconds:g}"]
    run = run_job(
        config, f"ttp-pause-{index}", scenario, {}, args, START_S + seconds + 60.0, stop_at_page=False
    )
    return run, f"rank 0 {kind} for {seconds:g}s at step {step}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hang-runs", type=int, default=10)
    parser.add_argument("--pause-runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--state-dir", default="")
    args = parser.parse_args()
    state = Path(args.state_dir or tempfile.mkdtemp(prefix="megatrace-ttp-"))
    config = stack_config(state)
    scenario = Scenario(nprocs=4, tp=2)
    rng = random.Random(args.seed)
    print(f"local stack in {state}, real speed, scrape 5s; load average {os.getloadavg()[0]:.1f}", flush=True)
    up(config, say=lambda line: None)
    times, named, false_pages = [], 0, 0
    try:
        for index in range(args.hang_runs):
            run, rank, what = hang_run(config, index, rng, scenario)
            took = run.time_to_page
            named += run.names(rank)
            if took is not None:
                times.append(took)
            shown = "no page" if took is None else f"{took:.1f}s"
            print(f"hang {index}: {what}: {shown}, culprit named: {run.names(rank)}", flush=True)
        for index in range(args.pause_runs):
            run, what = pause_run(config, index, rng, scenario)
            false_pages += run.pages
            print(f"pause {index}: {what}: {run.pages} page(s)", flush=True)
    finally:
        down(config)
    if times:
        median, worst = statistics.median(times), max(times)
        print(f"time to page, {len(times)} of {args.hang_runs} hangs: median {median:.1f}s, max {worst:.1f}s")
    print(f"culprit named in {named} of {args.hang_runs} pages")
    print(f"false pages: {false_pages} on {args.pause_runs} healthy runs with pauses")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
