"""The slow verdict's statistical test: Student's t tail, the block test, and healthy jobs under bursts
of host load (which the fixed-threshold rule before it called slow more often the more ranks a job had)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from megatrace.analyzer import analyze
from megatrace.analyzer.layout import LayoutConfig
from megatrace.analyzer.significance import (
    FAMILY_ALPHA,
    PassNoise,
    block_means,
    lateness_test,
    pass_noise,
    t_sf,
)
from tests.support import scenarios as S


@pytest.mark.parametrize(
    ("t", "df", "tail"),
    [(2.0, 10, 0.036694), (3.169, 10, 0.005002), (1.0, 1, 0.25), (0.0, 5, 0.5), (-2.0, 10, 0.963306)],
)
def test_student_t_tail_matches_the_table(t, df, tail):
    assert t_sf(t, df) == pytest.approx(tail, abs=2e-6)


def _lateness(rng: np.random.Generator, members: int, instances: int) -> np.ndarray:
    return rng.normal(0.0, 0.02, (members, instances))


def test_a_member_late_in_every_block_passes_and_one_burst_does_not():
    rng = np.random.default_rng(3)
    late = _lateness(rng, 8, 96)
    late[2] += 0.15  # late by 15 % of the call interval throughout
    late[5, 30:42] += 0.6  # one burst of load: 12 calls late by 60 %
    blocks = block_means(late)
    noise = pass_noise([(np.arange(8), blocks)])
    slow = lateness_test(blocks, 2, 2, noise)
    burst = lateness_test(blocks, 5, 5, noise)
    assert slow is not None and slow.holds(tests=8 * 13)
    assert burst is not None and not burst.holds(tests=8 * 13)
    assert burst.effect < 0.03 < slow.effect


def test_the_correction_grows_with_the_tests_made():
    rng = np.random.default_rng(5)
    late = _lateness(rng, 4, 48)
    late[1] += 0.04
    test = lateness_test(block_means(late), 1, 1, PassNoise())
    assert test is not None and test.holds(tests=1) and not test.holds(tests=10**12)
    assert test.as_dict(10)["p_value"] == pytest.approx(min(1.0, test.p * 10), rel=1e-2)


def test_a_healthy_job_with_bursts_of_host_load_reads_healthy():
    """64 ranks (TP 8 × PP 2 × DP 4) with compute jitter and bursts of load: before the statistical
    test the rule named eight of its ranks slow (rank 39 first), on 1-4 % of the call interval."""
    sc = S.Scenario(world=64, tp=8, pp=2, steps=12, seed=0, jitter=0.04, burst_chance=0.05, burst_ms=3.0)
    report = _analyze_simulated(sc)
    assert report["verdict"] == "healthy", report["suspects"][:2]
    assert report["slow_test"]["alpha"] == FAMILY_ALPHA and report["slow_test"]["tests"] >= 64


def test_a_rank_slowed_by_a_fifth_is_still_named_under_the_same_noise():
    sc = S.Scenario(world=64, tp=8, pp=2, steps=12, seed=0, jitter=0.04, burst_chance=0.05, burst_ms=3.0)
    sc.slow = {37: 0.2}
    report = _analyze_simulated(sc)
    assert report["verdict"] == "slow" and report["suspects"][0]["rank"] == 37
    top = report["suspects"][0]
    assert top["p_value"] <= FAMILY_ALPHA and top["effect_size"] >= 3 * top["noise"] and top["blocks"] >= 3


def _analyze_simulated(sc: S.Scenario) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        S.write_ring_files(S.simulate(sc), Path(tmp) / "job")
        return analyze([Path(tmp) / "job"], LayoutConfig(tp=sc.tp, pp=sc.pp))
