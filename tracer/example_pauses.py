"""Pauses and hangs the example training job can be told to act out, as real training does them:
a checkpoint written with ``torch.save`` to a slow file, an evaluation pass (``model.eval()``), a
data loader that takes long for one batch, and a hang inside the optimizer step. Used by the
time-to-page benchmark and tests: the tracer must tell the first three from a hang on its own.

A pause is ``KIND:RANK:STEP:SECONDS`` (``checkpoint:0:5:90``): rank RANK does it at the start of
step STEP for about SECONDS, while the other ranks wait for it in their next collective.
"""

from __future__ import annotations

import dataclasses
import io
import time
from collections.abc import Iterator

import torch

from megatrace.tracer.faults import hang_forever

KINDS = ("checkpoint", "eval", "dataloader")


@dataclasses.dataclass(frozen=True)
class Pause:
    kind: str
    rank: int
    step: int
    seconds: float


def parse_pause(text: str) -> Pause:
    """``KIND:RANK:STEP:SECONDS`` → Pause; ValueError naming what is wrong."""
    parts = text.split(":")
    if len(parts) != 4 or parts[0] not in KINDS:
        raise ValueError(f"expected KIND:RANK:STEP:SECONDS with KIND one of {', '.join(KINDS)}, got {text!r}")
    pause = Pause(parts[0], int(parts[1]), int(parts[2]), float(parts[3]))
    if pause.rank < 0 or pause.step < 0 or pause.seconds < 0:
        raise ValueError(f"rank, step and seconds must not be negative, got {text!r}")
    return pause


class SlowFile(io.RawIOBase):
    """A write-only file that takes `seconds` to take its first write (a stalled file system)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if self.seconds:
            time.sleep(self.seconds)
            self.seconds = 0.0
        self.size += len(data)
        return len(data)


def act_out(pause: Pause, model: torch.nn.Module) -> None:
    """The pause `pause` on this rank, now (checkpoint and eval; a data-loader pause is `batches`')."""
    if pause.kind == "checkpoint":
        torch.save(model.state_dict(), SlowFile(pause.seconds))
    elif pause.kind == "eval":
        model.eval()
        deadline = time.monotonic() + pause.seconds
        with torch.no_grad():
            while time.monotonic() < deadline:  # an evaluation pass with no collectives of its own
                time.sleep(0.05)
        model.train()


class Batches(torch.utils.data.IterableDataset):
    """Random batches from a seeded generator; batch `slow_step` takes `slow_s` longer to load."""

    def __init__(self, batch: int, width: int, seed: int, slow_step: int = -1, slow_s: float = 0.0) -> None:
        self.batch, self.width, self.seed = batch, width, seed
        self.slow_step, self.slow_s = slow_step, slow_s

    def __iter__(self) -> Iterator[torch.Tensor]:
        data = torch.Generator().manual_seed(self.seed)
        step = 0
        while True:
            if step == self.slow_step:
                time.sleep(self.slow_s)
            yield torch.randn(self.batch, self.width, generator=data)
            step += 1


def hang_in_optimizer(optimizer: torch.optim.Optimizer, at_step: int) -> None:
    """Make `optimizer.step()` hang for good from its `at_step`-th call (0-based) on."""
    calls = iter(range(1 << 62))

    def pre_hook(*_: object) -> None:
        if next(calls) >= at_step:
            hang_forever(f"hang inside optimizer step {at_step}")

    optimizer.register_step_pre_hook(pre_hook)
