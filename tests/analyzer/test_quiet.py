"""Quiet is measured against the job's own rhythm: step-boundary pauses count, not only the median gap."""

from __future__ import annotations

import os
from pathlib import Path

from megatrace.analyzer import analyze, quiet
from megatrace.analyzer.loader import load
from tests.support import scenarios as S

PAUSE_S = 5.0


def _paused_job(out: Path, dumped_after_s: float) -> Path:
    """Flight Recorder dumps of a 4-rank TP 2 × DP 2 job that pauses `PAUSE_S` after every step (an
    evaluation, a checkpoint), dumped `dumped_after_s` after its last call; its ranks end on two DP
    all-reduces (two communicators), so they did not end together on one call."""
    trace = S.simulate(S.Scenario(world=4, tp=2, pp=1, steps=6, seed=1))
    shift = (trace.step * PAUSE_S * 1e9).astype(trace.enqueue_ns.dtype)
    trace.enqueue_ns = trace.enqueue_ns + shift
    trace.complete_ns = (trace.complete_ns + shift) * (trace.complete_ns > 0)
    S.write_flight_recorder(trace, out)
    stamp = float(trace.enqueue_ns.max()) / 1e9 + dumped_after_s
    for dump in out.iterdir():
        os.utime(dump, (stamp, stamp))
    return out


def test_a_pause_shorter_than_the_jobs_own_step_pauses_is_not_quiet(tmp_path):
    """Dumped 8 s after the last call: 8 s is over the stall threshold and 20 median gaps (the rule
    before called all four ranks quiet, and the job inconclusive), but under 3 of the job's 5 s pauses."""
    folder = _paused_job(tmp_path / "fr", 8.0)
    table, _ = load([folder])
    assert quiet.longest_gap_ns(table) >= PAUSE_S * 1e9
    assert quiet.silent_ranks(table, stall_s=1.0) == {}
    assert analyze([folder])["verdict"] == "healthy"


def test_a_pause_far_longer_than_the_jobs_rhythm_is_quiet(tmp_path):
    folder = _paused_job(tmp_path / "fr", 40.0)
    table, _ = load([folder])
    assert set(quiet.silent_ranks(table, stall_s=1.0)) == {0, 1, 2, 3}
    assert quiet.ended_together(table, quiet.silent_ranks(table, 1.0)) == ""
    assert analyze([folder])["verdict"] == "inconclusive"
