"""A data-parallel training job on the CPU (gloo) whose ranks can misbehave the way real ranks do, for the
cause tests: run it with torchrun (``torchrun --nproc-per-node 3 -m tests.support.cause_job …``), under
``megatrace trace`` to trace it; it knows nothing about the tracer.

Every step a rank loads its batch through a ``DataLoader`` (from ``--read-from``: blocks of a file read
with ``O_DIRECT``, so the page cache never answers; else generated), optionally reads every page of its
own file-backed working set (``--working-set DIR``: ``DIR/rank-<N>.bin`` mapped into memory), computes
(``--work`` products of two 256×256 matrices plus a small MLP's forward and backward) and all-reduces
its gradients and loss over the world. It prints ``rank R step S local SECONDS`` (the time outside
collectives) after each step.

Faults that live in the job itself hit ``--fault-rank`` from ``--fault-step`` on: ``slow-loader`` (the
dataset takes ``--loader-s`` per item), ``gc-storm`` (the rank keeps a million objects of its own and
caches ``--retained`` more a step, so that the collector's full passes keep walking them all),
``flock`` (the rank takes an exclusive ``flock`` on ``--lock``, once) and ``fifo-checkpoint``
(``torch.save`` of the model to ``--checkpoint``, once). Faults from outside (CPU hogs, quotas,
memory limits, throttled reads) are the harness's (tests/support/host_faults.py).
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import mmap
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

FAULTS = ("none", "slow-loader", "gc-storm", "flock", "fifo-checkpoint")
WIDTH = 64
BATCH = 32
BLOCK = 1 << 16  # bytes a rank reads from --read-from for one batch
PAGE = mmap.PAGESIZE


class Samples(torch.utils.data.Dataset):
    """One batch per step: read with O_DIRECT from `source` when given, else drawn from a seeded
    generator; items from `slow_from` on take `slow_s` longer."""

    def __init__(self, steps: int, rank: int, source: str, slow_from: int, slow_s: float) -> None:
        self.steps, self.rank, self.source = steps, rank, source
        self.slow_from, self.slow_s = slow_from, slow_s
        self.buffer = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> torch.Tensor:
        if 0 <= self.slow_from <= index:
            time.sleep(self.slow_s)
        if not self.source:
            return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(index))
        fd = os.open(self.source, os.O_RDONLY | os.O_DIRECT)
        try:
            blocks = os.fstat(fd).st_size // BLOCK
            got = os.preadv(fd, [self.buffer], ((index * 7 + self.rank) % blocks) * BLOCK)
        finally:
            os.close(fd)
        raw = torch.frombuffer(bytearray(self.buffer[: got - got % 4]), dtype=torch.uint8)
        return (raw[: BATCH * WIDTH].float() / 255.0).reshape(BATCH, WIDTH)


class WorkingSet:
    """The rank's file-backed memory: `path` mapped, every page read once a step."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "rb")  # noqa: SIM115 - mapped for the whole run
        self.map = mmap.mmap(self.file.fileno(), 0, prot=mmap.PROT_READ)

    def touch(self) -> int:
        total = 0
        for offset in range(0, len(self.map), PAGE):
            total += self.map[offset]
        return total


def take_lock(path: str) -> int:
    """Take the exclusive lock every rank's checkpoint manager shares (blocks while another holds it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def write_checkpoint(model: torch.nn.Module, path: str) -> None:
    """Save the model's weights (a FIFO nobody reads never lets the open return)."""
    torch.save(model.state_dict(), path)


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    faulty = rank == args.fault_rank
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 256), torch.nn.GELU(), torch.nn.Linear(256, WIDTH))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    slow_from = args.fault_step if faulty and args.fault == "slow-loader" else -1
    loader = torch.utils.data.DataLoader(
        Samples(args.steps, rank, args.read_from, slow_from, args.loader_s), batch_size=None
    )
    working = WorkingSet(Path(args.working_set) / f"rank-{rank}.bin") if args.working_set else None
    own_objects: list = []
    square = torch.full((256, 256), 0.01)
    started = time.perf_counter()
    for step, x in enumerate(loader):
        due = faulty and step >= args.fault_step
        if due and args.fault == "gc-storm":
            own_objects = own_objects or [{"n": i} for i in range(1_000_000)]
            own_objects.extend([{"step": step, "n": i}] for i in range(args.retained))
        if due and step == args.fault_step and args.fault == "flock":
            print(f"cause_job: rank {rank} takes the lock {args.lock}", file=sys.stderr, flush=True)
            take_lock(args.lock)
        if due and step == args.fault_step and args.fault == "fifo-checkpoint":
            print(f"cause_job: rank {rank} checkpoints to {args.checkpoint}", file=sys.stderr, flush=True)
            write_checkpoint(model, args.checkpoint)
        if working is not None:
            working.touch()
        for _ in range(args.work):
            square = (square @ square).clamp_(-1.0, 1.0)
        loss = (model(x) - x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        local = time.perf_counter() - started
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world
        optimizer.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        print(f"rank {rank} step {step} local {local:.4f}", flush=True)
        started = time.perf_counter()
    dist.barrier()
    dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.support.cause_job", description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--work", type=int, default=20, help="256×256 matrix products a step")
    p.add_argument("--read-from", default="", help="file the loader reads its batches from (O_DIRECT)")
    p.add_argument("--working-set", default="", help="folder of rank-<N>.bin files each rank maps and reads")
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-rank", type=int, default=-1)
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument("--loader-s", type=float, default=0.2, help="slow-loader: seconds per item")
    p.add_argument("--retained", type=int, default=100_000, help="gc-storm: objects cached a step")
    p.add_argument("--lock", default="", help="flock: the file to lock")
    p.add_argument("--checkpoint", default="", help="fifo-checkpoint: where torch.save writes")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout (s)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    needs = {"flock": args.lock, "fifo-checkpoint": args.checkpoint}
    if args.fault in needs and not needs[args.fault]:
        print(f"cause_job: --fault {args.fault} needs its path (--lock / --checkpoint)", file=sys.stderr)
        return 2
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
