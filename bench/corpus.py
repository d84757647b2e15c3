"""Record the analyzer's corpus of real runs: Megatron-style gloo jobs with injected faults, each labelled.

Usage: python bench/corpus.py --out DIR [--runs 154] [--seed 20261123] [--only CLASS]
       python bench/corpus.py --plan users --out DIR [--runs 64] [--seed 20261128]

Every run is `tests/support/megatron_job.py` under ``megatrace trace`` (our ring files and stall dumps
in ``RUN/trace/<run>``) with torch's Flight Recorder on (``RUN/fr``), and ``RUN/label.json`` says what
was injected where. Runs already recorded are kept, so an interrupted recording resumes; delete the
folder to record anew (after the tracer's capture changes, say). The plan of runs comes from the seed
alone (committed before the first scoring): fault classes in turn, layouts, ranks, steps and
slowdowns drawn at random. Jobs have 4 or 8 ranks: on 2 cores more ranks bury a 10 % slowdown in
scheduling noise, and a 16-rank job takes minutes to start. Compute is timed (``--compute timed``,
2 ms a unit): each rank of a GPU job computes on its own device, so a rank's compute time does not
depend on the others'; matrix products of 8 processes on 2 cores would share the cores, and a rank
made 2× slower in them slowed every rank alike and was late by 2 % of a step.

``--plan users``: jobs built as users build them with PyTorch's own libraries
(`tests/support/pipelining_job.py`: ``torch.distributed.pipelining`` with GPipe, 1F1B, interleaved 1F1B
and the zero-bubble schedules, FSDP2 ``fully_shard`` or DDP over DP), half of every class recorded
under host noise fixed in the plan (`tests/support/host_noise.py`: CPU hogs, their duty cycle and
start, and a cgroup v1 memory limit); ``RUN/noise.json`` holds the plan's noise and the load average
reached. Run the recording under ``nice -n 19`` on a shared machine: the hogs inherit it.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.host_noise import HostNoise
from tests.support.megatron_job import run_traced

SEED = 20261123
CLASSES = ("none", "hang-compute", "hang-collective", "hang-p2p", "slow-compute", "slow-comm", "slow-loader")
# (world, tp, pp, virtual, zero): DP only; TP x DP; TP x PP x DP with 1F1B; interleaved; ZeRO; deep PP
LAYOUTS = [
    (4, 1, 1, 1, False),
    (4, 2, 1, 1, False),
    (8, 2, 2, 1, False),
    (8, 2, 2, 2, False),
    (8, 1, 2, 1, True),
    (8, 2, 4, 1, False),
    (4, 1, 4, 2, False),
]


@dataclass
class Run:
    """One planned run: its layout and the fault it carries."""

    name: str
    world: int
    tp: int
    pp: int
    virtual: int
    zero: bool
    fault: str
    rank: int
    factor: float
    fault_step: int
    steps: int


def plan(runs: int, seed: int = SEED) -> list[Run]:
    """The runs of the corpus, from the seed alone."""
    rng = random.Random(seed)
    out = []
    for i in range(runs):
        fault = CLASSES[i % len(CLASSES)]
        choices = LAYOUTS
        if fault == "hang-p2p":
            choices = [layout for layout in choices if layout[2] > 1]
        world, tp, pp, virtual, zero = rng.choice(choices)
        factor = 0.0
        if fault.startswith("slow"):
            factor = round(rng.choice([0.1, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 3.0]), 2)
        # long enough that a slowdown from its step on has ten steps to show in (a real job runs
        # thousands; four steps, as first planned, left too few collectives to judge a 10 % slowdown)
        steps = 12
        rank = rng.randrange(world) if fault != "none" else -1
        fault_step = rng.randrange(1, 3)
        out.append(
            Run(f"{i:03d}-{fault}", world, tp, pp, virtual, zero, fault, rank, factor, fault_step, steps)
        )
    return out


def record(run: Run, out: Path, capacity: int = 0, capture: str = "native") -> float:
    """Record one run under `out`/`run.name`; returns the seconds it took (0 when already there)."""
    folder = out / run.name
    if (folder / "done").exists():
        return 0.0
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job = [
        f"--world={run.world}", f"--tp={run.tp}", f"--pp={run.pp}", f"--virtual={run.virtual}",
        f"--steps={run.steps}", f"--fault={run.fault}", f"--fault-rank={run.rank}",
        f"--fault-step={run.fault_step}", f"--factor={run.factor}", "--compute=timed",
        *(["--zero"] if run.zero else []),
    ]  # fmt: skip
    start = time.monotonic()
    code = run_traced(folder, run.name, job, capacity, capture)
    (folder / "done").write_text(json.dumps({"exit": code, "seconds": round(time.monotonic() - start, 1)}))
    (folder / "plan.json").write_text(json.dumps(asdict(run)))
    return time.monotonic() - start


USERS_SEED = 20261128  # held out: committed before its first recording, scored once with the final code
# recorded to develop against: 20261126, and 20261127, the first held-out seed, once it had been scored
USERS_LOOKED_AT = (20261126, 20261127)
# held out for the changes made after 20261128 was scored (the Flight Recorder ties, Megatrace logs of
# interleaved pipelines): its hang runs only (`--only hang-compute --runs 160`), committed before recording
USERS_HANG_SEED = 20261129
# one cycle of the users' plan: 10 healthy runs, 3 slowed by 20 % or more, 1 by 10 %, 2 hangs
USER_CLASSES = ("none",) * 10 + ("slow-compute",) * 4 + ("hang-compute",) * 2
# (world, pp, schedule): the schedules of torch.distributed.pipelining; interleaved ones hold two stages
USER_LAYOUTS = [
    (4, 2, "gpipe"),
    (4, 2, "1f1b"),
    (4, 4, "1f1b"),
    (4, 2, "interleaved"),
    (4, 2, "zero-bubble"),
    (4, 2, "zbv"),
    (8, 4, "1f1b"),
    (8, 4, "interleaved"),
    (8, 2, "gpipe"),
    (8, 4, "zbv"),
]
# the cgroup limit per rank of the job, 0: none (8 ranks peak near 2.2 GiB; 270 a rank thrashed into OOM)
MEMORY_PER_RANK_MIB = (0, 0, 290, 330)


@dataclass
class UserRun:
    """One planned run of the users' plan: the job, its fault and the host noise it runs under."""

    name: str
    world: int
    pp: int
    schedule: str
    dp_kind: str
    fault: str
    rank: int
    factor: float
    fault_step: int
    steps: int
    hogs: int
    duty: float
    noise_start_s: float
    memory_mib: int


def plan_users(runs: int, seed: int = USERS_SEED) -> list[UserRun]:
    """The users' plan (`--plan users`), from the seed alone: classes in turn, every other run of a class
    under noise (1 to 3 hogs at a duty cycle of 30 % to 90 %, starting 0 to 10 s in, and on some runs a
    memory limit)."""
    rng = random.Random(seed)
    out = []
    seen: dict[str, int] = {}
    for i in range(runs):
        fault = USER_CLASSES[i % len(USER_CLASSES)]
        world, pp, schedule = rng.choice(USER_LAYOUTS)
        dp_kind = rng.choice(("fsdp", "ddp"))
        factor = 0.0
        if fault == "slow-compute":
            factor = 0.1 if seen.get("slow", 0) % 4 == 3 else rng.choice([0.2, 0.3, 0.5, 1.0, 2.0])
            seen["slow"] = seen.get("slow", 0) + 1
        noisy = seen.get(fault, 0) % 2 == 1
        seen[fault] = seen.get(fault, 0) + 1
        hogs = rng.randint(1, 3) if noisy else 0
        duty = rng.choice([0.3, 0.6, 0.9]) if noisy else 0.0
        start = round(rng.uniform(0, 10), 1) if noisy else 0.0
        memory = rng.choice(MEMORY_PER_RANK_MIB) * world if noisy else 0
        rank = rng.randrange(world) if fault != "none" else -1
        fault_step = rng.randrange(1, 4)
        tag = "-noisy" if noisy else ""
        name = f"{i:03d}-{fault}{tag}"
        job = (name, world, pp, schedule, dp_kind, fault, rank, factor, fault_step, 12)
        out.append(UserRun(*job, hogs, duty, start, memory))
    return out


def record_user(run: UserRun, out: Path, capture: str = "native") -> float:
    """Record one run of the users' plan under its noise; returns the seconds it took (0: already there)."""
    folder = out / run.name
    if (folder / "done").exists():
        return 0.0
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job = [
        f"--world={run.world}", f"--pp={run.pp}", f"--schedule={run.schedule}", f"--dp-kind={run.dp_kind}",
        f"--steps={run.steps}", f"--fault={run.fault}", f"--fault-rank={run.rank}",
        f"--fault-step={run.fault_step}", f"--factor={run.factor}",
    ]  # fmt: skip
    start = time.monotonic()
    noise = HostNoise(run.name, run.hogs, run.duty, run.noise_start_s, run.memory_mib)
    with noise:
        code = run_traced(
            folder, run.name, job, capture=capture, module="tests.support.pipelining_job", cgroup=noise.cgroup
        )
    (folder / "noise.json").write_text(json.dumps(noise.summary()))
    (folder / "plan.json").write_text(json.dumps(asdict(run)))
    (folder / "done").write_text(json.dumps({"exit": code, "seconds": round(time.monotonic() - start, 1)}))
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path, help="corpus folder")
    parser.add_argument(
        "--plan", choices=("megatron", "users"), default="megatron", help="which plan (default megatron)"
    )
    parser.add_argument("--runs", type=int, help="runs to plan (default 154 megatron, 64 users)")
    parser.add_argument(
        "--seed",
        type=int,
        help=f"plan seed (default {SEED} megatron, {USERS_SEED} users, held out; users' seeds looked at: "
        f"{', '.join(map(str, USERS_LOOKED_AT))}; held out for hang runs: {USERS_HANG_SEED})",
    )
    parser.add_argument("--only", choices=CLASSES, help="record only runs of this class")
    parser.add_argument("--limit", type=int, help="record only the first N runs chosen")
    parser.add_argument(
        "--capacity", type=int, default=0, help="ring records per rank (default: the tracer's)"
    )
    parser.add_argument(
        "--capture",
        choices=("native", "python"),
        default="native",
        help="the tracer's capture (default native)",
    )
    args = parser.parse_args(argv)
    if args.plan == "users":
        chosen = plan_users(args.runs or 64, args.seed or USERS_SEED)
        users = [r for r in chosen if args.only in (None, r.fault)][: args.limit]
        for i, user in enumerate(users, 1):
            took = record_user(user, args.out, args.capture)
            print(f"[{i}/{len(users)}] {user.name} {user.schedule} pp {user.pp}: {took:.0f} s", flush=True)
        return 0
    runs = [r for r in plan(args.runs or 154, args.seed or SEED) if args.only in (None, r.fault)][
        : args.limit
    ]
    for i, run in enumerate(runs, 1):
        took = record(run, args.out, args.capacity, args.capture)
        print(
            f"[{i}/{len(runs)}] {run.name} world {run.world} tp {run.tp} pp {run.pp}: {took:.0f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
