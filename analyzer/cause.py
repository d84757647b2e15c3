"""Why the culprit is hung or slow: one cause class with its evidence (the report's ``why``).

The tracer samples each rank's own process and cgroup into its ring header (run-queue delay, CPU quota
throttling, memory limit hits, I/O waits, GC and data-loader time; ``HostSample``) and its stall dumps
carry every thread's Python stack. Here the culprit's signals over the window that matters (the whole
trace for a slow rank, the time since it stopped for a hung one) are compared with the same signals of
its peers: a class is named only when the culprit's value reaches the signal's floor *and* stands
clear of its peers' median, so a host loaded uniformly, or a fault on a rank that is not the culprit,
names no cause (``unknown``). A hung rank whose main thread sits in Python code outside any collective
is ``python``, with the frame. GPU and network classes come from the node's counters, which only the
bot's drill-down sees (``megatrace.alertbot.drilldown``).

The classes are checked in `SIGNALS` order, most specific first: a quota shows as run-queue delay
too, memory pressure as I/O waits, an I/O stall in a loader as data-loader time, and contention for
the CPU slows a rank's garbage collections and its data loading alike (their shares of its time stay).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from megatrace.analyzer.frames import where_stuck
from megatrace.analyzer.table import RankInfo, TraceTable
from megatrace.tracer.format import OP_GC, OP_PAUSE, PAUSE_KIND_CODES
from megatrace.tracer.ringfile import HostSample

# Every class `why` can name (the contract with the bot, whose card has words and a first step for
# each but `unknown`); `gpu` and `network` are named by the bot's drill-down.
CLASSES = (
    "gpu",
    "network",
    "cpu_contention",
    "cpu_quota",
    "memory_pressure",
    "io_stall",
    "dataloader",
    "gc",
    "python",
    "unknown",
)
# A culprit's value must be at least this many times its peers' median (and above the floor).
PEER_RATIO = 2.0
_DATALOADER = PAUSE_KIND_CODES["dataloader"]


@dataclasses.dataclass(frozen=True)
class Window:
    """One rank between two of its host samples: the first, the last, how many lie between, and the
    rank's own time there (ns): the wall time it did not spend waiting in collectives."""

    first: HostSample
    last: HostSample
    samples: int
    own_ns: int = 0

    @property
    def wall_ns(self) -> int:
        return self.last.time_ns - self.first.time_ns

    def delta(self, field: str) -> int | None:
        """How much the cumulative counter `field` grew (None where either sample lacks it)."""
        before, after = getattr(self.first, field), getattr(self.last, field)
        if before < 0 or after < 0:
            return None
        return max(0, after - before)

    def share(self, field: str) -> float | None:
        """The counter's growth (ns) as a share of the wall time between the samples."""
        grown = self.delta(field)
        return None if grown is None else grown / self.wall_ns

    def own_share(self, field: str) -> float | None:
        """The counter's growth (ns) as a share of the rank's own time between the samples."""
        grown = self.delta(field)
        return None if grown is None else min(1.0, grown / max(self.own_ns, 1))


@dataclasses.dataclass(frozen=True)
class Signal:
    """One measure of a cause: its class, its name in the evidence line, how to print it, and the
    value the culprit must reach (in the measure's own unit) before it can name the class."""

    cls: str
    name: str
    measure: Callable[[Window], float | None]
    floor: float
    percent: bool = True
    detail: str = ""

    def show(self, value: float) -> str:
        return f"{value * 100:.0f} %" if self.percent else f"{value:.1f}"


def _throttled(window: Window) -> float | None:
    periods, throttled = window.delta("cfs_periods"), window.delta("cfs_throttled_periods")
    if periods is None or throttled is None:
        return None
    return throttled / periods if periods else 0.0


def _per_second(field: str) -> Callable[[Window], float | None]:
    def rate(window: Window) -> float | None:
        grown = window.delta(field)
        return None if grown is None else grown * 1e9 / window.wall_ns

    return rate


def _io_wait_share(window: Window) -> float | None:
    seen = window.delta("main_io_wait_samples")
    return None if seen is None or window.samples < 2 else seen / (window.samples - 1)


def _runq_per_cpu_second(window: Window) -> float | None:
    """Run-queue delay per second on a CPU: how much longer than its CPU time the rank's work took
    for want of a CPU. Not a share of wall: on any loaded host the rank that computes most is runnable
    most and so waits most (a GC storm, a heavier stage), which is not contention aimed at it."""
    runq, cpu = window.delta("runq_ns"), window.delta("cpu_ns")
    if runq is None or cpu is None:
        return None
    return runq / cpu if cpu else 0.0


def _share(field: str) -> Callable[[Window], float | None]:
    return lambda window: window.share(field)


def _own_share(field: str) -> Callable[[Window], float | None]:
    return lambda window: window.own_share(field)


# Time spent in a rank's own loop is counted against the time it did not wait in collectives: the slow
# rank waits least, so any share of *wall* it spends computing, collecting garbage or loading data is
# larger than its waiting peers' whatever slows it.
_OWN = "of its time outside collectives"

# Checked in this order; the first class whose signal stands out is named.
SIGNALS: tuple[Signal, ...] = (
    Signal("cpu_quota", "CPU quota throttling", _throttled, 0.10, detail="of scheduler periods"),
    Signal("memory_pressure", "cgroup memory limit hits", _per_second("memory_limit_hits"), 1.0, False, "/s"),
    Signal("memory_pressure", "memory high-mark events", _per_second("memory_high_events"), 1.0, False, "/s"),
    Signal("memory_pressure", "memory pressure stall", _share("memory_pressure_ns"), 0.05, detail="of wall"),
    Signal("memory_pressure", "major page faults", _per_second("major_faults"), 50.0, False, "/s"),
    Signal("io_stall", "main thread in I/O wait", _io_wait_share, 0.20, detail="of samples"),
    Signal("io_stall", "block I/O delay", _share("blkio_delay_ns"), 0.10, detail="of wall"),
    Signal("io_stall", "I/O pressure stall", _share("io_pressure_ns"), 0.10, detail="of wall"),
    Signal("gc", "garbage-collection pauses", _own_share("gc_ns"), 0.05, detail=_OWN),
    Signal("cpu_contention", "run-queue delay", _runq_per_cpu_second, 0.25, False, " s per CPU-second"),
    Signal("cpu_contention", "CPU pressure stall", _share("cpu_pressure_ns"), 0.10, detail="of wall"),
    Signal("dataloader", "DataLoader waits", _own_share("dataloader_ns"), 0.10, detail=_OWN),
)


def window_of(samples: Sequence[HostSample], start_ns: int, end_ns: int) -> Window | None:
    """The rank's samples over [start_ns, end_ns]: the first and last inside it where two are, else
    those bracketing it as closely as they allow (the last at or before the start, else the first; the
    last at or before the end, else the last); None when fewer than two distinct sample times remain.
    Samples inside are preferred: one taken before the traced window counts what the rank did before
    its first call (the imports' and the model's garbage collections, the data loaders' start), which
    its peers did too but over far less of their own time. Its own time is left unset (`with_own_time`)."""
    inside = [i for i, s in enumerate(samples) if start_ns <= s.time_ns <= end_ns]
    if len(inside) >= 2 and samples[inside[-1]].time_ns > samples[inside[0]].time_ns:
        return Window(samples[inside[0]], samples[inside[-1]], inside[-1] - inside[0] + 1)
    if len(samples) < 2:
        return None
    before = [i for i, s in enumerate(samples) if s.time_ns <= start_ns]
    first = before[-1] if before else 0
    until = [i for i, s in enumerate(samples) if s.time_ns <= end_ns]
    last = until[-1] if until else len(samples) - 1
    if last <= first:
        first, last = max(0, last - 1), max(last, 1)
    if samples[last].time_ns <= samples[first].time_ns:
        return None
    return Window(samples[first], samples[last], last - first + 1)


def collective_ns(table: TraceTable, rank: int, start_ns: int, end_ns: int) -> int:
    """How long in [start_ns, end_ns] `rank` had a collective in flight (the union of its calls'
    enqueue-to-completion intervals; a call never completed lasts to the end)."""
    mine = table["rank"] == rank
    begin = table["enqueue_ns"][mine].astype(np.int64)
    end = table["complete_ns"][mine].astype(np.int64)
    end = np.where(end > 0, end, end_ns)
    keep = (end > start_ns) & (begin < end_ns)
    begin, end = np.clip(begin[keep], start_ns, end_ns), np.clip(end[keep], start_ns, end_ns)
    if not len(begin):
        return 0
    order = np.argsort(begin, kind="stable")
    begin, end = begin[order], np.maximum.accumulate(end[order])
    # a call starts a new stretch where it begins after every earlier call ended
    starts = np.concatenate([[True], begin[1:] > end[:-1]])
    stretch = np.cumsum(starts) - 1
    first = begin[starts]
    last = np.zeros(len(first), dtype=np.int64)
    np.maximum.at(last, stretch, end)
    return int((last - first).sum())


def with_own_time(table: TraceTable, rank: int, window: Window) -> Window:
    """`window` with the rank's own time set: its wall time less its time in collectives."""
    start, end = window.first.time_ns, window.last.time_ns
    return dataclasses.replace(window, own_ns=window.wall_ns - collective_ns(table, rank, start, end))


def _span_share(
    table: TraceTable, info: RankInfo, op: int, start_ns: int, end_ns: int, kind: int | None
) -> float:
    """The share of the rank's own time in [start_ns, end_ns] it spent in span records of `op`
    (pause `kind`)."""
    spans = info.spans
    if spans is None or not len(spans) or end_ns <= start_ns:
        return 0.0
    keep = spans["op"] == op
    if kind is not None:
        keep &= spans["peer"] == kind
    begin = np.maximum(spans["enqueue_ns"][keep], start_ns)
    end = np.minimum(spans["complete_ns"][keep], end_ns)
    own = end_ns - start_ns - collective_ns(table, info.rank, start_ns, end_ns)
    return min(1.0, float(np.clip(end - begin, 0, None).sum()) / max(own, 1))


def _values(
    signal: Signal, windows: dict[int, Window], table: TraceTable, start_ns: int, end_ns: int
) -> dict[int, float]:
    """`signal` for every rank that can measure it. The GC and data-loader shares fall back to the
    span records where no host sample covers the window (files without samples, short windows)."""
    out = {}
    for rank, info in table.ranks.items():
        window = windows.get(rank)
        value = signal.measure(window) if window is not None else None
        if value is None and signal.cls in ("gc", "dataloader") and info.spans is not None:
            op, kind = (OP_GC, None) if signal.cls == "gc" else (OP_PAUSE, _DATALOADER)
            value = _span_share(table, info, op, start_ns, end_ns, kind)
        if value is not None:
            out[rank] = value
    return out


def _stands_out(signal: Signal, culprit: float, peers: list[float]) -> bool:
    if culprit < signal.floor:
        return False
    median = statistics.median(peers)
    return culprit >= PEER_RATIO * median and culprit - median >= signal.floor / 2


def _evidence(signal: Signal, rank: int, culprit: float, peers: list[float]) -> str:
    unit = f" {signal.detail}" if signal.detail and signal.percent else signal.detail
    median = statistics.median(peers)
    return (
        f"{signal.name} {signal.show(culprit)}{unit} on rank {rank}, "
        f"{signal.show(median)}{unit} median on its {len(peers)} peer(s)"
    )


def classify(table: TraceTable, rank: int, start_ns: int, end_ns: int) -> dict[str, Any]:
    """The cause class of `rank` over [start_ns, end_ns] against its peers: {"class", "evidence"}."""
    windows = {
        r: with_own_time(table, r, w)
        for r, info in table.ranks.items()
        if (w := window_of(info.host_samples, start_ns, end_ns))
    }
    measured = False
    for signal in SIGNALS:
        values = _values(signal, windows, table, start_ns, end_ns)
        if rank not in values:
            continue
        peers = [v for r, v in values.items() if r != rank]
        if not peers:
            continue
        measured = True
        if _stands_out(signal, values[rank], peers):
            return {"class": signal.cls, "evidence": _evidence(signal, rank, values[rank], peers)}
    if not measured:
        return {"class": "unknown", "evidence": "no host signals of the culprit and its peers to compare"}
    return {
        "class": "unknown",
        "evidence": f"rank {rank}'s CPU, memory, I/O, GC and data-loader signals do not stand out "
        "from its peers'",
    }


def _last_progress_ns(table: TraceTable, rank: int) -> int:
    mine = table["rank"] == rank
    if not mine.any():
        return 0
    return int(max(table["enqueue_ns"][mine].max(), table["complete_ns"][mine].max()))


def _trace_span(table: TraceTable) -> tuple[int, int]:
    """The window every rank was traced in: from the latest first call to the earliest end."""
    starts, ends = [], []
    for rank, info in table.ranks.items():
        mine = table["rank"] == rank
        if mine.any():
            starts.append(int(table["enqueue_ns"][mine].min()))
        ends.append(info.observed_until_ns)
    return (max(starts) if starts else 0), (min(e for e in ends if e) if any(ends) else 0)


def explain(table: TraceTable, report: dict[str, Any]) -> dict[str, Any] | None:
    """The report's ``why`` for its first suspect (None unless the verdict is a hang or a slow rank)."""
    if report.get("verdict") not in ("hang", "slow") or not report.get("suspects"):
        return None
    suspect = report["suspects"][0]
    rank = suspect["rank"]
    info = table.ranks.get(rank)
    if info is None:
        return {"rank": rank, "class": "unknown", "evidence": f"rank {rank} left no trace to explain"}
    start, end = _trace_span(table)
    if suspect["kind"] == "hang":
        stopped = _last_progress_ns(table, rank)
        end = info.observed_until_ns or end
        stuck_s = max(0.0, (end - stopped) / 1e9) if stopped else 0.0
        in_collective = suspect.get("cause") != "rank_missing"
        taken_after_stop = info.stacks_ns >= stopped
        stuck = None if in_collective or not taken_after_stop else where_stuck(info.stacks)
        if stuck is not None and stuck.frames:
            frame = stuck.frames[0]
            return {
                "rank": rank,
                "class": "python",
                "evidence": f"rank {rank}'s main thread is {stuck.text}, outside any collective, "
                f"while its peers wait in one"
                + (
                    "; it holds the GIL (its watchdog could not run: faulthandler's timer took the stacks)"
                    if info.stacks_frozen
                    else ""
                ),
                "frame": {"file": frame.file, "line": frame.line, "function": frame.function},
                "where": f"{stuck.text} for {stuck_s:.0f} s",
            }
        start = stopped or start
    return {"rank": rank, **classify(table, rank, start, end)}
