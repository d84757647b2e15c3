"""The record path: turns "this rank issued op X on communicator C" into ring records and counters.

Keeps the per-communicator sequence numbers, the set of ops in flight (for the oldest-in-flight
counters) and the step counter. Imports no torch, so the record path can be measured alone.
"""

from __future__ import annotations

import time

from megatrace.tracer.ringfile import (
    P2P_OPS,
    W_LAST_COMPLETE_NS,
    W_LAST_STEP_END_NS,
    W_LAST_STEP_NS,
    W_OLDEST_INFLIGHT_ENQUEUE_NS,
    W_OLDEST_INFLIGHT_OP,
    W_STEP_COUNT,
    W_WAIT_NS_TOTAL,
    RingWriter,
)

_clock = time.time_ns


class Recorder:
    """Per-rank recording state on top of a `RingWriter`.

    Collectives number per communicator; point-to-point ops number per (communicator, peer,
    direction), so a rank's n-th send to P matches P's n-th receive from it. No locks: `end` may run
    on a completion thread and the in-flight dict operations are atomic under the GIL. The header's
    oldest-in-flight words are kept off the hot path: the watchdog rewrites them on every tick.
    """

    def __init__(self, writer: RingWriter, rank: int) -> None:
        self.writer = writer
        self.rank = rank
        self.header = writer.header
        self.seq: dict[int, int] = {}
        self.p2p_seq: dict[tuple[int, int, int], int] = {}
        self.inflight: dict[int, tuple[int, int]] = {}
        self.step = 0
        self.step_start_ns = _clock()

    def begin(self, cid: int, op: int, nbytes: int, dtype: int, peer: int, flags: int) -> int:
        """Record an op as issued now; returns the serial to pass to `end` when it completes."""
        if op in P2P_OPS:
            key = (cid, peer, op)
            seq = self.p2p_seq.get(key, 0)
            self.p2p_seq[key] = seq + 1
        else:
            seq = self.seq.get(cid, 0)
            self.seq[cid] = seq + 1
        now = _clock()
        serial = self.writer.append(cid, seq, op, nbytes, dtype, peer, now, self.step, flags, self.rank)
        self.inflight[serial] = (now, op)
        return serial

    def end(self, serial: int) -> None:
        """Mark op `serial` completed now (from the issuing thread or a completion callback)."""
        now = _clock()
        started = self.inflight.pop(serial, None)
        if started is None:
            return
        self.writer.complete(serial, now)
        header = self.header
        header[W_LAST_COMPLETE_NS] = now
        header[W_WAIT_NS_TOTAL] += now - started[0]

    @property
    def calls(self) -> int:
        """Ops recorded so far."""
        return self.writer.serial

    def refresh_oldest(self) -> None:
        """Write the oldest in-flight op into the header (the watchdog does, on every tick)."""
        header = self.header
        try:
            enqueue_ns, op = next(iter(self.inflight.values()))
        except (StopIteration, RuntimeError):
            enqueue_ns = op = 0
        header[W_OLDEST_INFLIGHT_ENQUEUE_NS] = enqueue_ns
        header[W_OLDEST_INFLIGHT_OP] = op

    def mark_step(self) -> None:
        """One training step ended now: count it and record its duration."""
        now = _clock()
        header = self.header
        header[W_LAST_STEP_NS] = now - self.step_start_ns
        header[W_LAST_STEP_END_NS] = now
        self.step += 1
        header[W_STEP_COUNT] = self.step
        self.step_start_ns = now
