"""A small tensor- and data-parallel training job on CPU (gloo), for tests and demos of the tracer.

``python -m megatrace.tracer.example_train --nprocs 4 --steps 20 --tp 2`` starts 4 worker processes
(as torchrun would: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in their environment) that train
a two-layer MLP split Megatron-style over TP groups, with gradients all-reduced over DP groups
(both made with ``new_group``). The tracer is on when the environment enables it
(``MEGATRACE_TRACE_ENABLE=1``), faults included.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

import megatrace.tracer
from megatrace.tracer.example_pauses import Batches, Pause, act_out, hang_in_optimizer, parse_pause


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the TP group backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce over the TP group forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class ParallelMLP(torch.nn.Module):
    """Column-parallel then row-parallel linear layer: this rank holds 1/tp of the hidden units."""

    def __init__(self, width: int, hidden: int, tp: int, tp_group: dist.ProcessGroup) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.up = torch.nn.Linear(width, hidden // tp)
        self.down = torch.nn.Linear(hidden // tp, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensorParallel.apply(x, self.tp_group)
        x = torch.nn.functional.gelu(self.up(x))
        return _ReduceFromTensorParallel.apply(self.down(x), self.tp_group)


def make_groups(world: int, tp: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's TP group (consecutive ranks) and DP group (same TP position); all ranks create all."""
    rank = dist.get_rank()
    tp_group = dp_group = None
    for start in range(0, world, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            tp_group = group
    for position in range(tp):
        group = dist.new_group(list(range(position, world, tp)))
        if rank % tp == position:
            dp_group = group
    assert tp_group is not None and dp_group is not None
    return tp_group, dp_group


def train(
    steps: int,
    tp: int,
    width: int,
    hidden: int,
    batch: int,
    timeout_s: float,
    pauses: Sequence[Pause] = (),
    optimizer_hang: tuple[int, int] | None = None,
) -> None:
    """The worker: join the job, train for `steps` steps, leave; act out this rank's `pauses`, and
    hang inside the optimizer step when `optimizer_hang` (rank, step) names it."""
    torch.set_num_threads(1)
    megatrace.tracer.install()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_group, dp_group = make_groups(world, tp)
    torch.manual_seed(1234 + rank % tp)
    model = ParallelMLP(width, hidden, tp, tp_group)
    dp_ranks = dist.get_process_group_ranks(dp_group)
    for param in model.parameters():
        dist.broadcast(param.data, src=min(dp_ranks), group=dp_group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if optimizer_hang is not None and optimizer_hang[0] == rank:
        hang_in_optimizer(optimizer, optimizer_hang[1])
    dp_size = len(dp_ranks)
    mine = [p for p in pauses if p.rank == rank]
    slow = next((p for p in mine if p.kind == "dataloader"), Pause("dataloader", rank, -1, 0.0))
    loader = torch.utils.data.DataLoader(
        Batches(batch, width, 99 + rank // tp, slow.step, slow.seconds), batch_size=None
    )
    for step, x in zip(range(steps), loader, strict=False):
        for pause in mine:
            if pause.step == step and pause.kind != "dataloader":
                act_out(pause, model)
        loss = (model(x) - x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad, group=dp_group)
            param.grad /= dp_size
        optimizer.step()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        if rank == 0:
            print(f"step {step} loss {reported.item() / world:.5f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(nprocs: int, worker_args: list[str], grace_s: float = 5.0) -> int:
    """Start `nprocs` workers as torchrun would and wait; when one fails, stop the others after a grace."""
    port = _free_port()
    procs = []
    for rank in range(nprocs):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nprocs),
            LOCAL_WORLD_SIZE=str(nprocs),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        argv = [sys.executable, "-m", "megatrace.tracer.example_train", "--worker", *worker_args]
        procs.append(subprocess.Popen(argv, env=env))

    def stop_all(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGTERM, stop_all)
    failed_at = None
    exit_code = 0
    while any(proc.poll() is None for proc in procs):
        failures = [proc.returncode for proc in procs if proc.returncode not in (None, 0)]
        if failures and failed_at is None:
            failed_at, exit_code = time.monotonic(), failures[0]
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        time.sleep(0.05)
    codes = [proc.returncode for proc in procs]
    return exit_code or next((code for code in codes if code), 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatrace.tracer.example_train", description=__doc__)
    parser.add_argument("--nprocs", type=int, default=4, help="number of ranks (default 4)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size; must divide --nprocs")
    parser.add_argument("--width", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--hidden", type=int, default=256, help="MLP hidden size, split over TP")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="collective timeout in seconds (default 600: an injected hang lasts past MegatraceJobHang's "
        "for: 2m before the ranks give up)",
    )
    parser.add_argument(
        "--pause",
        action="append",
        default=[],
        type=parse_pause,
        metavar="KIND:RANK:STEP:SECONDS",
        help="rank RANK pauses at step STEP for SECONDS: checkpoint (torch.save to a slow file), eval "
        "(model.eval() pass) or dataloader (a slow batch); repeatable",
    )
    parser.add_argument(
        "--hang-in-optimizer",
        metavar="RANK:STEP",
        default="",
        help="rank RANK hangs inside optimizer.step() of step STEP",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nprocs < 1 or args.tp < 1 or args.nprocs % args.tp or args.hidden % args.tp:
        print("example_train: --tp must divide both --nprocs and --hidden", file=sys.stderr)
        return 2
    if args.steps < 0 or args.timeout <= 0:
        print("example_train: --steps must be >= 0 and --timeout > 0", file=sys.stderr)
        return 2
    try:
        rank_step = (
            [int(part) for part in args.hang_in_optimizer.split(":")] if args.hang_in_optimizer else []
        )
    except ValueError:
        rank_step = [-1]
    if args.hang_in_optimizer and (len(rank_step) != 2 or min(rank_step) < 0):
        print("example_train: --hang-in-optimizer expects RANK:STEP", file=sys.stderr)
        return 2
    if args.worker:
        hang = (rank_step[0], rank_step[1]) if rank_step else None
        train(args.steps, args.tp, args.width, args.hidden, args.batch, args.timeout, args.pause, hang)
        return 0
    worker_args = [
        f"--nprocs={args.nprocs}", f"--steps={args.steps}", f"--tp={args.tp}", f"--width={args.width}",
        f"--hidden={args.hidden}", f"--batch={args.batch}", f"--timeout={args.timeout}",
        *(f"--pause={p.kind}:{p.rank}:{p.step}:{p.seconds:g}" for p in args.pause),
        *([f"--hang-in-optimizer={args.hang_in_optimizer}"] if args.hang_in_optimizer else []),
    ]  # fmt: skip
    return launch(args.nprocs, worker_args)


if __name__ == "__main__":
    sys.exit(main())
