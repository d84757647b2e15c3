"""A torchrun worker (world size 2) issuing all-reduces through every path real frameworks use.

Run under ``megatrace trace -- torchrun --nproc-per-node 2 paths_job.py``. Each section ends with
``mark_step`` so the test can tell the sections apart by the records' step: `SECTIONS` lists, in
order, the path and how many all-reduces it issues; then FSDP-style reduce-scatters and all-gathers
(`FSDP_OPS`) and a send/recv pair. Setup (step 0) includes one DDP iteration: DDP puts all gradients
in one bucket in its first iteration and buckets them by size from the second one.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import megatrace.tracer

# (path, all-reduces it issues); step k of the records is section k (step 0: setup).
SECTIONS = [
    ("ddp_reducer", 4),
    ("dist_all_reduce", 4),
    ("functional", 4),
    ("pg_method", 4),
    ("compiled", 3),
]
# The FSDP-style step after them: (op, how many).
FSDP_OPS = [("reduce_scatter", 2), ("all_gather", 2)]
BUCKET_FLOATS = 300_000  # 1.2 MB per parameter: DDP's 1 MB first bucket and 1 MB buckets hold one each


class FourBuckets(torch.nn.Module):
    """Four parameters, each too big to share a DDP gradient bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(BUCKET_FLOATS)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((w * x).sum() for w in self.weights)


@torch.compile(backend="aot_eager", fullgraph=True)
def three_all_reduces(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    for _ in range(3):
        x = funcol.all_reduce(x, "sum", group)
    return x


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    world = dist.group.WORLD
    model = torch.nn.parallel.DistributedDataParallel(FourBuckets(), bucket_cap_mb=1)
    model(torch.ones(BUCKET_FLOATS)).backward()
    megatrace.tracer.mark_step()

    model(torch.ones(BUCKET_FLOATS)).backward()
    megatrace.tracer.mark_step()

    for _ in range(4):
        dist.all_reduce(torch.ones(8))
    megatrace.tracer.mark_step()

    for _ in range(4):
        funcol.wait_tensor(funcol.all_reduce(torch.ones(8), "sum", world))
    megatrace.tracer.mark_step()

    for _ in range(4):
        world.allreduce([torch.ones(8)]).wait()
    megatrace.tracer.mark_step()

    assert three_all_reduces(torch.ones(8), world)[0].item() == 8.0
    megatrace.tracer.mark_step()

    shard = torch.zeros(4)
    funcol.wait_tensor(funcol.reduce_scatter_single(torch.ones(8), "sum", 0, world))
    dist.reduce_scatter_single(shard, torch.ones(8), async_op=True).wait()
    funcol.wait_tensor(funcol.all_gather_single(shard, 0, world))
    dist.all_gather_single(torch.zeros(8), shard, async_op=True).wait()
    megatrace.tracer.mark_step()

    if rank == 0:
        dist.send(torch.ones(3), dst=1)
    else:
        dist.recv(torch.zeros(3), src=0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
