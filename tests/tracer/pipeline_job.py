"""A torchrun worker (world size 4): two pipeline stages, each data-parallel over two ranks with DDP.

Ranks 0,1 are stage 0 and ranks 2,3 stage 1; DP groups {0,1} and {2,3}, PP groups {0,2} and {1,3},
all made with ``new_group``. Step 0 is setup and DDP's first iteration (one bucket); in step 1 stage 0
sends its activations to its stage-1 peer, and every rank runs a DDP backward whose gradients fill
`BUCKETS` buckets, all-reduced by DDP's C++ reducer over the rank's DP group.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import megatrace.tracer

BUCKETS = 2
FLOATS = 300_000  # 1.2 MB per parameter: one per DDP bucket from the second iteration on
ACTIVATION = 16


class Stage(torch.nn.Module):
    """`BUCKETS` parameters, each too big to share a DDP gradient bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(FLOATS)) for _ in range(BUCKETS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((w[:ACTIVATION] * x).sum() for w in self.weights)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, pp = dp_groups[rank // 2], pp_groups[rank % 2]
    model = torch.nn.parallel.DistributedDataParallel(Stage(), process_group=dp, bucket_cap_mb=1)
    model(torch.ones(ACTIVATION)).backward()
    megatrace.tracer.mark_step()

    activation = torch.ones(ACTIVATION)
    if rank < 2:
        dist.send(activation, dst=rank + 2, group=pp)
    else:
        dist.recv(activation, src=rank - 2, group=pp)
    model(activation).backward()
    megatrace.tracer.mark_step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
