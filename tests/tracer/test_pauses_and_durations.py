"""Known pauses and op-duration histograms in real gloo jobs (torchrun, 2 ranks, both captures): each
pause kind is marked while a real `torch.save`, distributed checkpoint save and load, `model.eval()`
and slow `DataLoader` run and ends after; `no_grad` is no pause; the histogram in the header counts
exactly the durations the records show, and the exporter's 0.99 quantile and maximum follow from them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from megatrace.exporters.tracer_files import TracerCollector
from megatrace.tracer.format import OP_NAMES, OP_PAUSE, PAUSE_KIND_CODES
from megatrace.tracer.ringfile import RingSnapshot, ops_only, read_ring
from tests.support.gloo_job import trace_under_torchrun
from tests.tracer.test_ringfile import counted

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
KINDS = ("checkpoint", "eval", "dataloader")


def run_pause_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool) -> tuple[dict, dict]:
    """(rank -> ring snapshot, rank -> the job's own observations and spans)."""
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("PAUSE_JOB_OUT", str(out))
    trace_under_torchrun(tmp_path, "pauses", HERE / "pause_job.py", 2, native)
    snaps = {rank: read_ring(tmp_path / "pauses" / f"rank-{rank}.trace") for rank in (0, 1)}
    seen = {rank: json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)}
    return snaps, seen


@pytest.fixture(scope="module", params=["native", "python"])
def pause_job(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, native_module
) -> tuple:
    with pytest.MonkeyPatch.context() as monkeypatch:
        tmp_path = tmp_path_factory.mktemp(request.param)
        snaps, seen = run_pause_job(tmp_path, monkeypatch, request.param == "native")
    assert all(snap.header.capture == request.param for snap in snaps.values())
    return tmp_path, snaps, seen


def in_pause(observation: dict, kind: str) -> bool:
    return observation["kind"] == kind and observation["since"][kind] > 0


def in_no_pause(observation: dict) -> bool:
    return observation["kind"] == "" and not any(observation["since"].values())


def pause_records(snap: RingSnapshot, kind: str) -> np.ndarray:
    r = snap.records
    return r[(r["op"] == OP_PAUSE) & (r["peer"] == PAUSE_KIND_CODES[kind])]


def test_each_pause_is_marked_while_it_runs_and_ends_after(pause_job: tuple) -> None:
    _, snaps, seen = pause_job
    for rank in (0, 1):
        obs = seen[rank]["observations"]
        assert in_no_pause(obs["start"])
        assert in_pause(obs["in-torch-save"], "checkpoint") and in_pause(obs["in-dcp-save"], "checkpoint")
        for name in ("after-torch-save", "after-dcp-save", "after-dcp-load", "after-eval", "after-step"):
            assert in_no_pause(obs[name]), (rank, name, obs[name])
        assert [obs[name]["ended"]["checkpoint"] for name in ("after-torch-save", "after-dcp-save")] == [1, 2]
        assert obs["after-dcp-load"]["ended"]["checkpoint"] == 3
        assert in_no_pause(obs["in-no-grad"])  # no_grad is no pause
        assert in_pause(obs["in-eval"], "eval") and obs["after-eval"]["ended"]["eval"] == 1
        assert in_pause(obs["teacher-eval"], "eval") and obs["after-step"]["ended"]["eval"] == 2
        assert all(in_pause(obs[f"getitem-{index}"], "dataloader") for index in range(3))
        assert obs["after-loader"]["ended"]["dataloader"] == 4  # three items, then StopIteration
        header = snaps[rank].header
        assert header.pause_kind == "" and not any(p.since_ns for p in header.pauses.values())
        assert {kind: header.pauses[kind].ended for kind in KINDS} == {
            "checkpoint": 3, "eval": 2, "dataloader": 4,
        }  # fmt: skip


def test_pause_records_span_the_calls_and_are_no_collectives(pause_job: tuple) -> None:
    _, snaps, seen = pause_job
    for rank in (0, 1):
        snap, spans = snaps[rank], seen[rank]["spans"]
        r = snap.records
        for kind in KINDS:
            records = pause_records(snap, kind)
            pause = snap.header.pauses[kind]
            assert len(records) == pause.ended and list(records["seq"]) == list(range(pause.ended))
            assert int((records["complete_ns"] - records["enqueue_ns"]).sum()) == pause.total_ns
            assert not records["comm_id"].any() and not records["nbytes"].any()
        checkpoints = pause_records(snap, "checkpoint")
        ops = ops_only(r)
        for name, (start, end) in spans.items():
            inside = checkpoints[(checkpoints["enqueue_ns"] >= start) & (checkpoints["complete_ns"] <= end)]
            assert len(inside) == 1, (rank, name)
            if name.startswith("dcp"):  # its collectives ran inside the pause
                begin, finish = int(inside["enqueue_ns"][0]), int(inside["complete_ns"][0])
                issued = ops[(ops["enqueue_ns"] >= begin) & (ops["enqueue_ns"] <= finish)]
                assert len(issued) > 0 and all(int(op) in OP_NAMES for op in issued["op"]), (rank, name)
        assert sum(snap.header.calls_by_op.values()) == len(ops)
        assert snap.header.records_written == len(r)
        assert (
            snap.header.pause_records
            == len(r[r["op"] == OP_PAUSE])
            == sum(p.ended for p in snap.header.pauses.values())
        )


def test_histograms_count_what_the_ops_took_and_the_exporter_reports_it(pause_job: tuple) -> None:
    tmp_path, snaps, _ = pause_job
    families = {family.name: family for family in TracerCollector(tmp_path).collect()}
    summary = families["megatrace_tracer_comm_op_duration_seconds"].samples
    for rank in (0, 1):
        snap = snaps[rank]
        ops = ops_only(snap.records)
        assert set(snap.header.comm_counters) == set(int(c) for c in ops["comm_id"])
        for cid, counters in snap.header.comm_counters.items():
            mine = ops[ops["comm_id"] == cid]
            durations = sorted(int(d) for d in mine["complete_ns"] - mine["enqueue_ns"])
            assert counters.completed == len(durations) and all(mine["complete_ns"] > 0)
            assert counters.histogram == counted(*durations)
            assert (counters.max_duration_ns, counters.duration_sum_ns) == (durations[-1], sum(durations))
            labels = {"job": "pauses", "rank": str(rank), "local_rank": str(rank), "comm": str(cid)}
            exported = {
                (
                    s.name.removeprefix("megatrace_tracer_comm_op_duration_seconds"),
                    s.labels.get("quantile"),
                ): s.value
                for s in summary
                if all(s.labels.get(key) == value for key, value in labels.items())
            }
            p99 = durations[math.ceil(0.99 * len(durations)) - 1]
            bucket = min(max(p99.bit_length() - 20, 0), 21)
            edge = 2 ** (20 + bucket) if bucket < 21 else durations[-1]
            assert exported[("", "0.99")] == pytest.approx(min(edge, durations[-1]) * 1e-9)
            assert exported[("", "1")] == pytest.approx(durations[-1] * 1e-9)
            assert exported[("_count", None)] == len(durations)
            assert exported[("_sum", None)] == pytest.approx(sum(durations) * 1e-9)
            assert exported[("", "0.99")] >= p99 * 1e-9
    world = snaps[0].header.comm_counters
    assert max(sum(c.histogram) for c in world.values()) > 100  # the 0.99 quantile is not the maximum
    for kind in KINDS:
        samples = [s for s in families["megatrace_tracer_pauses"].samples if s.labels["kind"] == kind]
        expected = sorted(snaps[rank].header.pauses[kind].ended for rank in (0, 1))
        assert sorted(s.value for s in samples) == expected
