"""Slow ranks found by their own time against the ranks of their pipeline stage.

The ranks of one pipeline stage (its tensor-, context-, expert- and data-parallel peers) run the same
layers on the same shapes, so each step they spend about the same time outside communication (their
*own time*, `own_time`). A rank that computes slower spends more; its peers spend the difference
waiting in the collectives they share with it or in the transfers from it, which is communication,
not own time. Arrival lateness (`slow.py`) sees the same rank only where it delays a collective, and
in a pipeline the schedule's own waits make the call interval long and the lateness a sliver of it.

Per rank and step, its own time over its stage peers' median, less one, is its *excess*. The first
step seen is left out (warm-up: allocator, autotuning, the first step of a schedule). A rank is named
when, over the steps:

- **effect**: the median excess is at least `MIN_EXCESS` and at least `EFFECT_NOISE` times its
  standard error (the excess's robust step-to-step spread over the square root of the steps);
- **significance**: a one-sided Student t statistic of that median against the same spread, at most
  `FAMILY_ALPHA` over the tests the analysis made (every rank, every pass: Bonferroni);
- **consistency**: above its peers by half the effect in at least `CONSISTENT` of the steps, so a
  burst of load on its host over a few steps does not carry it.

A stage whose ranks all slowed together is not a rank's fault and is not named here (its excess is
nil); a rank alone in its stage is left to `own_time`, which compares it with its own earlier steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatrace.analyzer import own_time
from megatrace.analyzer.significance import (
    EFFECT_NOISE,
    FAMILY_ALPHA,
    MEDIAN_SE,
    LatenessTest,
    t_sf,
)
from megatrace.analyzer.table import TraceTable

# a rank 20 % slower in compute spent 12-16 % more own time than its peer in real pipelining runs;
# healthy peers stayed within 5 % of each other in the median under bursts of load
MIN_EXCESS = 0.08
MIN_STEPS = 4  # steps after the first a rank needs to be judged
# above its peers in this share of the steps: a slowdown from the third step of twelve still holds
CONSISTENT = 2 / 3


@dataclass(frozen=True)
class Excess:
    """A rank whose own time a step stands above its stage peers'."""

    rank: int
    own_ns: float  # its median own time a step
    peers_ns: float  # its peers' median
    peers: int
    test: LatenessTest  # effect: the median excess; blocks: the steps judged


def excess_test(excess: np.ndarray) -> LatenessTest:
    """The test's fields for one rank's excess per step (`excess`: one value a step)."""
    steps = len(excess)
    effect = float(np.median(excess))
    spread = 1.4826 * float(np.median(np.abs(excess - effect)))
    error = max(MEDIAN_SE * spread / math.sqrt(steps), 1e-6)
    t = effect / error
    above = float((excess > effect / 2).mean()) if effect > 0 else 0.0
    return LatenessTest(effect, error, t, t_sf(t, steps - 1), steps, above)


def holds(test: LatenessTest, tests: int) -> bool:
    """Significant after the correction for `tests` tests, clear of its error and the floor, consistent."""
    return (
        test.p <= FAMILY_ALPHA / max(tests, 1)
        and test.effect >= max(MIN_EXCESS, EFFECT_NOISE * test.noise)
        and test.late_share >= CONSISTENT
    )


def above_peers(table: TraceTable, stages: np.ndarray) -> list[Excess]:
    """Every rank of a stage of two or more whose own time stands above its peers' (`stages`: the
    stage of every rank), each with its test; whether it holds is the caller's (`holds`)."""
    ranks = sorted(r for r in table.ranks if r < len(stages))
    times = own_time.own_time_matrix(table, ranks)
    if times is None or times.shape[1] < 1 + MIN_STEPS:
        return []
    times = times[:, 1:]
    row = {r: i for i, r in enumerate(ranks)}
    out = []
    for stage in np.unique(stages[ranks]).tolist():
        members = [r for r in ranks if stages[r] == stage]
        if len(members) < 2:
            continue
        rows = times[[row[r] for r in members]]
        for i, rank in enumerate(members):
            peers = np.median(np.delete(rows, i, axis=0), axis=0)
            if np.median(peers) < own_time.MIN_OWN_NS:
                continue
            test = excess_test(rows[i] / np.maximum(peers, 1.0) - 1.0)
            if test.effect > 0:
                out.append(
                    Excess(rank, float(np.median(rows[i])), float(np.median(peers)), len(members) - 1, test)
                )
    return out
