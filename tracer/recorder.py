"""The record path: turns "this rank issued op X on communicator C" into ring records and counters.

Keeps the per-communicator sequence numbers, the set of ops in flight and the live counters, and
writes the records into the `RingWriter`'s mapped file itself: `begin` and `end` are the whole
per-op cost, so each is one Python call with no further calls but the clock and one
`struct.pack_into`. The counters are plain Python ints on that path; `publish` (the watchdog's
tick, every dump, and close) copies them into the file's header, so readers in other processes see
them at most one tick late. Imports no torch, so the record path can be measured alone.
"""

from __future__ import annotations

import time

from megatrace.tracer.ringfile import (
    MAX_OPS,
    P2P_OPS,
    R_COMPLETE_NS,
    R_OP_BYTE,
    RECORD_SIZE,
    RECORD_STRUCT,
    RECORD_WORDS,
    W_BYTES_BY_OP,
    W_CALLS_BY_OP,
    W_LAST_COMPLETE_NS,
    W_LAST_ENQUEUE_NS,
    W_LAST_STEP_END_NS,
    W_LAST_STEP_NS,
    W_OLDEST_INFLIGHT_ENQUEUE_NS,
    W_OLDEST_INFLIGHT_OP,
    W_STEP_COUNT,
    W_WAIT_NS_TOTAL,
    RingWriter,
)

_clock = time.time_ns
_pack = RECORD_STRUCT.pack_into


class Recorder:
    """Per-rank recording state on top of a `RingWriter`.

    Collectives number per communicator; point-to-point ops number per (communicator, peer,
    direction), so a rank's n-th send to P matches P's n-th receive from it. A record is packed with
    serial 0 and committed by writing its serial last, so readers skip slots caught mid-write. No
    locks: `begin` runs on the issuing thread, `end` may run on a completion thread, and the in-flight
    dict operations are atomic under the GIL.
    """

    def __init__(self, writer: RingWriter, rank: int) -> None:
        self.writer = writer
        self.rank = rank
        self.header = writer.header
        self.capacity = writer.capacity
        self.records = writer.rec_b
        self.record_words = writer.rec_q
        self.serial = 0
        self.seq: dict[int, int] = {}
        self.p2p_seq: dict[tuple[int, int, int], int] = {}
        self.inflight: dict[int, int] = {}  # serial -> enqueue time, oldest first
        self.step = 0
        self.step_start_ns = _clock()
        self.calls_by_op = [0] * MAX_OPS
        self.bytes_by_op = [0] * MAX_OPS
        self.last_enqueue_ns = 0
        self.last_complete_ns = 0
        self.wait_ns_total = 0

    def begin(self, cid: int, op: int, nbytes: int, dtype: int, peer: int, flags: int) -> int:
        """Record an op as issued now; returns its serial (1-based record number) to pass to `end`."""
        if op in P2P_OPS:
            key = (cid, peer, op)
            seq = self.p2p_seq.get(key, 0)
            self.p2p_seq[key] = seq + 1
        else:
            seqs = self.seq
            seq = seqs.get(cid, 0)
            seqs[cid] = seq + 1
        serial = self.serial + 1
        self.serial = serial
        now = _clock()
        offset = (serial - 1) % self.capacity * RECORD_SIZE
        _pack(self.records, offset, 0, cid, seq, nbytes, now, 0, self.step, self.rank, peer, op, dtype, flags)
        self.record_words[offset >> 3] = serial
        self.calls_by_op[op] += 1
        self.bytes_by_op[op] += nbytes
        self.last_enqueue_ns = now
        self.inflight[serial] = now
        return serial

    def end(self, serial: int) -> None:
        """Mark op `serial` completed now (from the issuing thread or a completion callback)."""
        now = _clock()
        started = self.inflight.pop(serial, None)
        if started is None:
            return
        word = (serial - 1) % self.capacity * RECORD_WORDS
        words = self.record_words
        if words[word] == serial:  # not yet overwritten by the ring
            words[word + R_COMPLETE_NS] = now
        self.last_complete_ns = now
        self.wait_ns_total += now - started

    @property
    def calls(self) -> int:
        """Ops recorded so far."""
        return self.serial

    def publish(self) -> None:
        """Copy the live counters and the oldest in-flight op into the header (the watchdog does, on
        every tick and before every dump)."""
        header = self.header
        try:
            serial, enqueue_ns = next(iter(self.inflight.items()))
        except (StopIteration, RuntimeError):
            serial = enqueue_ns = 0
        op = 0
        if serial:
            slot = (serial - 1) % self.capacity
            if self.record_words[slot * RECORD_WORDS] == serial:
                op = self.records[slot * RECORD_SIZE + R_OP_BYTE]
        header[W_OLDEST_INFLIGHT_ENQUEUE_NS] = enqueue_ns
        header[W_OLDEST_INFLIGHT_OP] = op
        for index, (calls, nbytes) in enumerate(zip(self.calls_by_op, self.bytes_by_op, strict=True)):
            if calls:
                header[W_CALLS_BY_OP + index] = calls
                header[W_BYTES_BY_OP + index] = nbytes
        header[W_LAST_ENQUEUE_NS] = self.last_enqueue_ns
        header[W_LAST_COMPLETE_NS] = self.last_complete_ns
        header[W_WAIT_NS_TOTAL] = self.wait_ns_total

    def mark_step(self) -> None:
        """One training step ended now: count it and record its duration."""
        now = _clock()
        header = self.header
        header[W_LAST_STEP_NS] = now - self.step_start_ns
        header[W_LAST_STEP_END_NS] = now
        self.step += 1
        header[W_STEP_COUNT] = self.step
        self.step_start_ns = now
