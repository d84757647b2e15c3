"""A torchrun worker (world size 4) that issues every traced op once, sync and async, on several groups.

Run under ``megatrace trace -- torchrun --nproc-per-node 4 ops_job.py``; the script itself knows
nothing about the tracer. `CALLS` lists, in order, what each rank records: (op, group, nbytes, async).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

WORLD, PAIRS, EVEN_ODD = "world", "pairs", "even_odd"  # pairs: {0,1},{2,3}; even_odd: {0,2},{1,3}
F32 = 4
CALLS = [
    ("all_reduce", WORLD, 10 * F32, False),
    ("all_reduce", PAIRS, 6 * 8, False),
    ("all_reduce", EVEN_ODD, 3 * F32, True),
    ("broadcast", WORLD, 5 * F32, False),
    ("reduce", WORLD, 5 * F32, False),
    ("all_gather", WORLD, 2 * F32, False),
    ("all_gather", PAIRS, 2 * F32, False),
    ("all_gather", WORLD, 2 * F32, True),
    ("all_gather", WORLD, 2 * F32, False),
    ("reduce_scatter", WORLD, 2 * F32, False),
    ("reduce_scatter", EVEN_ODD, 2 * F32, True),
    ("all_to_all", WORLD, 8 * F32, False),
    ("all_to_all", WORLD, 4 * F32, True),
    ("gather", WORLD, 3 * F32, False),
    ("scatter", WORLD, 3 * F32, False),
    ("barrier", WORLD, 0, False),
    ("barrier", PAIRS, 0, True),
    ("send_recv", PAIRS, 4 * F32, False),
    ("isend_irecv", EVEN_ODD, 4 * F32, True),
    ("batch", WORLD, 4 * F32, True),
]


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4
    groups = {
        WORLD: None,
        PAIRS: [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2],
        EVEN_ODD: [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2],
    }
    g = groups
    dist.all_reduce(torch.ones(10), group=g[WORLD])
    dist.all_reduce(torch.ones(2, 3, dtype=torch.float64), group=g[PAIRS])
    dist.all_reduce(torch.ones(3), group=g[EVEN_ODD], async_op=True).wait()
    dist.broadcast(torch.ones(5), src=1)
    dist.reduce(torch.ones(5), dst=2)
    dist.all_gather([torch.zeros(2) for _ in range(4)], torch.ones(2))
    dist.all_gather([torch.zeros(2) for _ in range(2)], torch.ones(2), group=g[PAIRS])
    dist.all_gather_into_tensor(torch.zeros(8), torch.ones(2), async_op=True).wait()
    dist._all_gather_base(torch.zeros(8), torch.ones(2))
    dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(8))
    dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(4), group=g[EVEN_ODD], async_op=True).wait()
    dist.all_to_all_single(torch.zeros(8), torch.ones(8))
    dist.all_to_all(
        [torch.zeros(1) for _ in range(4)], [torch.ones(1) for _ in range(4)], async_op=True
    ).wait()
    dist.gather(torch.ones(3), [torch.zeros(3) for _ in range(4)] if rank == 0 else None, dst=0)
    dist.scatter(torch.zeros(3), [torch.ones(3) for _ in range(4)] if rank == 3 else None, src=3)
    dist.barrier()
    dist.barrier(group=g[PAIRS], async_op=True).wait()
    pair_peer = rank ^ 1
    if rank % 2 == 0:
        dist.send(torch.ones(4), dst=pair_peer, group=g[PAIRS])
    else:
        dist.recv(torch.zeros(4), src=pair_peer, group=g[PAIRS])
    even_odd_peer = rank ^ 2
    if rank < 2:
        dist.isend(torch.ones(4), dst=even_odd_peer, group=g[EVEN_ODD]).wait()
    else:
        dist.irecv(torch.zeros(4), src=even_odd_peer, group=g[EVEN_ODD]).wait()
    right, left = (rank + 1) % world, (rank - 1) % world
    ops = [dist.P2POp(dist.isend, torch.ones(4), right), dist.P2POp(dist.irecv, torch.zeros(4), left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
