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
    CONSISTENT,
    FAMILY_ALPHA,
    PassNoise,
    block_means,
    consistency,
    correlation_lengths,
    extreme,
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
    late[1] += 0.06
    test = lateness_test(block_means(late), 1, 1, PassNoise())
    assert test is not None and test.holds(tests=1) and not test.holds(tests=10**12)
    assert test.as_dict(10)["p_value"] == pytest.approx(min(1.0, test.p * 10), rel=1e-2)


def test_lateness_in_runs_holds_fewer_independent_samples_than_calls():
    rng = np.random.default_rng(7)
    late = _lateness(rng, 2, 96)
    late[1] = np.repeat(rng.normal(0.0, 0.05, 12), 8)  # a level held for 8 calls at a time
    steady, bursty = correlation_lengths(late)
    assert steady < 2 and bursty > 4


def test_an_effect_must_clear_the_latest_healthy_member_among_as_many_tested():
    assert extreme(16) == pytest.approx(3.23, abs=0.01)
    assert extreme(128) == pytest.approx(3.78, abs=0.01)
    assert extreme(8192) == pytest.approx(4.71, abs=0.01)


def test_a_member_late_only_in_the_blocks_its_bursts_cover_is_not_consistent():
    """Late by 8 % in four blocks of eight and level in the rest: its median is between, significant, and
    above the floor, but a slower rank is late by about its median in most blocks."""
    rng = np.random.default_rng(11)
    late = _lateness(rng, 8, 96) / 10
    late[3] += np.repeat([0.16, 0.16, 0.0, 0.16, 0.0, 0.16, 0.0, 0.0], 12)
    blocks = block_means(late)
    test = lateness_test(blocks, 3, 3, pass_noise([(np.arange(8), blocks)]))
    assert test is not None and test.p < 1e-6 and test.effect > 0.05
    assert test.late_share == pytest.approx(0.5) and not test.holds(tests=16)


@pytest.mark.parametrize(
    ("blocks", "share"),
    [
        ([0.0, 0.0, 0.1, 0.1, 0.11, 0.1, 0.09, 0.1], 1.0),  # a slowdown from the third block on
        ([0.1, 0.1, 0.1, 0.0, 0.1, 0.1, 0.1, 0.1], 0.875),  # one block level
        ([0.0, 0.1, 0.0, 0.1, 0.0, 0.1, 0.0, 0.1], 4 / 7),  # late every other block since the second
        ([0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.1], 0.375),  # an onset in the second half: all blocks
        ([0.1, 0.1, 0.1, 0.1, 0.1, 0.0, 0.0, 0.0], 0.625),  # a slowdown that ended
    ],
)
def test_consistency_counts_the_blocks_since_an_onset_in_the_first_half(blocks, share):
    assert consistency(np.array(blocks), 0.02) == pytest.approx(share)


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


@pytest.mark.parametrize(("level", "named"), [(0.5, True), (0.08, False)])
def test_late_in_two_blocks_of_three_is_named_only_when_the_lateness_is_large(level, named):
    """A GC storm's pauses held its rank up by half the call interval in half of the blocks (a real
    cause-test run under two busy loops read healthy); bursts of load leave healthy ranks a few percent
    late in the blocks they cover."""
    rng = np.random.default_rng(13)
    late = _lateness(rng, 3, 96) / 10
    late[1] += np.repeat([level, level + 0.01, 0.0] * 5 + [level], 6)
    blocks = block_means(late)
    test = lateness_test(blocks, 1, 1, pass_noise([(np.arange(3), blocks)]))
    assert test is not None and 0.5 <= test.late_share < CONSISTENT
    assert test.holds(tests=16) is named
