"""Recorded real runs, verdict by verdict, from our ring files and from the Flight Recorder dumps torch
itself wrote, with and without the layout the run used.

``tests/fixtures/real_runs.tar.gz``: the first run of each fault class in the corpus plan
(bench/corpus.py), recorded with small rings and the tracer's Python capture (four steps a run). The
slow-compute run keeps only its dumps: its ring files were recorded before the tracer captured DDP's
all-reduces, its only collectives there. ``tests/fixtures/real_runs_native.tar.gz``: ring files only,
recorded with the native capture (DDP's all-reduces in them) and twelve steps: a healthy single
pipeline whose first stage ends every step last (not a slow rank), a slow data loader, and a rank slow
in compute in a pipeline of two stages whose neighbour is late in its own group because of it. Each
folder holds ``label.json`` (what was injected where), ``trace/<run>`` (ring files and stall dumps) and
``fr`` (torch's dumps: pickles, and JSON for even ranks).
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from megatrace.analyzer import analyze
from megatrace.analyzer.layout import LayoutConfig
from megatrace.cli import main

FIXTURES = Path(__file__).parents[1] / "fixtures"
ARCHIVES = ("real_runs.tar.gz", "real_runs_native.tar.gz")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("real_runs")
    for name in ARCHIVES:
        with tarfile.open(FIXTURES / name) as archive:
            archive.extractall(root / name, filter="data")
    return root


# Slowdowns these recordings cannot show beyond the job's own noise: the bad link's 10 % in four steps
# of torch's dumps leaves rank 4 late by 5 % of the call interval against a 3 % block-to-block spread
# (the rule before the statistical test named it, and two healthy ranks, 3 and 6, after it). The
# report is healthy and its note names rank 4 as late within the noise.
WITHIN_NOISE = {("real_runs.tar.gz/005-slow-comm", "fr")}


def _cases() -> list[tuple[str, str]]:
    cases = []
    for name in ARCHIVES:
        with tarfile.open(FIXTURES / name) as archive:
            parts = [[p for p in Path(m.name).parts if p != "."] for m in archive.getmembers()]
        names = {tuple(p[:2]) for p in parts if len(p) > 2}
        cases += [
            (f"{name}/{run}", "ring" if source == "trace" else "fr")
            for run, source in names
            if source in ("trace", "fr")
        ]
    return sorted(cases)


@pytest.mark.parametrize(("run", "source"), _cases())
def test_recorded_run_reads_as_injected(runs, run, source):
    folder = runs / run
    label = json.loads((folder / "label.json").read_text())
    path = folder / ("trace" if source == "ring" else "fr")
    expected = "healthy" if label["fault"] == "none" else label["fault"].split("-")[0]
    layout = LayoutConfig(world_size=label["world"], tp=label["tp"], pp=label["pp"])
    if (run, source) in WITHIN_NOISE:
        expected = "healthy"
    for report in (analyze([path]), analyze([path], layout)):
        assert report["verdict"] == expected, (run, source, report["suspects"][:2], report["notes"][-2:])
        if (run, source) in WITHIN_NOISE:
            assert any(note.startswith(f"rank {label['rank']} arrived late") for note in report["notes"])
        if expected != "healthy":
            top = report["suspects"][0]
            assert (top["rank"], top["kind"]) == (label["rank"], expected)
            assert 0 < top["confidence"] <= 1 and top["evidence"]


def test_hang_in_a_collective_names_the_frozen_rank_first(runs):
    folder = runs / ARCHIVES[0] / "002-hang-collective"
    report = analyze([folder / "trace"])
    top = report["suspects"][0]
    assert top["cause"] == "communication_stuck" and "fell silent" in top["evidence"]
    assert all(s["confidence"] < top["confidence"] for s in report["suspects"][1:])


def test_layout_is_read_from_the_traces(runs, capsys):
    folder = runs / ARCHIVES[0] / "005-slow-comm"
    report = analyze([folder / "trace"])
    assert (report["layout_inferred"]["tp"], report["layout_inferred"]["pp"]) == (2, 4)
    contradicted = analyze([folder / "trace"], LayoutConfig(tp=4, pp=2))
    assert any("the layout given (tp 4, dp 1, pp 2)" in note for note in contradicted["notes"])
    assert contradicted["verdict"] == report["verdict"] == "slow"
    assert main(["analyze", str(folder / "fr"), "--quiet"]) == 0
    assert "note: rank 4 arrived late on average" in capsys.readouterr().out


def test_a_slow_rank_is_told_from_the_pipeline_neighbour_it_holds_up(runs):
    """Rank 6 (stage 1) is slow: its neighbour 2 (stage 0) is late in its own DP group too, but waits
    for 6 in their transfers where the other pipelines' neighbours do not."""
    report = analyze([runs / ARCHIVES[1] / "011-slow-compute" / "trace"])
    assert [s["rank"] for s in report["suspects"]] == [6]
    assert report["suspects"][0]["evidence"].startswith("rank 6 ")


def test_a_single_pipeline_whose_first_stage_ends_each_step_last_is_healthy(runs):
    report = analyze([runs / ARCHIVES[1] / "000-none" / "trace"])
    assert report["layout_inferred"]["pp"] == 4
    assert report["verdict"] == "healthy"


@pytest.fixture(scope="module")
def torch_dumps(tmp_path_factory) -> Path:
    """``tests/fixtures/torch_fr_dumps.tar.gz``: torch's own Flight Recorder dumps (gloo, 12 steps) of
    two corpus runs: a healthy single pipeline of four stages (000-none), and a TP 2 × PP 2 × DP 2 job
    whose rank 5 froze inside a TP all-reduce (023-hang-collective: it wrote no dump)."""
    root = tmp_path_factory.mktemp("torch_dumps")
    with tarfile.open(FIXTURES / "torch_fr_dumps.tar.gz") as archive:
        archive.extractall(root, filter="data")
    return root


def test_torch_dumps_of_a_single_pipeline_are_not_read_as_its_first_stage_being_slow(torch_dumps):
    """Gloo's Flight Recorder keeps no send or receive, so all it shows of a single pipeline is the
    step's loss all-reduce over the whole job, which the first stage reaches last every step by
    design: no rank is compared there, and the report says why."""
    dumps = torch_dumps / "000-none" / "fr"
    for layout in (None, LayoutConfig(world_size=4, tp=1, pp=4)):
        report = analyze([dumps], layout)
        assert report["verdict"] == "healthy" and not report["suspects"]
    assert any("no rank was compared with another" in note for note in analyze([dumps])["notes"])


def test_the_rank_that_wrote_no_dump_is_named_before_ranks_that_may_wait_in_a_transfer(torch_dumps):
    """Stage 0 (ranks 0, 1) never issued its DP all-reduce: it waits in a pipeline receive the dumps do
    not record, behind the frozen rank 5, the only rank that did not answer the dump request."""
    report = analyze([torch_dumps / "023-hang-collective" / "fr"], LayoutConfig(world_size=8, tp=2, pp=2))
    assert report["verdict"] == "hang"
    first, *others = report["suspects"]
    assert (first["rank"], first["cause"]) == (5, "no_log") and "stopped or died" in first["evidence"]
    assert {s["rank"] for s in others} == {0, 1}
    assert all("it was alive" in s["evidence"] and s["confidence"] < first["confidence"] for s in others)


def _dumped_later(torch_dumps: Path, tmp_path: Path, seconds: float) -> Path:
    """A copy of the healthy single pipeline's dumps, written `seconds` after torch wrote them (the job
    went on without collectives: an evaluation, a checkpoint, or it finished and was dumped later)."""
    copy = tmp_path / "fr"
    shutil.copytree(torch_dumps / "000-none" / "fr", copy)
    for dump in copy.iterdir():
        stamp = dump.stat().st_mtime + seconds
        os.utime(dump, (stamp, stamp))
    return copy


def test_ranks_all_quiet_after_the_same_completed_call_read_healthy(torch_dumps, tmp_path):
    """Every rank's last call is the same completed all-reduce and the dumps came a minute later:
    before, 'no traced call for 60 s' made it inconclusive; the traces simply end there."""
    report = analyze([_dumped_later(torch_dumps, tmp_path, 60.0)])
    assert report["verdict"] == "healthy", report["notes"]
    assert any("the traces end there" in note and "all_reduce" in note for note in report["notes"])


def test_hung_rank_and_the_neighbour_waiting_in_an_unrecorded_transfer_are_tied(runs):
    """Rank 0 hung before a pipeline send; its stage-1 neighbour 4 waits in a receive gloo's dumps do not
    record. Neither issued the DP all-reduce their peers wait in, and both wrote their dumps: the report
    names both, tied, with the reason (before, rank 0 was named alone, on a guess)."""
    for layout in (None, LayoutConfig(world_size=8, tp=2, pp=2)):
        report = analyze([runs / ARCHIVES[0] / "003-hang-p2p" / "fr"], layout)
        assert report["verdict"] == "hang"
        assert (
            report["tie"]["ranks"] == [0, 4]
            and "record no pipeline send or receive" in report["tie"]["reason"]
        )
        assert [(s["rank"], s.get("tied")) for s in report["suspects"][:2]] == [(0, True), (4, True)]


def test_a_rank_that_wrote_no_dump_is_named_first_without_the_layout(torch_dumps):
    """Without the layout no group shows rank 5 as a member, but every other rank of the world wrote a
    dump when asked: rank 5 stopped (it froze inside a collective). Before, rank 0 was named."""
    report = analyze([torch_dumps / "023-hang-collective" / "fr"])
    first = report["suspects"][0]
    assert (first["rank"], first["cause"]) == (5, "no_log") and "wrote no dump" in first["evidence"]
    assert report["tie"] is None and all(
        s["confidence"] < first["confidence"] for s in report["suspects"][1:]
    )
