"""A PP × DP training job built the way users build one with PyTorch's own libraries, on the CPU (gloo).

``python -m tests.support.pipelining_job --world 8 --pp 4 --schedule 1f1b --dp-kind fsdp --out DIR``
starts `world` worker processes as torchrun would (``tests.support.megatron_job``'s launcher: Flight
Recorder dumps at the end or, for a hang, when the launcher asks; ``label.json`` says what was
injected). Ranks are laid out as a ``(pp, dp)`` device mesh (data-parallel rank fastest, Megatron's
order). Each rank's stages are ``torch.distributed.pipelining.PipelineStage``s run by one of torch's
schedules: ``gpipe`` (``ScheduleGPipe``), ``1f1b`` (``Schedule1F1B``), ``interleaved``
(``ScheduleInterleaved1F1B``, two stages a rank), ``zero-bubble`` (``ScheduleInterleavedZeroBubble``)
or ``zbv`` (``ScheduleZBVZeroBubble``, V-shaped: a rank holds a first-half and a mirrored second-half
stage). The data-parallel dimension is FSDP2's ``fully_shard`` or DDP; every step ends with the loss
all-reduced over the world, as a training loop that logs it does.

Compute is timed (each rank's "device" is its own): a stage's forward and backward each take
``--units`` × ``--unit-ms``. Faults, on ``--fault-rank`` from ``--fault-step`` on: ``slow-compute``
multiplies its compute by ``1 + factor``; ``hang-compute`` blocks forever in a forward.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from tests.support.megatron_job import add_run_arguments, dump_flight_recorder, fr_dumper, launch

FAULTS = ("none", "hang-compute", "slow-compute")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "zbv")
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zero-bubble": 2, "zbv": 2}
WIDTH = 32


class _Job:
    """One rank's view: its mesh coordinates, the faults it carries and its step."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.torch, self.dist, self.args = torch, dist, args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp = self.world // args.pp
        self.mesh = init_device_mesh("cpu", (args.pp, self.dp), mesh_dim_names=("pp", "dp"))
        self.pp_rank = self.rank // self.dp
        self.faulty = args.fault != "none" and self.rank == args.fault_rank
        self.step = 0
        self.out = args.out

    def due(self, kind: str) -> bool:
        return self.faulty and self.args.fault == kind and self.step >= self.args.fault_step

    def compute(self) -> None:
        """One forward's or backward's device time; a hang blocks here for good."""
        if self.due("hang-compute"):
            Path(self.args.out, f"hang-{self.rank}").write_text("in the forward pass")
            print(f"pipelining_job: rank {self.rank} hangs", file=sys.stderr, flush=True)
            threading.Event().wait()
        factor = 1.0 + (self.args.factor if self.due("slow-compute") else 0.0)
        time.sleep(self.args.units * self.args.unit_ms * factor / 1000)


def _stage_module(job: _Job, index: int):
    """A stage: two linear layers around timed compute, forward and backward."""
    torch = job.torch

    class Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            job.compute()
            return x.clone()

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            job.compute()
            return grad

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(WIDTH, WIDTH)
            self.second = torch.nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return self.second(Timed.apply(torch.tanh(self.first(x))))

    torch.manual_seed(11 + index)
    return Stage()


def _stage_indices(job: _Job) -> list[int]:
    """The pipeline stages this rank holds: loop-style for interleaved schedules, V-style for zbv."""
    pp, per = job.args.pp, STAGES_PER_RANK[job.args.schedule]
    if per == 1:
        return [job.pp_rank]
    if job.args.schedule == "zbv":
        return [job.pp_rank, 2 * pp - 1 - job.pp_rank]
    return [job.pp_rank + k * pp for k in range(per)]


def _data_parallel(job: _Job, module):
    """The stage's module sharded with FSDP2 or wrapped in DDP over the data-parallel group."""
    if job.dp == 1:
        return module
    if job.args.dp_kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(module, mesh=job.mesh["dp"])
        return module
    return job.torch.nn.parallel.DistributedDataParallel(
        module, process_group=job.mesh["dp"].get_group(), static_graph=True
    )


def _schedule(job: _Job, stages: list):
    from torch.distributed import pipelining as p

    loss = job.torch.nn.functional.mse_loss
    kinds = {
        "gpipe": p.ScheduleGPipe,
        "1f1b": p.Schedule1F1B,
        "interleaved": p.ScheduleInterleaved1F1B,
        "zero-bubble": p.ScheduleInterleavedZeroBubble,
        "zbv": p.ScheduleZBVZeroBubble,
    }
    kind = kinds[job.args.schedule]
    if STAGES_PER_RANK[job.args.schedule] == 1:
        return kind(stages[0], n_microbatches=job.args.micro, loss_fn=loss)
    return kind(stages, n_microbatches=job.args.micro, loss_fn=loss)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    faulthandler.register(signal.SIGUSR1)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    job = _Job(args)
    total = args.pp * STAGES_PER_RANK[args.schedule]
    pp_group = job.mesh["pp"].get_group()
    stages, modules = [], []
    for index in _stage_indices(job):
        module = _data_parallel(job, _stage_module(job, index))
        modules.append(module)
        stages.append(PipelineStage(module, index, total, torch.device("cpu"), group=pp_group))
    schedule = _schedule(job, stages)
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.001)
    stop = threading.Event()
    threading.Thread(target=fr_dumper, args=(job, stop), daemon=True).start()
    batch = args.micro * 4
    first = 0 in _stage_indices(job)
    last = total - 1 in _stage_indices(job)
    for step in range(args.steps):
        job.step = step
        optimizer.zero_grad()
        x = torch.full((batch, WIDTH), 0.1 * (step + 1))
        losses: list = []
        schedule.step(
            *([x] if first else []), target=torch.zeros(batch, WIDTH) if last else None, losses=losses
        )
        optimizer.step()
        value = torch.stack(losses).mean().reshape(1) if losses else torch.zeros(1)
        dist.all_reduce(value)
    stop.set()
    dump_flight_recorder(job)
    dist.barrier()
    dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.support.pipelining_job", description=__doc__)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--dp-kind", choices=("fsdp", "ddp"), default="fsdp")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--micro", type=int, default=4, help="microbatches per step")
    p.add_argument("--units", type=int, default=10, help="compute units per forward or backward")
    p.add_argument("--unit-ms", type=float, default=2.0, help="a compute unit's duration")
    add_run_arguments(p, FAULTS, deadline=300.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.world % args.pp or (args.fault != "none" and not 0 <= args.fault_rank < args.world):
        print(
            "pipelining_job: pp must divide --world; a fault needs --fault-rank in the world", file=sys.stderr
        )
        return 2
    if args.worker:
        worker(args)
        return 0
    label = {
        "world": args.world, "tp": 1, "pp": args.pp, "dp": args.world // args.pp, "virtual":
        STAGES_PER_RANK[args.schedule], "schedule": args.schedule, "dp_kind": args.dp_kind,
        "fault": args.fault, "rank": args.fault_rank, "factor": args.factor, "step": args.fault_step,
    }  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "label.json").write_text(json.dumps(label))
    worker_argv = list(argv if argv is not None else sys.argv[1:])
    return launch(args, worker_argv, module="tests.support.pipelining_job")


if __name__ == "__main__":
    sys.exit(main())
