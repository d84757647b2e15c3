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
from typing import Any

from megatrace.tracer.format import C_MAX_DURATION_NS, H_SUM_NS, HISTOGRAM_BUCKETS, histogram_bucket
from megatrace.tracer.ringfile import (
    C_COMPLETED,
    C_INFLIGHT_ENQUEUE_NS,
    C_INFLIGHT_OP,
    C_INFLIGHT_SEQ,
    C_ISSUED,
    MAX_OPS,
    P2P_OPS,
    R_COMM_ID,
    R_COMPLETE_NS,
    R_OP_BYTE,
    R_SEQ,
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
# The histogram bucket of a duration by its bit length (`format.histogram_bucket` as a table lookup),
# and where a communicator's list in `Recorder.durations` keeps the sum and the maximum.
_BUCKET_OF_BITS = tuple(histogram_bucket(1 << bits >> 1) for bits in range(65))
_SUM, _MAX = HISTOGRAM_BUCKETS, HISTOGRAM_BUCKETS + 1
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
        self.comm_entries: dict[int, int] = {}
        # communicator id -> its completed ops' duration histogram buckets, then their sum and maximum (ns)
        self.durations: dict[int, list[int]] = {}

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
        took = now - started
        if words[word] == serial:  # not yet overwritten by the ring
            words[word + R_COMPLETE_NS] = now
            cid = words[word + R_COMM_ID]
            durations = self.durations.get(cid)
            if durations is None:
                durations = self.durations[cid] = [0] * (HISTOGRAM_BUCKETS + 2)
            durations[_BUCKET_OF_BITS[took.bit_length()]] += 1
            durations[_SUM] += took
            if took > durations[_MAX]:
                durations[_MAX] = took
        self.last_complete_ns = now
        self.wait_ns_total += took

    def record_span(self, op: int, peer: int, seq: int, start_ns: int, end_ns: int, nbytes: int = 0) -> None:
        """Write a completed span that is no op (a pause: `format.OP_PAUSE`, a garbage collection:
        `format.OP_GC`) as a record of its own."""
        serial = self.serial + 1
        self.serial = serial
        offset = (serial - 1) % self.capacity * RECORD_SIZE
        _pack(self.records, offset, 0, 0, seq, nbytes, start_ns, end_ns, self.step, self.rank, peer, op, 0, 0)
        self.record_words[offset >> 3] = serial
        self.calls_by_op[op] += 1

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
        self.publish_comm_counters()

    def publish_comm_counters(self) -> None:
        """Per-communicator ops issued and completed, the oldest op in flight of each, and the histogram
        of their completed ops' durations into the header (computed here from the sequence counters and
        the in-flight ops, off the record path)."""
        issued = dict(self.seq)
        for (cid, _peer, _op), count in list(self.p2p_seq.items()):
            issued[cid] = issued.get(cid, 0) + count
        inflight: dict[int, list[int]] = {}
        for serial, enqueue_ns in list(self.inflight.items()):
            word = (serial - 1) % self.capacity * RECORD_WORDS
            if self.record_words[word] != serial:
                continue
            cid = self.record_words[word + R_COMM_ID]
            if cid in inflight:
                inflight[cid][0] += 1
            else:
                op = self.records[word * 8 + R_OP_BYTE]
                inflight[cid] = [1, op, self.record_words[word + R_SEQ], enqueue_ns]
        header = self.header
        for cid, count in issued.items():
            base = self.comm_entries.get(cid)
            if base is None:
                base = self.comm_entries[cid] = self.writer.comm_counters_entry(cid)
            if base < 0:
                continue
            pending, op, seq, enqueue_ns = inflight.get(cid, (0, 0, -1, 0))
            header[base + C_ISSUED] = count
            header[base + C_COMPLETED] = count - pending
            header[base + C_INFLIGHT_OP] = op
            header[base + C_INFLIGHT_SEQ] = seq
            header[base + C_INFLIGHT_ENQUEUE_NS] = enqueue_ns
            durations = self.durations.get(cid)
            if durations is not None:
                *buckets, total, longest = list(durations)
                histogram = self.writer.histogram_entry(base)
                for bucket, count_in in enumerate(buckets):
                    header[histogram + bucket] = count_in
                header[histogram + H_SUM_NS] = total
                header[base + C_MAX_DURATION_NS] = longest

    def mark_step(self) -> None:
        """One training step ended now: count it and record its duration."""
        self.step = mark_step_in(self.header, self.step_start_ns)
        self.step_start_ns = self.header[W_LAST_STEP_END_NS]


def mark_step_in(header: memoryview, step_start_ns: int) -> int:
    """Count a step that ended now in `header` (started at `step_start_ns`); returns the step count."""
    now = _clock()
    header[W_LAST_STEP_NS] = now - step_start_ns
    header[W_LAST_STEP_END_NS] = now
    step = header[W_STEP_COUNT] + 1
    header[W_STEP_COUNT] = step
    return step


class NativeRecorder:
    """The recorder's face to the rest of the tracer when the native capture writes the ring: records
    and live counters are written by the C++ side, so `publish` has nothing to copy; steps are counted
    in the header, where the C++ side reads the step number of each record."""

    def __init__(self, writer: RingWriter, rank: int, native: Any) -> None:
        self.writer = writer
        self.rank = rank
        self.header = writer.header
        self.native = native
        self.step_start_ns = _clock()

    @property
    def serial(self) -> int:
        """Ops recorded so far."""
        return self.native.serial()

    calls = serial

    @property
    def step(self) -> int:
        return self.header[W_STEP_COUNT]

    def publish(self) -> None:
        """Nothing to copy: the native side keeps the header's counters live."""

    def record_span(self, op: int, peer: int, seq: int, start_ns: int, end_ns: int, nbytes: int = 0) -> None:
        """Write a completed span that is no op (a pause, a garbage collection) as a record, numbered
        by the native side."""
        self.native.record_span(op, peer, seq, start_ns, end_ns, self.header[W_STEP_COUNT], nbytes)

    def mark_step(self) -> None:
        """One training step ended now: count it and record its duration."""
        mark_step_in(self.header, self.step_start_ns)
        self.step_start_ns = self.header[W_LAST_STEP_END_NS]
