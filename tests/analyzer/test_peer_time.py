"""A rank's own time against its pipeline stage's: the test's rules on their own, and real
`torch.distributed.pipelining` runs (tests/fixtures/pipelining_runs.tar.gz: ring files of three runs of
the users' corpus, seed 20261127, recorded on this project's 2-core machine) read with and without
the layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatrace.analyzer import analyze
from megatrace.analyzer.peer_time import MIN_EXCESS, excess_test, holds
from tests.support.pipelining_runs import extract, layout_of

TESTS = 16  # a 4-rank job judged in its passes


def _noisy(level: float, steps: int = 11, spread: float = 0.03, seed: int = 0) -> np.ndarray:
    return level + np.random.default_rng(seed).normal(0.0, spread, steps)


def test_a_rank_steadily_above_its_peers_is_named():
    test = excess_test(_noisy(0.14))
    assert holds(test, TESTS), test
    assert test.effect == pytest.approx(0.14, abs=0.03) and test.late_share >= 0.9


def test_a_steady_offset_below_the_floor_is_not_named_however_significant():
    test = excess_test(_noisy(MIN_EXCESS / 2, spread=0.002))
    assert test.p < 1e-6 and not holds(test, TESTS)


def test_a_burst_over_a_few_steps_is_not_named():
    """A hog landing on the rank's CPU for 3 of 11 steps: +40 % there, level elsewhere."""
    excess = _noisy(0.0, spread=0.01)
    excess[4:7] += 0.4
    assert not holds(excess_test(excess), TESTS)


def test_an_excess_lost_in_its_own_step_to_step_noise_is_not_named():
    assert not holds(excess_test(_noisy(0.09, spread=0.25, seed=3)), TESTS)


def test_the_correction_grows_with_the_tests_made():
    test = excess_test(_noisy(0.1, steps=6, spread=0.04, seed=1))
    assert holds(test, 4) and not holds(test, 4096 * 13)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return extract(tmp_path_factory.mktemp("pipelining"))


def _read(run: Path, flags: bool) -> dict:
    return analyze([run], layout_of(run) if flags else None)


@pytest.mark.parametrize("flags", [False, True], ids=["no flags", "layout given"])
@pytest.mark.parametrize("name", ["011-slow-compute-noisy", "012-slow-compute"])
def test_a_real_slow_rank_of_a_pipeline_with_replicas_is_named_by_its_stage(runs, name, flags):
    """012: zero-bubble schedule, PP 2 × DDP 2, rank 2 computing twice as long from step 1 (its own
    time 675 ms a step against its peer's 345 ms); the lateness test found it late in every block but
    within its noise. 011: ZBV schedule, PP 4 × FSDP 2 under one CPU hog at 90 %, rank 4 20 % slower
    (12 % more own time than its peer, above it in every step). Without flags the layout is inferred as
    TP 2, which groups the same ranks into stages."""
    run = runs / name
    truth = json.loads((run / "label.json").read_text())["rank"]
    report = _read(run, flags)
    assert report["verdict"] == "slow", report["notes"]
    top = report["suspects"][0]
    assert top["rank"] == truth, report["suspects"]
    assert "of its pipeline stage" in top["evidence"] and top["p_value"] <= 0.01
    assert top["effect_size"] >= MIN_EXCESS


@pytest.mark.parametrize("flags", [False, True], ids=["no flags", "layout given"])
def test_a_real_healthy_pipeline_whose_first_stage_warms_up_reads_healthy(runs, flags):
    """000: GPipe, PP 2 × DDP 2, healthy. Both first-stage ranks spent 110 ms outside communication
    in the first step seen and 155 ms in every later one; judged against their own first step (as the
    layout inferred without flags, one pipeline of TP 2, had them judged) both read 40 % slower."""
    report = _read(runs / "000-none", flags)
    assert report["verdict"] == "healthy", report["suspects"]
