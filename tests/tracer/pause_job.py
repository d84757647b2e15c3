"""A torchrun worker (world size 2) that checkpoints, evaluates and loads data the usual way.

Run under ``megatrace trace -- torchrun --nproc-per-node 2 pause_job.py`` with ``PAUSE_JOB_OUT`` set to
a folder. The training code knows nothing about the tracer: only `observe` reads the rank's own ring
header, at chosen moments (from inside `torch.save`'s pickling, a dataset's `__getitem__`, ...), to
record what the tracer said then; the observations and the bounds of the checkpoint calls go to
``<PAUSE_JOB_OUT>/rank-<N>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatrace.tracer.ringfile import read_header

OUT = Path(os.environ["PAUSE_JOB_OUT"])
FAST_OPS = 150
observations: dict[str, dict] = {}
spans: dict[str, tuple[int, int]] = {}


def observe(name: str) -> None:
    """What the rank's ring header says now: the pause kind, and per kind since when and how many ended."""
    path = Path(os.environ["MEGATRACE_TRACE_DIR"]) / os.environ["MEGATRACE_TRACE_JOB"]
    header = read_header(path / f"rank-{dist.get_rank()}.trace")
    observations[name] = {
        "kind": header.pause_kind,
        "since": {kind: pause.since_ns for kind, pause in header.pauses.items()},
        "ended": {kind: pause.ended for kind, pause in header.pauses.items()},
    }


class Probe:
    """Observes when it is pickled (inside whatever saves it)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple:
        observe(self.name)
        return (str, (self.name,))


class SlowDataset(torch.utils.data.Dataset):
    """Three items; rank 0 takes 0.3 s for each, and observes while it does."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, index: int) -> torch.Tensor:
        observe(f"getitem-{index}")
        if dist.get_rank() == 0:
            time.sleep(0.3)
        return torch.ones(2)


def timed(name: str, call, *args, **kwargs) -> None:
    start = time.time_ns()
    call(*args, **kwargs)
    spans[name] = (start, time.time_ns())


def main() -> None:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    for _ in range(FAST_OPS):
        dist.all_reduce(torch.ones(4))
    if rank == 1:
        time.sleep(0.3)  # rank 0 waits in this all-reduce
    dist.all_reduce(torch.ones(4))
    observe("start")

    folder = OUT / f"save-{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    timed("torch_save", torch.save, {"probe": Probe("in-torch-save")}, folder / "plain.pt")
    observe("after-torch-save")
    # each rank's probe under a key of its own (the planner would have one rank save a shared one)
    state = {"w": torch.ones(4), f"probe-{rank}": Probe("in-dcp-save")}
    timed("dcp_save", dcp.save, state, checkpoint_id=OUT / "dcp")
    observe("after-dcp-save")
    restored = {"w": torch.zeros(4)}
    timed("dcp_load", dcp.load, restored, checkpoint_id=OUT / "dcp")
    assert restored["w"].sum().item() == 4
    observe("after-dcp-load")

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        observe("in-no-grad")
        model(torch.ones(1, 4))
    model.eval()
    observe("in-eval")
    with torch.no_grad():
        dist.all_reduce(model(torch.ones(1, 4)))
    model.train()
    observe("after-eval")

    teacher = torch.nn.Linear(4, 1)
    teacher.eval()  # a frozen model, never switched back: its eval pause ends with the next step
    observe("teacher-eval")
    loss = model(torch.ones(1, 4)).sum() + teacher(torch.ones(1, 4)).sum().detach()
    loss.backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)
    optimizer.step()
    observe("after-step")

    for batch in torch.utils.data.DataLoader(SlowDataset(), batch_size=1, num_workers=0):
        dist.all_reduce(batch)  # rank 1 waits here while rank 0 loads
    observe("after-loader")

    (OUT / f"rank-{rank}.json").write_text(json.dumps({"observations": observations, "spans": spans}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
