"""Slow-rank localization: who arrives last at collectives, again and again, once clock skew is removed.

Every collective instance (communicator, sequence) is a column of a members × instances matrix of
enqueue times. Clock skew first: each node's clock offset is the median, over its ranks and the
instances of communicators spanning several nodes, of how far its members' *completion* times sit
from the instance median (a collective completes at the same moment on every member, so this is
pure skew). Logs without completion times use the enqueue times instead, so a constant per-node
lateness is taken for skew there. After removing the offsets, a member's *lateness* in an instance
is its enqueue time minus the instance median. A rank is late in a communicator when it arrives
after the median in most instances (persistence) by a median margin of at least `MIN_REL` of the
communicator's call interval (effect size). A rank late in *every* communicator it belongs to is a
straggler; ranks late only where they wait for a straggler are victims. Ranks of different pipeline
stages are never compared (the schedule decides who arrives last); pipeline transfers are compared
with the same transfers of other pipelines instead.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from megatrace.analyzer import own_time, peer_time
from megatrace.analyzer.layout import Layout
from megatrace.analyzer.significance import (
    FAMILY_ALPHA,
    LatenessTest,
    PassNoise,
    block_means,
    correlation_lengths,
    lateness_test,
    pass_noise,
    rise_test,
)
from megatrace.analyzer.table import TraceTable

MIN_INSTANCES = 8
MAX_INSTANCES = 20000
WHOLE_INSTANCES = 1000  # the whole-trace pass looks at the newest ones
WINDOW_SAMPLE = 128
WINDOW_INSTANCES = 64  # instances of a communicator a time window needs before it is judged alone
WINDOW_MIN_REL = 0.05  # a straggler found in one window only (of many looked at) must be this late
MAX_WINDOWS = 12
MIN_REL = 0.01
_DIRECTED = re.compile(r"(-?\d+), (-?\d+)\)$")  # a pipeline channel's key ends with (…, src, dst)
MIN_PERSISTENCE = 0.7
# A rank held up once in every few instances (a data loader before each microbatch's first collective,
# a link slow for one kind of call) barely moves its median lateness: it is late where it is late by
# more than `SIG_REL` of the call interval in `NET_MIN` more of the instances than it is early by as much.
SIG_REL = 0.05
NET_MIN = 0.2
# ...or late less often (a data loader holds up one collective of a microbatch's dozens) but by enough
# that its peers wait for it `MEAN_REL` of the call interval on average, in `NET_MIN / 2` more instances
MEAN_REL = 0.01
TRIM = 0.05  # the mean lateness leaves out this share of each member's instances at either end
MAX_PASSES = 3
# a payload this small is a scalar (a loss, a gradient norm, a flag), not a layer's or a gradient's data
SCALAR_BYTES = 64


@dataclass
class CommLateness:
    comm: int
    members: np.ndarray
    late_ns: np.ndarray  # median lateness per member
    persistence: np.ndarray  # share of instances arriving after the median
    net: np.ndarray  # share of instances late by `SIG_REL` of the interval, less the share early by as much
    mean_ns: np.ndarray  # trimmed mean lateness per member (`TRIM`)
    interval_ns: float
    instances: int
    blocks: np.ndarray  # members × blocks: mean lateness over consecutive instances (`significance`)
    late: np.ndarray  # members × instances: lateness as a share of the call interval


@dataclass
class SlowSuspect:
    rank: int
    confidence: float
    evidence: str
    relative: float
    test: LatenessTest | None = None  # the statistical test it passed (`significance`)


@dataclass
class SlowResult:
    suspects: list[SlowSuspect]
    skew_ns: dict[str, float] = field(default_factory=dict)
    measured: int = 0
    notes: list[str] = field(default_factory=list)
    tests: int = 1  # statistical tests made (ranks × passes): the correction of every suspect's p-value
    least_p: float = 1.0  # the smallest corrected p-value of any rank that looked late, named or not

    def test_summary(self) -> dict[str, float]:
        """The report's ``slow_test``: the bound, the tests it was corrected for, the smallest p seen."""
        return {"alpha": FAMILY_ALPHA, "tests": self.tests, "least_p": float(f"{self.least_p:.3g}")}


def rank_hosts(table: TraceTable, layout: Layout | None) -> list[str]:
    """Clock domain of every rank, for skew correction: its host where the logs name it, else its node
    by the layout (8 ranks a node by default). Reports name only hosts the logs give."""
    per_node = layout.gpus_per_node if layout else 8
    hosts = [f"node{r // per_node}" for r in range(table.world_size)]
    for rank, info in table.ranks.items():
        if info.host:
            hosts[rank] = info.host
    return hosts


@dataclass
class _Comm:
    """One usable communicator's rows, sorted: its members and, per member row, rank, seq, times."""

    comm: int
    members: np.ndarray
    rank: np.ndarray
    seq: np.ndarray
    enq: np.ndarray
    done: np.ndarray
    low: int  # the first sequence number looked at
    times: np.ndarray  # per sequence number from `low`: its first member's enqueue time (NaN: absent)
    t0: int  # times are from this moment


def _comms(table: TraceTable, channels: frozenset[int] = frozenset()):
    """Yield every communicator (and every pipeline channel in `channels`) with enough instances to judge,
    as one contiguous slice of rows."""
    cols = table.columns
    usable = np.array(
        [len(c.members) >= 2 and (not c.p2p or i in channels) for i, c in enumerate(table.comms)] + [False],
        dtype=bool,
    )
    comm = cols["comm"]
    keep = np.flatnonzero(usable[comm]) if len(comm) else np.zeros(0, dtype=np.int64)
    if not len(keep):
        return
    key = comm[keep]
    key = key.astype(np.int16) if len(table.comms) < 32767 else key
    order = keep[np.argsort(key, kind="stable")]
    counts = np.bincount(key, minlength=len(table.comms))
    del keep, key
    # the needed columns once in communicator order: every communicator is then one contiguous slice
    c_rank, c_seq = cols["rank"][order], cols["seq"][order]
    c_enq, c_done = cols["enqueue_ns"][order], cols["complete_ns"][order]
    del order
    t0 = int(c_enq.min())
    present = np.flatnonzero(counts)
    ends = np.cumsum(counts[present])
    for c, lo, hi in zip(present.tolist(), (ends - counts[present]).tolist(), ends.tolist(), strict=True):
        members = np.asarray(table.comms[c].members, dtype=np.int64)
        seq = c_seq[lo:hi]
        if len(seq) < MIN_INSTANCES * len(members):
            continue
        # sequence numbers are consecutive per communicator: they index the instances directly (only the
        # newest 2 * MAX_INSTANCES are looked at)
        top = int(seq.max())
        low = max(int(seq.min()), top - 2 * MAX_INSTANCES + 1)
        rows = slice(lo, hi)
        first = (c_rank[rows] == members[0]) & (seq >= low)
        times = np.full(top - low + 1, np.nan)
        times[seq[first] - low] = c_enq[rows][first] - t0
        yield _Comm(c, members, c_rank[rows], seq, c_enq[rows] - t0, c_done[rows], low, times, t0)


def _matrix(cm: _Comm, wanted: np.ndarray, hosts: list[str]):
    """(comm, members, enqueue matrix, completion matrix or None) over the `wanted` sequence numbers
    (ascending) that every member reached. Completion times serve clock alignment only, so they are
    gathered only for communicators spanning several hosts."""
    pos = np.full(len(cm.times), -1, dtype=np.int64)
    pos[wanted - cm.low] = np.arange(len(wanted))
    inside = cm.seq >= cm.low
    col = np.where(inside, pos[np.where(inside, cm.seq - cm.low, 0)], -1)
    idx = np.minimum(np.searchsorted(cm.members, cm.rank), len(cm.members) - 1)
    take = np.flatnonzero((col >= 0) & (cm.members[idx] == cm.rank))
    enq = np.full((len(cm.members), len(wanted)), np.nan)
    enq[idx[take], col[take]] = cm.enq[take]
    full = ~np.isnan(enq).any(axis=0)
    done = None
    if len({hosts[m] for m in cm.members.tolist()}) > 1:
        raw = cm.done[take]
        done = np.full(enq.shape, np.nan)
        done[idx[take], col[take]] = np.where(raw > 0, raw - cm.t0, np.nan)
        done = done[:, full]
        done = None if bool(np.isnan(done).any()) else done
    return cm.comm, cm.members, enq[:, full], done, wanted[full]


def _host_offsets(mats, hosts: list[str]) -> dict[str, float]:
    """Per-host clock offset (ns) from communicators spanning several hosts."""
    per_rank: dict[int, list[float]] = {}
    for _c, members, enq, done in mats:
        if len({hosts[m] for m in members.tolist()}) < 2:
            continue
        ref = done if done is not None else enq
        dev = np.median(ref - np.median(ref, axis=0, keepdims=True), axis=1)
        for m, d in zip(members.tolist(), dev.tolist(), strict=True):
            per_rank.setdefault(m, []).append(d)
    per_host: dict[str, list[float]] = {}
    for rank, values in per_rank.items():
        per_host.setdefault(hosts[rank], []).append(float(np.median(values)))
    return {host: float(np.median(values)) for host, values in per_host.items()}


def _aligned(mat, hosts: list[str], offsets: dict[str, float]):
    """The matrix with every member's clock offset taken out of its arrivals."""
    c, members, enq, done, kept = mat
    shift = np.array([offsets.get(hosts[m], 0.0) for m in members.tolist()])[:, None]
    return c, members, enq - shift, done, kept


def _channel_classes(table: TraceTable, layout: Layout | None) -> dict[int, tuple[tuple[int, int], int]]:
    """Pipeline channels worth judging: their class, (stage of sender, stage of receiver), and sender.
    Channels of one class carry the same transfers of other pipeline replicas (DP) or tensor ranks (TP),
    so a channel whose sender or receiver runs late against its class shows a slow rank; a stage that is
    slower by design (the loss, the embedding) is slow in every channel of its class alike. A class
    of one channel (a single pipeline) has nothing to compare with and is left out."""
    if layout is None or layout.sizes.get("pp", 1) < 2:
        return {}
    found: dict[int, tuple[tuple[int, int], int]] = {}
    for i, comm in enumerate(table.comms):
        direction = _DIRECTED.search(comm.key) if comm.p2p else None
        if direction is None:
            continue
        src, dst = int(direction[1]), int(direction[2])
        if max(src, dst) < layout.world_size and src != dst:
            found[i] = ((layout.coords(src)["pp"], layout.coords(dst)["pp"]), src)
    sizes = Counter(cls for cls, _src in found.values())
    return {i: entry for i, entry in found.items() if sizes[entry[0]] >= 2}


def _pipeline_residuals(mats: dict, classes: dict[int, tuple[tuple[int, int], int]]) -> None:
    """Judge each pipeline channel against its class: the sender's lead over the receiver in every
    transfer, less the class's median lead in the same transfer (sequence number), is what is left for
    a slow rank to explain. The channel's two rows are rewritten around their midpoints, so the call
    interval and the time windows stay as they were."""
    by_class: dict[tuple[int, int], list[int]] = {}
    for i, mat in mats.items():
        if mat[0] in classes:
            by_class.setdefault(classes[mat[0]][0], []).append(i)
    for channels in by_class.values():
        if len(channels) < 2:
            continue
        seqs = np.unique(np.concatenate([mats[i][4] for i in channels]))
        lead = np.full((len(channels), len(seqs)), np.nan)
        sender = {}
        for row, i in enumerate(channels):
            c, members, t, _done, kept = mats[i]
            sender[i] = int(members[0] != classes[c][1])  # the sender's row
            lead[row, np.searchsorted(seqs, kept)] = (t[sender[i]] - t[1 - sender[i]]) / 2
        typical = np.nanmedian(lead, axis=0)
        for row, i in enumerate(channels):
            c, members, t, done, kept = mats[i]
            at = np.searchsorted(seqs, kept)
            rest = lead[row, at] - typical[at]
            mid = t.mean(axis=0)
            fixed = np.empty_like(t)
            fixed[sender[i]], fixed[1 - sender[i]] = mid + rest, mid - rest
            mats[i] = (c, members, fixed, done, kept)


def comm_lateness(
    mats,
    masked: frozenset[int] = frozenset(),
    strides: dict[int, int] | None = None,
) -> list[CommLateness]:
    """Lateness of every member per communicator (clocks already aligned); `masked` ranks are left out of
    the instance medians. `strides`: communicators whose instances were sampled every k-th (the call
    interval is k times less than the gap between the instances kept)."""
    out = []
    for c, members, t, _done in mats:
        unmasked = np.array([m not in masked for m in members.tolist()])
        med = np.median(t[unmasked] if unmasked.any() else t, axis=0)
        late = t - med[None, :]
        # the mean interval between instances: the median of consecutive gaps is too small where calls
        # come in bursts, and meaningless where instances of merged groups interleave
        interval = float((med.max() - med.min()) / (len(med) - 1)) if len(med) > 1 else 0.0
        interval = max(interval / (strides or {}).get(c, 1), 1.0)
        big = SIG_REL * interval
        net = (late >= big).mean(axis=1) - (late <= -big).mean(axis=1)
        cut = int(TRIM * late.shape[1])
        mean = np.sort(late, axis=1)[:, cut : late.shape[1] - cut].mean(axis=1)
        if unmasked.sum() == 1:  # its own median: the one member left says nothing of itself
            net[unmasked] = np.nan
            mean[unmasked] = np.nan
        out.append(
            CommLateness(
                c,
                members,
                np.median(late, axis=1),
                (late > 0).mean(axis=1),
                net,
                mean,
                interval,
                t.shape[1],
                block_means(rel := late / interval),
                rel,
            )
        )
    return out


class _Seen(NamedTuple):
    """How one member arrives in one communicator, against the instance medians."""

    rel: float  # median lateness, relative to the call interval
    pers: float  # share of instances after the median
    net: float  # share of instances clearly late, less the share clearly early (`SIG_REL`)
    mean: float  # trimmed mean lateness, relative to the call interval
    cl: CommLateness

    @property
    def late(self) -> bool:
        """Late here: most of the time by a margin, or clearly late often enough."""
        return (self.rel >= MIN_REL and self.pers >= MIN_PERSISTENCE) or self.clearly_late

    @property
    def clearly_late(self) -> bool:
        """Late by a wide margin in a good share of instances, or in fewer but by enough that the
        others wait for it `MEAN_REL` of the call interval on average."""
        return self.net >= NET_MIN or (self.net >= NET_MIN / 2 and self.mean >= MEAN_REL)

    @property
    def waits(self) -> bool:
        """Clearly early as often (the same measures, mirrored): the member waits here for another."""
        return self.net <= -NET_MIN or (self.net <= -NET_MIN / 2 and self.mean <= -MEAN_REL)


@dataclass
class _Round:
    """Lateness tables of one pass: per rank and communicator, how it arrives there."""

    late: dict[int, dict[int, _Seen]]
    is_late: dict[int, set[int]]
    judged: dict[int, set[int]]
    local: set[int]
    channels: frozenset[int]  # pipeline channels among the communicators
    clearly: set[
        int
    ]  # ranks clearly late in a communicator they are judged in (`_Seen.clearly_late`), waiting nowhere
    noise: PassNoise = field(default_factory=PassNoise)  # what the job's noise does to the test statistic


def _lateness_round(per_comm: list[CommLateness], hosts: list[str], channels: frozenset[int]) -> _Round:
    late: dict[int, dict[int, _Seen]] = {}
    for cl in per_comm:
        rel = cl.late_ns / cl.interval_ns
        for i, m in enumerate(cl.members.tolist()):
            late.setdefault(m, {})[cl.comm] = _Seen(
                float(rel[i]),
                float(cl.persistence[i]),
                float(cl.net[i]),
                float(cl.mean_ns[i] / cl.interval_ns),
                cl,
            )
    is_late = {m: {c for c, seen in comms.items() if seen.late} for m, comms in late.items()}
    # communicators inside one host share a clock: lateness there needs no skew correction, so a rank
    # with such communicators is judged on them alone (its cross-host lateness may be absorbed as skew)
    local = {cl.comm for cl in per_comm if len({hosts[m] for m in cl.members.tolist()}) == 1}
    judged = {m: (set(comms) & local) or set(comms) for m, comms in late.items()}
    rnd = _Round(
        late,
        is_late,
        judged,
        local,
        channels,
        set(),
        pass_noise([(cl.members, cl.blocks) for cl in per_comm]),
    )
    rnd.clearly = {
        m
        for m, comms in judged.items()
        if any(late[m][c].clearly_late for c in comms - channels) and not _waits(m, rnd)
    }
    return rnd


def _trails_everywhere(m: int, rnd: _Round) -> bool:
    """A straggler is clearly late in some communicator and waits in none: in every other one it arrives
    after the median in most instances, or is neither clearly late nor clearly early there. (Where its
    call follows another collective with little compute in between, it is late by less than `MIN_REL`,
    but not early.) A victim arrives early where it waits: in the pipeline channel to the slow rank, or
    in the communicator it shares with it. Members of one communicator clearly late elsewhere together,
    waiting nowhere (a whole tensor-parallel group behind in its data-parallel groups, level within
    itself), share a cause, a pipeline neighbour they wait for: none of them is named on that alone.
    (A data loader's TP peer is late in its DP group too, but waits for the loader in their group.)"""
    judged = rnd.judged[m]
    if not judged or not (rnd.is_late[m] & judged):
        return False
    late = rnd.late[m]
    if any(_early(late[c]) for c in late.keys() & rnd.channels):
        return False
    return all(
        c in rnd.is_late[m]
        or (c in rnd.channels and not _early(late[c]))
        or (c not in rnd.channels and not late[c].waits and _not_behind(late[c], _alone(m, late[c], rnd)))
        for c in judged
    )


def _alone(m: int, seen: _Seen, rnd: _Round) -> bool:
    """`m` is clearly late somewhere, and no other member of this communicator is."""
    return m in rnd.clearly and not (set(seen.cl.members.tolist()) - {m}) & rnd.clearly


def _waits(m: int, rnd: _Round) -> bool:
    """Waits for another rank somewhere it is judged, or in a pipeline channel: a channel says who waits
    for whom even across hosts (each is judged against its class, so host clock offsets cancel)."""
    late = rnd.late[m]
    return any(_early(late[c]) for c in late.keys() & rnd.channels) or any(
        late[c].waits for c in rnd.judged[m] - rnd.channels
    )


def _not_behind(seen: _Seen, clearly: bool) -> bool:
    """Arrives after the median as often as a straggler does. A rank `clearly` late elsewhere (often
    by a wide margin) need only be seldom far from the median either way: its collectives there
    follow others with little compute in between, where nobody waits long."""
    return (seen.rel >= 0 and seen.pers >= MIN_PERSISTENCE) or (
        clearly and seen.rel > -MIN_REL / 2 and abs(seen.net) < NET_MIN / 2
    )


def _early(seen: _Seen) -> bool:
    """Arrives before its channel peer more often than not, by half the margin that makes a rank late:
    it waits there for the peer. A channel has two ends only, so its noise is large: there a straggler
    need only not be early, while in a communicator it must arrive after the median as often as a
    straggler does."""
    return (seen.rel <= -MIN_REL / 2 and seen.pers < 0.5) or seen.waits


def _straggler(m: int, rnd: _Round, tests: int) -> SlowSuspect:
    late, judged = rnd.late, rnd.judged
    pers = min(late[m][c].pers for c in judged[m])
    # shown and ranked by the busiest communicator it is clearly late in (the most instances)
    shown = max((late[m][c] for c in judged[m] & rnd.is_late[m]), key=lambda seen: seen.cl.instances)
    cl, where = shown.cl, "same-host " if judged[m] <= rnd.local else ""
    ms = cl.late_ns[list(cl.members).index(m)] / 1e6
    if shown.rel >= MIN_REL and shown.pers >= MIN_PERSISTENCE:
        rel, sure = shown.rel, pers
        how = (
            f"rank {m} arrived after the median in {pers:.0%} of {cl.instances} collectives of every "
            f"{where}communicator it is in, by a median {rel:.1%} of the call interval ({ms:.2f} ms on "
            f"a communicator of {len(cl.members)} ranks)."
        )
    else:
        rel, sure = max(shown.net * SIG_REL, shown.mean), min(1.0, shown.net / (2 * NET_MIN))
        how = (
            f"rank {m} arrived over {SIG_REL:.0%} of the call interval after the median in "
            f"{shown.net:.0%} more of {cl.instances} collectives than it arrived as early, "
            f"{shown.mean:.1%} of the interval late on average (on a communicator of {len(cl.members)} "
            f"ranks), and waited in no {where}communicator it is in."
        )
    sure = float(np.clip(sure * min(1.0, rel / (2 * MIN_REL)), 0.0, 0.99))
    return SlowSuspect(m, round(sure, 2), how, rel, _best_test(m, rnd, tests))


def _best_test(m: int, rnd: _Round, tests: int) -> LatenessTest | None:
    """The statistical test of `m`'s lateness in the communicators it is late in: the one that holds
    with the largest effect, else the strongest (for the note on what stayed within the noise)."""
    found = []
    for c in rnd.judged[m] & rnd.is_late[m]:
        cl = rnd.late[m][c].cl
        row = int(np.flatnonzero(cl.members == m)[0])
        length = float(correlation_lengths(cl.late[row : row + 1])[0])
        test = lateness_test(cl.blocks, row, m, rnd.noise, cl.instances / length)
        if test is not None:
            found.append(test)
    holding = [test for test in found if test.holds(tests)]
    if holding:
        return max(holding, key=lambda test: test.effect)
    return max(found, key=lambda test: test.t, default=None)


def detect_slow(table: TraceTable, layout: Layout | None = None) -> SlowResult:
    """Stragglers over the whole trace and, in long traces, in each time window (a slowdown that lasted
    a while is found even when the trace goes on healthy for longer)."""
    hosts = rank_hosts(table, layout)
    classes = _channel_classes(table, layout)
    comms = list(_comms(table, frozenset(classes)))
    plan = _time_windows(comms)
    stages = _stages(table, layout)
    syncs = _step_syncs(table, stages)
    # one matrix per communicator over every instance some pass looks at; each pass takes its columns
    wanted = [_union([seqs[i] for _l, seqs, _s in plan if i in seqs], cm.low) for i, cm in enumerate(comms)]
    built = [_matrix(cm, w, hosts) for cm, w in zip(comms, wanted, strict=True)]
    mats = {i: m for i, m in enumerate(built) if m[2].shape[1] >= MIN_INSTANCES}
    offsets = _host_offsets([m[:4] for m in mats.values()], hosts)
    mats = {i: _aligned(m, hosts, offsets) for i, m in mats.items()}
    _pipeline_residuals(mats, classes)
    channels = frozenset(classes)
    best: dict[int, SlowSuspect] = {}
    # every rank may be tested in every pass, and against its stage's own time: the significance level
    # is corrected for all of them
    tests = max(table.world_size, 1) * (len(plan) + int(stages is not None))
    rejected: list[SlowSuspect] = []
    windows: dict[int, int] = {}
    whole: set[int] = set()
    compared: set[int] = set()
    for window, seqs, strides in plan:
        part = []
        for i, want in seqs.items():
            if i not in mats or mats[i][0] in syncs:
                continue
            c, members, enq, done, kept = mats[i]
            cols = _within(kept, want)
            if not window:  # the newest instances every member reached
                cols &= np.cumsum(cols[::-1])[::-1] <= WHOLE_INSTANCES
            if cols.sum() < MIN_INSTANCES:
                continue
            for rows in _same_stage(members, stages, c in channels):
                part.append(
                    (c, members[rows], enq[rows][:, cols], None if done is None else done[rows][:, cols])
                )
                compared.update(members[rows].tolist())
        for suspect in _stragglers(part, hosts, strides, channels, tests):
            if window and suspect.relative < WINDOW_MIN_REL:
                continue
            if suspect.test is None or not suspect.test.holds(tests):
                rejected.append(suspect)
                continue
            if window:
                suspect.evidence += f" ({window})"
                windows[suspect.rank] = windows.get(suspect.rank, 0) + 1
            else:
                whole.add(suspect.rank)
            _keep_larger(best, suspect)
    if stages is not None:
        for suspect in _above_stage_peers(table, stages, tests):
            whole.add(suspect.rank)
            _keep_larger(best, suspect)
    for suspect in _against_own_steps(table, set(table.ranks) - compared):
        whole.add(suspect.rank)
        best.setdefault(suspect.rank, suspect)
    # one window alone, out of a dozen looked at, is too easily noise: a slowdown must last two
    suspects = [s for r, s in best.items() if r in whole or windows.get(r, 0) >= 2]
    suspects.sort(key=lambda s: (-s.relative, s.rank))
    notes = []
    if syncs:
        notes.append(
            "no rank was compared with another: the traces hold only the whole job's scalar reductions "
            "(a loss or a norm, once a step) and tell no pipeline stage, and where ranks reach those is "
            "their place in a pipeline schedule as much as their speed (give the layout: --pp, --tp)"
        )
    notes += _within_noise(rejected, {s.rank for s in suspects}, tests)
    seen = [s.test.p * tests for s in [*rejected, *suspects] if s.test is not None]
    return SlowResult(suspects, offsets, len(mats), notes, tests, min([1.0, *seen]))


def _keep_larger(best: dict[int, SlowSuspect], suspect: SlowSuspect) -> None:
    """Keep, per rank, the evidence of the largest slowdown found for it."""
    if suspect.rank not in best or suspect.relative > best[suspect.rank].relative:
        best[suspect.rank] = suspect


def _union(parts: list[np.ndarray], low: int) -> np.ndarray:
    """The sorted union of sequence numbers (each at least `low`), by a mask: no sort."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return np.zeros(0, dtype=np.int64)
    mask = np.zeros(max(int(p.max()) for p in parts) - low + 1, dtype=bool)
    for part in parts:
        mask[part - low] = True
    return np.flatnonzero(mask) + low


def _within(kept: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Which of the ascending sequence numbers `kept` are in the ascending `want`."""
    at = np.minimum(np.searchsorted(want, kept), max(len(want) - 1, 0))
    return want[at] == kept if len(want) else np.zeros(len(kept), dtype=bool)


def _within_noise(rejected: list[SlowSuspect], named: set[int], tests: int) -> list[str]:
    """A note on the rank that looked latest but did not pass the statistical test (none if named)."""
    left = [(s.rank, s.test) for s in rejected if s.rank not in named and s.test is not None]
    if not left:
        return []
    rank, test = max(left, key=lambda item: item[1].t)
    return [
        f"rank {rank} arrived late on average by {test.effect:.1%} of the call interval, within the job's "
        f"own noise (block-to-block spread {test.noise:.1%}, corrected p {min(1.0, test.p * tests):.2g}, "
        f"late in {test.late_share:.0%} of {test.blocks} blocks): not named"
    ]


def _step_syncs(table: TraceTable, stages: np.ndarray | None) -> frozenset[int]:
    """Communicators whose arrival order says nothing of speed: with no pipeline stage known,
    collectives that only ever carry a scalar across the whole job. In a pipeline the first stage
    reaches the step's loss reduction last by design, and where the stages cannot be told (torch's
    Flight Recorder on gloo records no send or receive; Megatrace's NCCL logs name no peer, so their
    transfers' pairing is a guess the layout inference does not take) nothing says who is which; a
    data-parallel job shows its gradients' reductions, which ranks doing the same work do reach
    together. Empty where any other collective is seen."""
    comms = table.comms
    if stages is not None or not len(table):
        return frozenset()
    shared = [i for i, c in enumerate(comms) if len(c.members) >= 2 and not c.p2p]
    if not shared or any(len(comms[i].members) != table.world_size for i in shared):
        return frozenset()
    cols = table.columns
    if int(cols["nbytes"][np.isin(cols["comm"], shared)].max()) > SCALAR_BYTES:
        return frozenset()
    return frozenset(shared)


def _above_stage_peers(table: TraceTable, stages: np.ndarray, tests: int) -> list[SlowSuspect]:
    """Ranks whose own time a step stands above their stage peers' (`peer_time`), by its test."""
    out = []
    for found in peer_time.above_peers(table, stages):
        test = found.test
        if not peer_time.holds(test, tests):
            continue
        how = (
            f"rank {found.rank} spent {found.own_ns / 1e6:.1f} ms a step outside communication against "
            f"{found.peers_ns / 1e6:.1f} ms for the {found.peers} other rank(s) of its pipeline stage "
            f"(+{test.effect:.0%} in the median of {test.blocks} steps, above them by half that in "
            f"{test.late_share:.0%} of the steps; corrected p {min(1.0, test.p * tests):.2g})"
        )
        sure = min(0.99, test.effect / (4 * peer_time.MIN_EXCESS))
        out.append(SlowSuspect(found.rank, round(float(sure), 2), how, test.effect, test))
    return out


def _against_own_steps(table: TraceTable, ranks: set[int]) -> list[SlowSuspect]:
    """`ranks` judged against their own earlier steps (`megatrace.analyzer.own_time`): those no
    communicator compared with a peer (the stages of a single pipeline with no tensor parallelism).
    A rank with stage peers is judged against them instead (`_above_stage_peers`): a change its whole
    stage shares (a schedule's warm-up, the machine's load) is not a rank's."""
    out = []
    for rise in own_time.slowed_down(table, sorted(ranks)):
        why = "no rank does its work to compare it with"
        how = (
            f"rank {rise.rank} spent {rise.after_ns / 1e6:.1f} ms a step outside communication from step "
            f"{rise.step + 1} on (of {rise.steps} steps seen), against {rise.before_ns / 1e6:.1f} ms before "
            f"(+{rise.excess:.0%} beyond the other ranks' change of {rise.others:+.0%}); {why}, so it is "
            "compared with its own earlier steps."
        )
        sure = min(0.99, rise.excess / (4 * own_time.MIN_RISE)) * (rise.steps - rise.step) / rise.steps
        # own_time's rule (a rise of 5 times the step-to-step noise, held in 80 % of the steps on either
        # side) is its calibration; the test's fields are reported alongside
        test = rise_test(rise.excess, rise.noise, rise.step, rise.steps - rise.step)
        out.append(SlowSuspect(rise.rank, round(float(sure), 2), how, rise.excess, test))
    return out


def _stages(table: TraceTable, layout: Layout | None) -> np.ndarray | None:
    """Pipeline stage of every rank: by the layout where it has several, else, where traces hold no
    pipeline transfers (torch's Flight Recorder on gloo records none), the ranks joined by the
    communicators smaller than the world (TP and DP groups stay inside a stage) when they split it into
    equal blocks of several ranks. None: one stage, or nothing to tell them by."""
    world = table.world_size
    if layout is not None and layout.sizes.get("pp", 1) >= 2:
        return np.array([layout.coords(r)["pp"] for r in range(world)])
    block = list(range(world))

    def root(r: int) -> int:
        while block[r] != r:
            block[r] = block[block[r]]
            r = block[r]
        return r

    for comm in table.comms:
        if comm.p2p or not 2 <= len(comm.members) < world or max(comm.members) >= world:
            continue
        first = root(comm.members[0])
        for m in comm.members[1:]:
            block[root(m)] = first
    roots = np.array([root(r) for r in range(world)])
    sizes = Counter(roots.tolist())
    if len(sizes) < 2 or len(set(sizes.values())) != 1 or min(sizes.values()) < 2:
        return None
    return roots


def _same_stage(members: np.ndarray, stages: np.ndarray | None, channel: bool) -> list[np.ndarray]:
    """The rows of a communicator whose arrivals can be compared: where its members sit in different
    pipeline stages (the world, or first and last stage sharing embeddings), the schedule decides who
    arrives last (in 1F1B the first stage ends its step last), so only members of one stage are
    compared with each other, and a stage of one member is not judged there. Pipeline channels were
    judged against their class already."""
    if channel or stages is None:
        return [np.arange(len(members))]
    of = stages[members]
    groups = [np.flatnonzero(of == s) for s in np.unique(of).tolist()]
    return [rows for rows in groups if len(rows) >= 2]


def _time_windows(comms: list[_Comm]) -> list[tuple[str, dict[int, np.ndarray], dict[int, int]]]:
    """Which instances each pass looks at, per communicator (index into `comms`): the newest
    `WHOLE_INSTANCES` of every communicator, then, when communicators have enough instances for each
    window to be judged alone, equal time windows over the whole trace. A window keeps at most
    `WINDOW_SAMPLE` instances of a communicator, every k-th (k is returned per communicator, so the call
    interval is still known): the cost stays bounded however long the trace. Instances are placed in
    time by their first member's arrival, and chosen before any matrix is built."""
    seen = [np.flatnonzero(~np.isnan(cm.times))[-MAX_INSTANCES:] for cm in comms]
    # a margin over `WHOLE_INSTANCES`: the newest instances may not have been reached by every member yet
    newest = {i: s[-WHOLE_INSTANCES - 64 :] + comms[i].low for i, s in enumerate(seen)}
    plan: list[tuple[str, dict[int, np.ndarray], dict[int, int]]] = [("", newest, {})]
    busiest = max((len(s) for s in seen), default=0)
    count = min(MAX_WINDOWS, busiest // WINDOW_INSTANCES)
    if count < 2:
        return plan
    times = [cm.times[s] for cm, s in zip(comms, seen, strict=True)]  # one rank's arrivals: ascending
    t_lo = min(float(t[0]) for t in times if len(t))
    t_hi = max(float(t[-1]) for t in times if len(t))
    edges = np.linspace(t_lo, t_hi, count + 1)
    for lo, hi in itertools.pairwise(edges.tolist()):
        part, strides = {}, {}
        for i, (s, t) in enumerate(zip(seen, times, strict=True)):
            first, last = np.searchsorted(t, [lo, hi], side="left")
            if last - first < max(MIN_INSTANCES, WINDOW_INSTANCES // 4):
                continue
            stride = max(1, int(last - first) // WINDOW_SAMPLE)
            part[i] = s[int(first) : int(last) : stride] + comms[i].low
            strides[comms[i].comm] = stride
        if part:
            label = f"from {(lo - t_lo) / 1e9:.0f} s to {(hi - t_lo) / 1e9:.0f} s of the trace"
            plan.append((label, part, strides))
    return plan


def _stragglers(
    mats: list, hosts: list[str], strides: dict[int, int], channels: frozenset[int], tests: int
) -> list[SlowSuspect]:
    """Stragglers among `mats`, pass after pass: a straggler drags the median of every instance it is in;
    once found it is left out of the medians and the next pass looks again, so a milder straggler sharing
    a communicator with a severe one (both late in the same DP group, say) is not hidden behind it."""
    stragglers: list[int] = []
    suspects = []
    per_comm = comm_lateness(mats, strides=strides)
    first: _Round | None = None
    for _pass in range(MAX_PASSES):
        if stragglers:  # only communicators holding a straggler have new medians
            masked = frozenset(stragglers)
            touched = [i for i, (_c, members, _e, _d) in enumerate(mats) if masked & set(members.tolist())]
            redone = comm_lateness([mats[i] for i in touched], masked, strides)
            for i, cl in zip(touched, redone, strict=True):
                per_comm[i] = cl
        rnd = _lateness_round(per_comm, hosts, channels)
        first = first or rnd
        # a rank that waited for someone before any straggler was left out stays a victim
        found = [
            m for m in rnd.late if m not in stragglers and _trails_everywhere(m, rnd) and not _waits(m, first)
        ]
        if not found:
            break
        stragglers.extend(found)
        suspects.extend(_straggler(m, rnd, tests) for m in found)
    return suspects
