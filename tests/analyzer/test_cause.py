"""The cause class (`analyzer/cause.py`) on tables built here: a signal names its class only when the
culprit's value reaches the floor and stands clear of its peers' median; the specific class wins over
the generic one it also shows as; a load shared by every rank, or a fault on a rank that is not the
culprit, names nothing. The same rules on real injected faults: tests/cause."""

from __future__ import annotations

import dataclasses

import numpy as np

from megatrace.analyzer.cause import classify, explain, window_of
from megatrace.analyzer.table import RankInfo, TraceTable, empty_columns
from megatrace.tracer.format import OP_GC, OP_PAUSE, PAUSE_KIND_CODES, RECORD_DTYPE
from megatrace.tracer.ringfile import HostSample

S = 1_000_000_000
T0 = 1_790_000_000 * S
FIELDS = [f.name for f in dataclasses.fields(HostSample)]


def sample(t: float, **per_s: float) -> HostSample:
    """A sample at T0 + t s whose counters grew at `per_s` per second since T0 (others 0; -1 stays -1)."""
    values = {name: 0 for name in FIELDS}
    for name, rate in per_s.items():
        values[name] = -1 if rate < 0 else int(rate * t)
    values["time_ns"] = T0 + int(t * S)
    return HostSample(**values)


def samples(**per_s: float) -> tuple[HostSample, ...]:
    return tuple(sample(t, **per_s) for t in range(0, 21))


def table(
    signals: dict[int, tuple[HostSample, ...]],
    spans: dict[int, np.ndarray] | None = None,
    waits: dict[int, float] | None = None,
) -> TraceTable:
    """Ranks each making one collective call a second for 20 s, in flight `waits[rank]` s (0.1)."""
    ranks = sorted(signals)
    n = 20
    rank_col = np.repeat(np.array(ranks, dtype=np.int32), n)
    times = np.tile(T0 + np.arange(n, dtype=np.int64) * S, len(ranks))
    wait = np.repeat([int((waits or {}).get(r, 0.1) * S) for r in ranks], n)
    cols = empty_columns(len(rank_col), rank=rank_col, enqueue_ns=times, complete_ns=times + wait)
    infos = {
        r: RankInfo(
            rank=r,
            observed_until_ns=T0 + 20 * S,
            host_samples=signals[r],
            spans=(spans or {}).get(r),
        )
        for r in ranks
    }
    return TraceTable(cols, [], [], infos, world_size=len(ranks))


def slow_report(rank: int) -> dict:
    return {"verdict": "slow", "suspects": [{"rank": rank, "kind": "slow"}]}


def test_run_queue_delay_of_the_culprit_alone_names_cpu_contention() -> None:
    signals = {r: samples(runq_ns=0.02 * S, cpu_ns=0.48 * S) for r in range(8)}
    signals[5] = samples(runq_ns=0.41 * S, cpu_ns=0.59 * S)
    why = explain(table(signals), slow_report(5))
    assert why == {
        "rank": 5,
        "class": "cpu_contention",
        "evidence": "run-queue delay 0.7 s per CPU-second on rank 5, 0.0 s per CPU-second median on its "
        "7 peer(s)",
    }


def test_a_rank_that_computes_more_is_not_contended_for_waiting_more() -> None:
    """On a loaded host the busiest rank waits longest in the run queue (a GC storm, a heavier stage);
    what counts is how long it waited per second it ran, here about its peers'."""
    signals = {r: samples(runq_ns=0.05 * S, cpu_ns=0.15 * S) for r in range(4)}
    signals[2] = samples(runq_ns=0.3 * S, cpu_ns=0.6 * S, gc_ns=0.5 * S)
    why = explain(table(signals), slow_report(2))
    assert why["class"] == "gc", why
    signals[2] = samples(runq_ns=0.3 * S, cpu_ns=0.6 * S)  # a heavier stage: 30 % of wall waiting
    assert explain(table(signals), slow_report(2))["class"] == "unknown"


def test_a_host_loaded_uniformly_names_no_cause() -> None:
    signals = {r: samples(runq_ns=0.45 * S, cpu_ns=0.5 * S, gc_ns=0.01 * S) for r in range(8)}
    assert explain(table(signals), slow_report(5))["class"] == "unknown"


def test_the_same_fault_on_a_rank_that_is_not_the_culprit_is_not_blamed() -> None:
    signals = {r: samples(runq_ns=0.02 * S) for r in range(4)}
    signals[1] = samples(cfs_periods=10, cfs_throttled_periods=8, runq_ns=0.3 * S)
    why = explain(table(signals), slow_report(3))
    assert why["rank"] == 3 and why["class"] == "unknown"


def test_a_quota_wins_over_the_run_queue_delay_it_also_causes() -> None:
    signals = {r: samples(cfs_periods=10, runq_ns=0.02 * S) for r in range(4)}
    signals[2] = samples(cfs_periods=10, cfs_throttled_periods=6.3, runq_ns=0.35 * S)
    why = classify(table(signals), 2, T0, T0 + 20 * S)
    assert why["class"] == "cpu_quota"
    assert why["evidence"].startswith("CPU quota throttling 63 % of scheduler periods on rank 2, 0 %")


def test_a_slow_rank_is_not_blamed_for_what_takes_the_same_share_of_its_own_time() -> None:
    """The slow rank waits least in collectives, so its GC pauses take more of its *wall* time than its
    waiting peers' (8 % against 1 %) though the same share of the time it runs its loop: not GC."""
    signals = {r: samples(gc_ns=0.01 * S, cpu_ns=0.2 * S) for r in range(4)}
    signals[3] = samples(gc_ns=0.08 * S, cpu_ns=0.9 * S)
    waits = {0: 0.8, 1: 0.8, 2: 0.8, 3: 0.05}
    assert classify(table(signals, waits=waits), 3, T0, T0 + 20 * S)["class"] == "unknown"
    signals[3] = samples(gc_ns=0.3 * S, cpu_ns=0.9 * S)  # a third of its own time: a GC storm
    assert classify(table(signals, waits=waits), 3, T0, T0 + 20 * S)["class"] == "gc"


def test_below_the_floor_nothing_is_named_however_far_from_the_peers() -> None:
    signals = {r: samples(runq_ns=0.001 * S, cpu_ns=0.5 * S) for r in range(4)}
    signals[2] = samples(runq_ns=0.05 * S, cpu_ns=0.5 * S)  # 50 times the peers, but 0.1 s per CPU-second
    assert classify(table(signals), 2, T0, T0 + 20 * S)["class"] == "unknown"


def test_unavailable_signals_are_not_compared() -> None:
    signals = {r: samples(cfs_periods=-1, cfs_throttled_periods=-1, runq_ns=0.02 * S) for r in range(4)}
    assert classify(table(signals), 0, T0, T0 + 20 * S)["class"] == "unknown"


def spans_of(op: int, kind: int, start_s: list[float], length_s: float) -> np.ndarray:
    rows = np.zeros(len(start_s), dtype=RECORD_DTYPE)
    rows["op"], rows["peer"] = op, kind
    rows["enqueue_ns"] = [T0 + int(s * S) for s in start_s]
    rows["complete_ns"] = rows["enqueue_ns"] + int(length_s * S)
    return rows


def test_data_loader_spans_speak_where_no_host_sample_covers_the_window() -> None:
    loader = PAUSE_KIND_CODES["dataloader"]
    spans = {r: spans_of(OP_PAUSE, loader, [1, 5, 9], 0.01) for r in range(4)}
    spans[1] = spans_of(OP_PAUSE, loader, list(range(0, 20, 2)), 0.9)
    spans[1] = np.concatenate([spans[1], spans_of(OP_GC, 2, [3], 0.001)])
    why = classify(table(dict.fromkeys(range(4), ()), spans), 1, T0, T0 + 20 * S)
    assert why["class"] == "dataloader"
    # 9 s of loader waits in the 18 s it spent outside its collectives (20 calls of 0.1 s)
    assert why["evidence"].startswith("DataLoader waits 50 % of its time outside collectives on rank 1, 0 %")


def test_no_why_for_a_healthy_job_and_unknown_without_any_signal() -> None:
    signals = {r: () for r in range(4)}
    assert explain(table(signals), {"verdict": "healthy", "suspects": []}) is None
    assert explain(table(signals), slow_report(2))["class"] == "unknown"


def test_the_window_takes_the_samples_inside_the_interval_else_those_around_it() -> None:
    series = samples(runq_ns=0.1 * S)
    window = window_of(series, T0 + int(4.5 * S), T0 + 12 * S)
    assert window is not None
    assert (window.first.time_ns, window.last.time_ns, window.samples) == (T0 + 5 * S, T0 + 12 * S, 8)
    window = window_of(series, T0 + int(4.5 * S), T0 + int(5.5 * S))  # one sample inside: bracketed
    assert window is not None
    assert (window.first.time_ns, window.last.time_ns, window.samples) == (T0 + 4 * S, T0 + 5 * S, 2)
    assert window_of(series[:1], T0, T0 + S) is None


def test_what_the_peers_did_before_their_first_call_is_not_compared() -> None:
    """Real GC storm run: every rank collected ~0.3 s of garbage at start-up (imports, the model), a
    second before the first collective; counted against the little own time of the waiting peers it
    made them look as busy with GC as the storming rank (28 % against 53 %)."""

    def with_startup_gc(storm: float) -> tuple[HostSample, ...]:
        series = []
        for t in [x + 0.5 for x in range(-3, 20)]:  # a sample half a second before the first call
            gc_ns = (0.3 * S if t > 0 else 0) + storm * S * max(t - 0.5, 0)
            series.append(dataclasses.replace(sample(0), time_ns=T0 + int(t * S), gc_ns=int(gc_ns)))
        return tuple(series)

    signals = {r: with_startup_gc(0.0) for r in range(3)}
    signals[2] = with_startup_gc(0.3)
    waits = {0: 0.95, 1: 0.95, 2: 0.05}
    why = classify(table(signals, waits=waits), 2, T0, T0 + 20 * S)
    assert why["class"] == "gc", why
