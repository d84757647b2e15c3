"""One training job on a running local stack, timed from its fault to its first page.

Shared by the time-to-page benchmark (real speed) and its test (compressed time): the job runs under
`megatrace trace`; the moment a rank hangs is when the fault injection reports it in the job's log;
a page is a firing P0 card for the job in the bot's console output (`messages.jsonl`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

from megatrace.demo import Scenario, card_text, headline_rank, read_messages, training_job
from megatrace.stack_config import StackConfig

HANG_MARK = "megatrace fault injection:"


@dataclasses.dataclass
class PageRun:
    """What one run showed: when the fault struck (monotonic seconds, None: no fault or not seen),
    its first page (None: none) and when it was seen, and every P0 card of the job."""

    job: str
    fault_at: float | None
    page: dict[str, object] | None
    page_at: float | None
    pages: int

    @property
    def time_to_page(self) -> float | None:
        if self.fault_at is None or self.page_at is None:
            return None
        return self.page_at - self.fault_at

    def names(self, rank: int) -> bool:
        return self.page is not None and headline_rank(self.page) == rank


def pages_of(messages: Path, job: str) -> list[dict[str, object]]:
    """The job's P0 firing cards delivered so far."""
    return [
        m
        for m in read_messages(messages)
        if m.get("kind") == "firing" and m.get("level") == "P0" and job in card_text(m)
    ]


def run_job(
    config: StackConfig,
    job: str,
    scenario: Scenario,
    env: dict[str, str],
    extra_args: Sequence[str],
    watch_s: float,
    stop_at_page: bool = True,
    poll_s: float = 0.1,
) -> PageRun:
    """Run the job for up to `watch_s` seconds after it started (or until its first page when
    `stop_at_page`), watching its log for the fault and the bot's output for its pages."""
    state = Path(config.state_dir)
    log = state / "logs" / f"{job}.log"
    messages = state / "messages.jsonl"
    fault_at = page_at = None
    page = None
    with training_job(config, job, scenario, env, log, extra_args):
        deadline = time.monotonic() + watch_s
        while time.monotonic() < deadline:
            now = time.monotonic()
            if fault_at is None and log.exists() and HANG_MARK in log.read_text(errors="replace"):
                fault_at = now
            found = pages_of(messages, job)
            if found and page is None:
                page, page_at = found[0], now
                if stop_at_page:
                    break
            time.sleep(poll_s)
    return PageRun(job, fault_at, page, page_at, len(pages_of(messages, job)))
