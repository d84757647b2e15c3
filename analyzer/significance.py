"""The slow verdict's statistical test: is a rank's lateness against its peers more than the job's own noise?

A member's lateness in a collective instance (its arrival minus the instance median, as a share of
the call interval) is autocorrelated: a burst of load on a host delays a run of consecutive calls.
So instances are not independent samples; *blocks* of consecutive instances nearly are. Each
communicator's instances are cut into `blocks` contiguous blocks and every member's mean lateness per
block taken. For a suspect the test asks, of its block means:

- **significance**: a one-sided Student t statistic of their median (a burst of load covering fewer
  than half the blocks does not move it) against the peers' pooled robust block-to-block spread (what
  a healthy member's block means wander by), with
  `peers × (blocks - 1)` degrees of freedom, divided by the pass's *inflation*: how much wider that
  statistic spreads over every member of every communicator of the pass than the test assumes
  (`PassNoise`). Blocks of autocorrelated lateness are not independent, so healthy members'
  statistics spread wider than Student's t says; dividing by the measured widening puts the bulk of
  them back on it (genomic control, as association studies calibrate thousands of tests). Bursts of
  load still leave the far tail heavier than that: the p-value alone is not a calibrated false-alarm
  rate, and the effect floors and consistency carry the rest (the null table shows both). The
  statistic counts only the member's independent samples where its own lateness stays correlated
  over longer than a block (`correlation_lengths`). The p-value must be at most `FAMILY_ALPHA`
  divided by the number of tests the analysis made (every rank in every pass), so a 16k-rank job is
  no likelier to be paged for than an 8-rank one (Bonferroni);
- **effect size**: the median block lateness must be at least `MIN_EFFECT` of the call interval, at
  least `EFFECT_NOISE` times the measured noise (the larger of its standard error from the peers'
  block-to-block spread and the pass's spread of every other member's lateness), and clear of the
  latest healthy member among as many as were tested (`extreme` times that spread);
- **consistency**: late by more than the noise and half its own median in at least `CONSISTENT` of
  the blocks since it first was (`consistency`), not carried by a few.

`bench/bench_slow_null.py` calibrates it: the per-job false-alarm rate on healthy runs and synthetic
null traces of 8 to 4,096 ranks, against the bound `FAMILY_ALPHA` (see docs/analyzer.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

FAMILY_ALPHA = 0.01  # the documented bound on the per-job false-alarm rate of a slow verdict
MAX_BLOCKS = 16
MIN_BLOCKS = 3
BLOCK_INSTANCES = 6  # a block holds at least this many instances
SHORT_BLOCK_INSTANCES = 2  # or, in a trace too short for `MIN_BLOCKS` of those, this many
EFFECT_NOISE = 3.0
# a floor above what healthy real runs show (bursts of load made healthy ranks late by 1-2.5 % of the
# call interval in windows) and what bursts of load leave on one of hundreds of healthy simulated ranks
# (3-5 %); a rank 10 % slower in compute is late by 5-10 % of it, 20 % slower in a simulated pipeline
# with TP 8 by 3-5 % (missed)
MIN_EFFECT = 0.05
CONSISTENT = 0.75
# a median lateness this large (a fifth of the call interval) is no burst of the job's noise: half the
# blocks late since its onset suffice (a GC storm's pauses held its rank up in every other block, by half
# the interval)
STRONG_EFFECT = 0.2
MIN_CORRELATION = 0.1  # autocorrelation below this is taken as none (`correlation_lengths`)
MEDIAN_SE = 1.2533
# the inflation is read at the 90th percentile of the pass's statistics (robust to a tenth of the members
# being slow), against the normal distribution's 90th percentile
INFLATION_QUANTILE = 0.9
NORMAL_Q90 = 1.2816
NORMAL_Q75 = 0.6745
TAIL_PAIRS = 100  # statistics a pass needs before its tail is read


@dataclass(frozen=True)
class LatenessTest:
    """One member's lateness in one communicator against its peers' (shares of the call interval)."""

    effect: float  # median lateness over the blocks
    noise: float  # what a healthy member's lateness wanders by (see `lateness_test`)
    t: float
    p: float  # one-sided, uncorrected
    blocks: int
    late_share: float  # share of blocks late by more than the noise and half the effect
    spread: float = 0.0  # how far the other members' lateness spreads (healthy ranks differ this much)

    def holds(self, tests: int, alpha: float = FAMILY_ALPHA) -> bool:
        """Significant after the correction for `tests` tests, clear of the noise and of the most
        extreme healthy member among as many, and consistent."""
        return (
            self.p <= alpha / max(tests, 1)
            and self.effect >= max(MIN_EFFECT, EFFECT_NOISE * self.noise, extreme(tests, alpha) * self.spread)
            and self.late_share >= (CONSISTENT if self.effect < STRONG_EFFECT else 0.5)
        )

    def as_dict(self, tests: int) -> dict[str, float]:
        """The report's fields: effect size, noise, p-value (corrected) and the blocks behind them."""
        return {
            "effect_size": round(self.effect, 4),
            "noise": round(self.noise, 4),
            "p_value": float(f"{min(1.0, self.p * max(tests, 1)):.3g}"),
            "blocks": self.blocks,
        }


def extreme(tests: int, alpha: float = FAMILY_ALPHA) -> float:
    """How many spreads above the centre the latest of `tests` healthy members reaches with chance
    `alpha` (the normal quantile at 1 - alpha / tests): an effect must clear it, so that a job of
    thousands of ranks, whose latest healthy rank sits further out than an 8-rank job's, is not paged
    for more often (3.2 spreads at 16 tests, 3.8 at 128, 4.7 at 8,192)."""
    return NormalDist().inv_cdf(1.0 - alpha / max(tests, 1))


def correlation_lengths(late: np.ndarray) -> np.ndarray:
    """Per member (`late`: members × instances, in time order), how many consecutive instances its
    lateness stays correlated over: the integrated autocorrelation time 1 + 2 Σ ρ_k of its lateness
    about its own mean, summed while ρ_k stays above `MIN_CORRELATION`. A slower rank is late by about
    the same every time (near 1); one that sat in a few long bursts of load is late in runs (about the
    bursts' length), so its instances hold fewer independent samples than they number."""
    members, n = late.shape
    tau = np.ones(members)
    if n < 2 * MIN_BLOCKS:
        return tau
    centred = late - late.mean(axis=1, keepdims=True)
    var = (centred**2).sum(axis=1)
    live = var > 0
    going = live.copy()
    for lag in range(1, n // MIN_BLOCKS):
        lagged = (centred[:, :-lag] * centred[:, lag:]).sum(axis=1)
        rho = np.where(live, lagged / np.where(live, var, 1.0), 0.0)
        going &= rho >= MIN_CORRELATION
        if not going.any():
            break
        tau += np.where(going, 2.0 * rho, 0.0)
    return tau


def block_means(late: np.ndarray) -> np.ndarray:
    """Members × blocks: each member's mean lateness over contiguous blocks of instances (`late`:
    members × instances, in time order). No block when there are too few instances."""
    count = min(MAX_BLOCKS, late.shape[1] // BLOCK_INSTANCES)
    if count < MIN_BLOCKS:  # a short trace (a step's one reduction): smaller blocks, a step or more each
        count = min(MAX_BLOCKS, late.shape[1] // SHORT_BLOCK_INSTANCES)
    if count < MIN_BLOCKS:
        return np.zeros((late.shape[0], 0))
    edges = np.linspace(0, late.shape[1], count + 1).astype(np.int64)
    sums = np.add.reduceat(late, edges[:-1], axis=1)
    return sums / np.diff(edges)[None, :]


@dataclass(frozen=True)
class PassNoise:
    """What the job's noise does to every member's statistic in one pass: lateness is autocorrelated
    (a burst of load delays a run of calls), so block means are not independent and t statistics
    spread wider than Student's t says. Measured over every member of every communicator of the pass
    but the rank under test (`against`): the *inflation* is how much wider their t statistics spread
    than the test assumes (with `TAIL_PAIRS` or more of them: their upper quartile and 90th percentile
    against the normal ones; at least 1; the suspect's t is divided by it; in a small job a slow rank's
    waits spread to its peers' every communicator and would pass for noise), the *spread* the same
    upper-quartile spread of their lateness (a persistent difference between healthy ranks). Only the
    upper side is read: a slow rank's victims arrive early (far below 0) and say nothing of noise."""

    ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    t: np.ndarray = field(default_factory=lambda: np.zeros(0))
    effect: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def against(self, rank: int) -> tuple[float, float]:
        """(inflation, spread) measured without `rank`'s own statistics."""
        others = self.ranks != rank
        t, effect = self.t[others], self.effect[others]
        if len(t) < 2:
            return 1.0, 0.0
        inflation = 1.0
        if len(t) >= TAIL_PAIRS:
            inflation = max(_upper_spread(t), float(np.quantile(t, INFLATION_QUANTILE)) / NORMAL_Q90)
        return max(1.0, inflation), _upper_spread(effect)


def member_stats(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per member of one communicator's block means: its lateness (the median block: a burst of load
    that covers fewer than half the blocks does not move it), the peers' pooled robust block-to-block
    spread (leaving the member out), the t statistic of that median and its degrees of freedom."""
    members, count = blocks.shape
    effect = np.median(blocks, axis=1)
    var = (1.4826 * np.median(np.abs(blocks - effect[:, None]), axis=1)) ** 2
    noise = np.sqrt(np.maximum((var.sum() - var) / max(members - 1, 1), 0.0))
    # the median of `count` normal values has a standard error of about 1.2533 sigma / sqrt(count)
    t = effect / (MEDIAN_SE * np.maximum(noise, 1e-9) / math.sqrt(count))
    return effect, noise, t, np.full(members, (members - 1) * (count - 1))


def pass_noise(comms: list[tuple[np.ndarray, np.ndarray]]) -> PassNoise:
    """The pass's `PassNoise` from every communicator's (members, block means)."""
    parts = [(m, member_stats(b)) for m, b in comms if b.shape[1] >= MIN_BLOCKS and b.shape[0] >= 2]
    if not parts:
        return PassNoise()
    ranks = np.concatenate([m for m, _stats in parts])
    effect = np.concatenate([stats[0] for _m, stats in parts])
    t = np.concatenate([stats[2] for _m, stats in parts])
    return PassNoise(ranks, t, effect)


def _upper_spread(values: np.ndarray) -> float:
    """A spread read from the upper quartile alone, around 0 (where a healthy member's statistic
    centres): the victims of a slow rank sit far below 0 (they wait), and must not widen it."""
    return max(0.0, float(np.quantile(values, 0.75)) / NORMAL_Q75)


def lateness_test(
    blocks: np.ndarray, row: int, rank: int, noise: PassNoise, independent: float = math.inf
) -> LatenessTest | None:
    """The test for member `row` (global `rank`) of a communicator's block means (None: too few blocks
    or no peers). `independent`: how many independent samples the member's instances hold (instances
    over its `correlation_lengths`); where that is fewer than the blocks, its statistic counts only
    those."""
    count = blocks.shape[1]
    if count < MIN_BLOCKS or blocks.shape[0] < 2:
        return None
    effect, spread, t, df = (values[row] for values in member_stats(blocks))
    inflation, others = noise.against(rank)
    samples = max(1.0, min(float(count), independent))
    z = float(t) / inflation * math.sqrt(samples / count)
    # what a healthy member's lateness over these blocks wanders by: its standard error, or the spread
    # between the other members' lateness where that is wider
    measured = max(MEDIAN_SE * float(spread) / math.sqrt(samples), others)
    late = consistency(blocks[row], max(measured, float(effect) / 2))
    return LatenessTest(float(effect), measured, z, t_sf(z, int(df)), count, late, others)


def consistency(blocks: np.ndarray, level: float) -> float:
    """The share of a member's blocks late by more than `level` (its noise, and half its own median
    lateness: a slower rank is late by about as much in most blocks, one that sat in bursts of load
    only in the blocks they cover), counted from its onset where it was not late before: a slowdown
    that began a few blocks into the trace (within its first half) is late in the blocks since."""
    late = blocks > level
    if not late.any():
        return 0.0
    onset = int(np.argmax(late))
    if onset > (len(late) - 1) // 2:
        onset = 0
    return float(late[onset:].mean())


def rise_test(excess: float, noise: float, before: int, after: int) -> LatenessTest:
    """The same fields for a rank judged against its own earlier steps (`own_time`): the rise beyond the
    other ranks' as the effect, the job's step-to-step noise as the noise, a two-sample t statistic over
    the steps before and after."""
    spread = max(noise, 1e-9) * math.sqrt(1 / max(before, 1) + 1 / max(after, 1))
    t = excess / spread
    return LatenessTest(excess, noise, t, t_sf(t, max(before + after - 2, 1)), before + after, 1.0)


def t_sf(t: float, df: int) -> float:
    """P(T ≥ t) for Student's t with `df` degrees of freedom."""
    if not math.isfinite(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below this point: use the symmetry
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    value = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            value *= c * d
        if abs(c * d - 1.0) < 1e-14:
            break
    return math.exp(log_front) * value / a
