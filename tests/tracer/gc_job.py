"""A torchrun worker (world size 2) whose data pipeline builds Python objects: a cache of samples that
keeps growing and cyclic garbage per step, so the garbage collector runs, full collections included.

Run under ``megatrace trace -- torchrun --nproc-per-node 2 gc_job.py``. The script knows nothing about
the tracer; its GC spans and host samples are the tracer's own doing.
"""

from __future__ import annotations

import datetime
import itertools

import torch
import torch.distributed as dist

STEPS = 30


def tokenized_batch(step: int, size: int = 20000) -> list[dict]:
    """Samples that refer to each other (cyclic garbage once the step is done)."""
    batch = [{"step": step, "ids": [step, i]} for i in range(size)]
    for previous, sample in itertools.pairwise(batch):
        sample["prev"] = previous
        previous["next"] = sample
    return batch


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    cache: list[dict] = []
    weights = torch.ones(64)
    for step in range(STEPS):
        batch = tokenized_batch(step)
        cache.extend({"kept": sample["ids"]} for sample in batch[::2])
        dist.all_reduce(weights)
        del batch
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
