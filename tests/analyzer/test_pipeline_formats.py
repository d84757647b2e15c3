"""Real `torch.distributed.pipelining` runs read from the formats that carry less than our ring files:
Megatrace NCCL logs made from the runs' ring files (bench/ring_to_nccl_log.py: no peer, no completion
time) and the Flight Recorder dumps torch wrote on gloo (no transfer, completion known only through
``pg_status``). Runs from tests/fixtures/pipelining_runs.tar.gz (users' corpus, seed 20261127, two
of seed 20261128 and one of 20261129, each seed scored as held out once and looked at since)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatrace.analyzer import analyze, nccl_comms

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

import ring_to_nccl_log

from tests.support.pipelining_runs import extract, layout_of


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return extract(tmp_path_factory.mktemp("pipelining"))


def _converted(runs: Path, name: str, tmp_path: Path) -> Path:
    return ring_to_nccl_log.convert(runs / name, tmp_path / name)[0].parent


def test_a_pipeline_hang_in_megatrace_logs_names_the_hung_stage_without_thelayout_of(runs, tmp_path):
    """046: 1F1B, PP 4 × DDP 2, rank 2 (stage 1 of the first pipeline) stops in a forward. Its
    neighbours wait in receives it never answers; without the layout the transfers were paired with
    the next rank up (1-2, 3-4, 5-6), which named rank 6. A middle stage talks to two neighbours, the
    ends to one: the pipelines are 0-2-4-6 and 1-3-5-7."""
    logs = _converted(runs, "046-hang-compute", tmp_path)
    for layout in (None, layout_of(runs / "046-hang-compute")):
        report = analyze([logs], layout)
        assert report["verdict"] == "hang", report["notes"]
        assert report["suspects"][0]["rank"] == 2, report["suspects"][:2]


def test_a_healthy_pipeline_in_megatrace_logs_is_not_called_slow(runs, tmp_path):
    """002: 1F1B, one pipeline of 4 stages, healthy. Without the layout the world's loss all-reduce
    (where the first stage arrives last by design) was compared across stages and named rank 0; with
    it, each stage's gaps between calls (which hold its waits: these logs time no completion) were
    compared with its own first step and named ranks 0 and 1."""
    logs = _converted(runs, "002-none", tmp_path)
    for layout in (None, layout_of(runs / "002-none")):
        report = analyze([logs], layout)
        assert report["verdict"] == "healthy", report["suspects"][:2]


def test_a_finished_jobs_gloo_dumps_whose_last_reduction_reads_in_flight_read_healthy(runs):
    """025: interleaved 1F1B, PP 2 × DDP 2, healthy, dumped by torch at the end. On ranks 2 and 3
    ``pg_status`` says their data-parallel group completed reduction 9 of 10, though both then issued
    and completed the step's loss reductions after it: read as a collective stuck on both members,
    it was a hang verdict on a healthy job."""
    fr = runs / "025-none-noisy" / "fr"
    for layout in (None, layout_of(runs / "025-none-noisy")):
        report = analyze([fr], layout)
        assert report["verdict"] == "healthy", (report["suspects"][:2], report["notes"])


def test_a_hung_rank_and_two_ranks_that_wrote_no_dump_are_tied_not_the_silent_ones_named(runs):
    """015: zero-bubble, PP 2 × FSDP 2, rank 0 stops in a forward; torch's dumps came from ranks 0 and 1
    only. Given the layout, ranks 2 and 3 were each named first with confidence 0.9, "wrote no dump
    when every other rank did", though two ranks wrote none and rank 0, alive, never issued the
    reduction rank 1 waits in. Read without flags the dumps show two ranks, and rank 0 is named."""
    fr = runs / "015-hang-compute-noisy" / "fr"
    report = analyze([fr], layout_of(runs / "015-hang-compute-noisy"))
    assert report["verdict"] == "hang"
    assert report["tie"]["ranks"] == [0, 2, 3] and "wrote none" in report["tie"]["reason"]
    assert all(s["tied"] and s["confidence"] == 0.33 for s in report["suspects"][:3])
    plain = analyze([fr])
    assert plain["verdict"] == "hang" and plain["suspects"][0]["rank"] == 0 and plain["tie"] is None


def test_the_one_rank_peers_wait_for_is_tied_with_the_ranks_that_wait_in_nothing(runs):
    """seed 20261128, 046: 1F1B, PP 2 × FSDP 2, rank 1 (first stage) stops in a forward. Its calls all
    completed; its pipeline neighbour rank 3 waits for it in a receive gloo does not record and so never
    issues the all-gather rank 2 waits in. Rank 3 was named with confidence 0.99. Ranks 0 and 1 wait in
    no recorded call: either may be the stopped one."""
    fr = runs / "seed20261128-046-hang-compute" / "fr"
    for layout in (None, layout_of(runs / "seed20261128-046-hang-compute")):
        report = analyze([fr], layout)
        assert report["verdict"] == "hang"
        assert sorted(report["tie"]["ranks"]) == [0, 1, 3] and "no call open" in report["tie"]["reason"]
        assert all(s["tied"] for s in report["suspects"][:3])


def test_an_interleaved_pipeline_hang_in_megatrace_logs_is_read_without_thelayout_of(runs, tmp_path):
    """seed 20261128, 079: interleaved 1F1B, PP 4 × FSDP 2 (two stages a rank), rank 7 stops. The last
    stage sends back to the first, so every rank has two transfer streams and the pipelines' ends do
    not show; the transfers were paired with the next rank up, which named rank 1. The data-parallel
    groups (0-1, 2-3, ...) are the stages, neighbours a block apart."""
    logs = _converted(runs, "seed20261128-079-hang-compute-noisy", tmp_path)
    report = analyze([logs])
    assert report["verdict"] == "hang" and report["suspects"][0]["rank"] == 7, report["suspects"][:2]


@pytest.mark.parametrize(
    ("world", "groups", "pipelines"),
    [
        (8, [{0, 1}, {2, 3}, {4, 5}, {6, 7}, set(range(8))], [(0, 2, 4, 6), (1, 3, 5, 7)]),
        (8, [{0, 1, 2, 3}, {4, 5, 6, 7}], [(0, 4), (1, 5), (2, 6), (3, 7)]),
        (4, [{0, 2}, {1, 3}], []),  # strided groups: not Megatron's stages
        (8, [set(range(8))], []),  # nothing inside a stage
    ],
)
def test_pipelines_from_the_groups_inside_a_stage(world, groups, pipelines):
    assert nccl_comms._pipelines_by_groups(world, groups) == pipelines


def test_a_hang_whose_watchdogs_could_not_run_is_dated_by_the_stacks_files(runs, tmp_path):
    """seed 20261129, 015: zero-bubble, PP 2 × FSDP 2, in a cgroup at its memory limit (259 k limit
    hits) under three CPU hogs; rank 1 stops in a forward. No rank's watchdog ran again (each wrote a
    faulthandler stacks file, none a stall dump), so the rings end at their last call and the calls the
    peers wait in read as just issued: the job read healthy. The stacks files were written from inside
    the live processes seconds later, with the rings silent."""
    run = runs / "seed20261129-015-hang-compute-noisy"
    for layout in (None, layout_of(run)):
        report = analyze([run], layout)
        assert report["verdict"] == "hang" and report["suspects"][0]["rank"] == 1, report["suspects"][:2]
    rings = tmp_path / "rings"
    rings.mkdir()
    for ring in run.glob("rank-*.trace"):
        (rings / ring.name).symlink_to(ring)
    assert analyze([rings])["verdict"] == "healthy"
