"""The tracer's per-rank ring file: the writer used inside a rank, and `read_ring`.

One memory-mapped file per rank, ``<trace_dir>/<job>/rank-<N>.trace``: a 28 KiB header (identity and
live counters), a communicator table, then a ring of fixed-size records. The layout is defined in
`megatrace.tracer.format` and described in ``docs/tracer-format.md``. This module imports no torch:
the exporter and the analyzer read files with it while ranks write them.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import mmap
import os
import struct
import time
import weakref
from pathlib import Path

import numpy as np

from megatrace.regular_files import open_regular
from megatrace.tracer.format import (
    C_COMPLETED,
    C_ID,
    C_INFLIGHT_ENQUEUE_NS,
    C_INFLIGHT_OP,
    C_INFLIGHT_SEQ,
    C_ISSUED,
    C_LAST_OP,
    C_MAX_DURATION_NS,
    CAPTURE_NAMES,
    COMM_COUNTER_WORDS,
    COMM_COUNTERS_OFFSET,
    DEVICE_UUID_BYTES,
    DEVICE_UUID_OFFSET,
    FORMAT_VERSION,
    H_SUM_NS,
    HEADER_PAGE,
    HEADER_SIZE,
    HEADER_SIZE_V3,
    HISTOGRAM_BUCKETS,
    HISTOGRAM_OFFSET,
    HISTOGRAM_WORDS,
    HOST_NOTES_BYTES,
    HOST_NOTES_OFFSET,
    HOST_OFFSET,
    HOST_SAMPLE_CHECK,
    HOST_SAMPLE_FIELDS,
    HOST_SAMPLE_SERIAL,
    HOST_SAMPLE_WORDS,
    HOST_SAMPLES,
    HOST_SAMPLES_OFFSET,
    HOST_SIGNALS_OFFSET,
    HS_CGROUP_VERSION,
    HS_GC_COLLECTIONS,
    HS_GC_NS,
    HS_MAIN_THREAD_ID,
    HS_SAMPLE_COUNT,
    JOB_OFFSET,
    MAGIC,
    MAX_COMM_COUNTERS,
    MAX_OPS,
    OP_NAMES,
    OP_PAUSE,
    P_ENDED,
    P_SINCE_NS,
    P_TOTAL_NS,
    PAUSE_KIND_NAMES,
    PAUSE_WORDS,
    PAUSES_OFFSET,
    READABLE_VERSIONS,
    RECORD_DTYPE,
    RECORD_FIELDS,
    RECORD_SIZE,
    SPAN_NAMES,
    TEXT_FIELD_BYTES,
    W_BYTES_BY_OP,
    W_CALLS_BY_OP,
    W_CAPACITY,
    W_CAPTURE,
    W_COMM_COUNT,
    W_COMM_COUNTERS_USED,
    W_COMM_TABLE_OFFSET,
    W_COMM_TABLE_SIZE,
    W_COMM_TABLE_USED,
    W_CUDA_DEVICE,
    W_DUMPS_WRITTEN,
    W_FINISHED,
    W_HEADER_SIZE,
    W_LAST_COMPLETE_NS,
    W_LAST_ENQUEUE_NS,
    W_LAST_STEP_END_NS,
    W_LAST_STEP_NS,
    W_LOCAL_RANK,
    W_OLDEST_INFLIGHT_ENQUEUE_NS,
    W_OLDEST_INFLIGHT_OP,
    W_PAUSE_KIND,
    W_PID,
    W_RANK,
    W_RECORD_SIZE,
    W_RECORDS_OFFSET,
    W_STALL_THRESHOLD_NS,
    W_START_TIME_NS,
    W_STEP_COUNT,
    W_VERSION,
    W_WAIT_NS_TOTAL,
    W_WORLD_SIZE,
    W_WRITER_FLAGS,
    WRITER_HOLDS_LOCK,
    fields_end,
)

# The code tables, for the ring's writers and readers (defined in `megatrace.tracer.format`).
from megatrace.tracer.format import DTYPE_CODES as DTYPE_CODES
from megatrace.tracer.format import DTYPE_NAMES as DTYPE_NAMES
from megatrace.tracer.format import FLAG_ASYNC as FLAG_ASYNC
from megatrace.tracer.format import FLAG_PROCESS_GROUP as FLAG_PROCESS_GROUP
from megatrace.tracer.format import OP_CODES as OP_CODES
from megatrace.tracer.format import P2P_OPS as P2P_OPS
from megatrace.tracer.stacks import ThreadStack

DEFAULT_CAPACITY = 131072
DEFAULT_COMM_TABLE_BYTES = 1 << 20
CAPTURE_CODES = {name: code for code, name in CAPTURE_NAMES.items() if name}
RECORD_WORDS = RECORD_SIZE // 8
# The record layout for the record path: one pack_into per record (the serial packed as 0, committed
# after). Signed words: the same bytes as the unsigned fields for every value they hold (ids are
# 63-bit), and `struct` converts signed 64-bit ints several times faster than unsigned ones.
_STRUCT_CODES = {"<u8": "q", "<i8": "q", "<i4": "i", "u1": "B"}
RECORD_STRUCT = struct.Struct(
    "<" + "".join(_STRUCT_CODES[fmt] for _, fmt, _ in RECORD_FIELDS) + f"{RECORD_SIZE - fields_end()}x"
)
# Word/int32/byte positions of fields inside one record, for the writer's memoryviews.
_OFFSET = {name: offset for name, _, offset in RECORD_FIELDS}
R_COMM_ID, R_SEQ, R_COMPLETE_NS = (_OFFSET[name] // 8 for name in ("comm_id", "seq", "complete_ns"))
R_PEER_I32 = _OFFSET["peer"] // 4
R_OP_BYTE = _OFFSET["op"]


class RingFormatError(ValueError):
    """A file that is not a readable Megatrace ring file; the message says which and why."""


@dataclasses.dataclass
class RingHeader:
    """Identity of the rank and its live counters, as found in the header at read time."""

    version: int
    job: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    start_time_ns: int
    calls_by_op: dict[str, int]
    bytes_by_op: dict[str, int]
    wait_ns_total: int
    last_enqueue_ns: int
    last_complete_ns: int
    oldest_inflight_enqueue_ns: int
    oldest_inflight_op: str
    step_count: int
    last_step_ns: int
    last_step_end_ns: int
    finished: bool
    capacity: int = 0
    records_written: int = 0
    # Of those, pause records (version 3; counted in the calls word of op code OP_PAUSE).
    pause_records: int = 0
    dumps_written: int = 0
    # The writer's stall sensitivity (MEGATRACE_TRACE_STALL_MS); 0 = unknown (older writers, dumps).
    stall_threshold_ns: int = 0
    # Whether the writer keeps a liveness lock on the file (see `writer_holds_lock`); False for older ones.
    writer_locks: bool = False
    # Version 2: "native" or "python" capture ("" unknown), CUDA device index (-1 none) and UUID.
    capture: str = ""
    cuda_device: int = -1
    device_uuid: str = ""
    comm_counters: dict[int, CommCounters] = dataclasses.field(default_factory=dict)
    # Version 3: the pause begun last among those in progress ("" none) and each kind's state.
    pause_kind: str = ""
    pauses: dict[str, PauseState] = dataclasses.field(default_factory=dict)
    # Version 4: the rank's host signals, oldest sample first (empty before version 4 or before the
    # first sample), its cgroup version (0 unknown, 1, 2), why signals are unavailable, its main
    # thread's id (as faulthandler prints it; 0 unknown) and its garbage collections (count, pause ns).
    host_samples: tuple[HostSample, ...] = ()
    cgroup_version: int = 0
    host_notes: tuple[str, ...] = ()
    main_thread_id: int = 0
    gc_collections: int = 0
    gc_ns: int = 0


@dataclasses.dataclass(frozen=True)
class HostSample:
    """One sample of the rank's own process and cgroup; counters are cumulative since the process
    (or the cgroup) started, -1 where unavailable (the header's `host_notes` say why)."""

    time_ns: int  # CLOCK_REALTIME ns of the sample
    cpu_ns: int  # /proc/self/schedstat field 1: time on CPU (all threads)
    runq_ns: int  # /proc/self/schedstat field 2: time runnable, waiting for a CPU
    voluntary_switches: int  # voluntary_ctxt_switches of the main thread (/proc/self/task/<tid>/status)
    nonvoluntary_switches: int  # nonvoluntary_ctxt_switches of the main thread
    major_faults: int  # /proc/self/stat majflt
    read_bytes: int  # /proc/self/io read_bytes (bytes fetched from storage)
    blkio_delay_ns: int  # /proc/self/stat delayacct_blkio_ticks in ns; -1 when delay accounting is off
    main_io_wait_samples: int  # how many samples so far found the main thread in state D
    cfs_periods: int  # cgroup cpu.stat nr_periods (v1 and v2)
    cfs_throttled_periods: int  # nr_throttled
    cfs_throttled_ns: int  # v1 throttled_time (ns); v2 throttled_usec * 1000
    memory_limit_hits: int  # v1 memory.failcnt; v2 memory.events "max"
    memory_high_events: int  # v2 memory.events "high"; -1 on v1
    oom_kills: int  # v1 memory.oom_control oom_kill; v2 memory.events oom_kill
    cpu_pressure_ns: int  # the cgroup's cpu.pressure "some" total (us * 1000); -1 without
    memory_pressure_ns: int  # memory.pressure "some" total
    io_pressure_ns: int  # io.pressure "some" total
    gc_collections: int  # cumulative, every generation
    gc_ns: int  # cumulative GC pause time
    dataloader_ns: int  # cumulative DataLoader wait (ended pauses + the one in progress)


@dataclasses.dataclass(frozen=True)
class CommCounters:
    """One communicator's live counters on this rank: ops issued and completed, and the oldest op in
    flight (op name, its sequence number, when it was issued; "", -1, 0 when none). Version 3 adds the
    longest completed op (ns), the histogram of completed op durations (`format.histogram_bucket`;
    empty for older files) and their sum (ns)."""

    issued: int
    completed: int
    inflight_op: str = ""
    inflight_seq: int = -1
    inflight_enqueue_ns: int = 0
    last_op: str = ""
    max_duration_ns: int = 0
    histogram: tuple[int, ...] = ()
    duration_sum_ns: int = 0


@dataclasses.dataclass(frozen=True)
class PauseState:
    """One pause kind on this rank: since when it is in one (0: not now), how many ended and their time."""

    since_ns: int = 0
    ended: int = 0
    total_ns: int = 0


@dataclasses.dataclass
class RingSnapshot:
    """One rank's trace: header, records (oldest first, dtype RECORD_DTYPE) and communicator members."""

    header: RingHeader
    records: np.ndarray
    communicators: dict[int, tuple[int, ...]]
    # When the snapshot was taken (read or dumped), CLOCK_REALTIME ns; why, for dumps.
    taken_ns: int = 0
    reason: str = ""
    # Every thread's Python stack when a stall or signal dump was taken (empty for a ring read live).
    stacks: tuple[ThreadStack, ...] = ()


@dataclasses.dataclass(frozen=True)
class RankIdentity:
    """Who writes a ring file."""

    job: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    start_time_ns: int


def comm_id(ranks: tuple[int, ...] | list[int]) -> int:
    """Communicator id: a stable 63-bit hash of the sorted member global ranks (same on every member)."""
    members = np.asarray(sorted(ranks), dtype="<i4").tobytes()
    digest = hashlib.blake2b(members, digest_size=8, person=b"megatrace-comm").digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def ring_path(job_dir: Path, rank: int) -> Path:
    """Where rank `rank`'s ring file lives inside a job's trace folder."""
    return Path(job_dir) / f"rank-{rank}.trace"


def _text_field(value: str) -> bytes:
    raw = value.encode("utf-8")[: TEXT_FIELD_BYTES - 1]
    return raw + b"\x00" * (TEXT_FIELD_BYTES - len(raw))


def _round_up(value: int, unit: int) -> int:
    return (value + unit - 1) // unit * unit


class RingWriter:
    """Creates a rank's ring file, maps it and gives the views that records and counters are written through.

    All state lives in the mapped file; the record path (`megatrace.tracer.recorder.Recorder`) writes a
    record with one `pack_into` and a few 8-byte stores, no allocation. Only the rank's own threads
    write; readers in other processes use `read_ring`.
    From creation to `close` (or process death) the writer holds a shared `flock` on the file through
    a descriptor of its own, which forked children drop: a held lock means a live writer, whatever
    PID namespace the reader is in.
    """

    def __init__(
        self,
        path: Path,
        identity: RankIdentity,
        capacity: int = DEFAULT_CAPACITY,
        comm_table_bytes: int = DEFAULT_COMM_TABLE_BYTES,
        stall_threshold_ns: int = 0,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"ring capacity must be at least 1, got {capacity}")
        self.path = Path(path)
        self.capacity = capacity
        self.comm_table_offset = HEADER_SIZE
        self.comm_table_size = _round_up(max(comm_table_bytes, 4096), mmap.PAGESIZE)
        self.records_offset = self.comm_table_offset + self.comm_table_size
        size = self.records_offset + capacity * RECORD_SIZE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # Reserve every block now: a sparse file on a full filesystem (often a tmpfs) would kill
            # the rank with SIGBUS at the first store into an unbacked page; this raises ENOSPC instead.
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        except OSError:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        self.header = memoryview(self._map)[:HEADER_SIZE].cast("q")
        self.table = memoryview(self._map)[self.comm_table_offset : self.records_offset]
        records = memoryview(self._map)[self.records_offset :]
        self.rec_q = records.cast("q")
        self.rec_i = records.cast("i")
        self.rec_b = records
        self._write_identity(identity)
        self.header[W_STALL_THRESHOLD_NS] = stall_threshold_ns
        self.header[W_CUDA_DEVICE] = -1
        self._lock_fd = os.open(tmp, os.O_RDONLY)
        fcntl.flock(self._lock_fd, fcntl.LOCK_SH)
        self.header[W_WRITER_FLAGS] = WRITER_HOLDS_LOCK
        os.register_at_fork(after_in_child=functools.partial(_release_in_child, weakref.ref(self)))
        os.replace(tmp, self.path)

    def release_lock(self) -> None:
        """Stop holding the liveness lock (readers then see the writer as gone)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _write_identity(self, identity: RankIdentity) -> None:
        h = self.header
        h[W_VERSION] = FORMAT_VERSION
        h[W_HEADER_SIZE] = HEADER_SIZE
        h[W_RECORD_SIZE] = RECORD_SIZE
        h[W_CAPACITY] = self.capacity
        h[W_COMM_TABLE_OFFSET] = self.comm_table_offset
        h[W_COMM_TABLE_SIZE] = self.comm_table_size
        h[W_RECORDS_OFFSET] = self.records_offset
        h[W_RANK] = identity.rank
        h[W_LOCAL_RANK] = identity.local_rank
        h[W_WORLD_SIZE] = identity.world_size
        h[W_PID] = identity.pid
        h[W_START_TIME_NS] = identity.start_time_ns
        self._map[JOB_OFFSET : JOB_OFFSET + TEXT_FIELD_BYTES] = _text_field(identity.job)
        self._map[HOST_OFFSET : HOST_OFFSET + TEXT_FIELD_BYTES] = _text_field(identity.host)
        self._map[0:8] = MAGIC

    def add_communicator(self, cid: int, ranks: tuple[int, ...]) -> bool:
        """Append a communicator's member list to the table; False when the table is full."""
        used = self.header[W_COMM_TABLE_USED]
        entry = np.empty(2 + _round_up(len(ranks), 2) // 2, dtype="<i8")
        entry[0] = cid
        entry[1] = len(ranks)
        members = entry[2:].view("<i4")
        members[:] = 0
        members[: len(ranks)] = ranks
        raw = entry.tobytes()
        if used + len(raw) > self.comm_table_size:
            return False
        self.table[used : used + len(raw)] = raw
        self.header[W_COMM_COUNT] += 1
        self.header[W_COMM_TABLE_USED] = used + len(raw)
        return True

    def set_capture(self, capture: str) -> None:
        """Say in the header how this rank's ops are captured ("native" or "python")."""
        self.header[W_CAPTURE] = CAPTURE_CODES[capture]

    def set_device(self, index: int, uuid: str) -> None:
        """The rank's CUDA device index (-1: none) and UUID ("" when unknown)."""
        self.header[W_CUDA_DEVICE] = index
        raw = uuid.encode("utf-8")[: DEVICE_UUID_BYTES - 1]
        self._map[DEVICE_UUID_OFFSET : DEVICE_UUID_OFFSET + DEVICE_UUID_BYTES] = raw.ljust(
            DEVICE_UUID_BYTES, b"\0"
        )

    def set_host_notes(self, notes: tuple[str, ...] | list[str]) -> None:
        """Why host signals are unavailable, one line each (cut to the field's size at a line's end)."""
        raw = b""
        for note in notes:
            line = note.replace("\n", " ").encode("utf-8") + b"\n"
            if len(raw) + len(line) >= HOST_NOTES_BYTES:
                break
            raw += line
        self._map[HOST_NOTES_OFFSET : HOST_NOTES_OFFSET + HOST_NOTES_BYTES] = raw.ljust(
            HOST_NOTES_BYTES, b"\0"
        )

    def comm_counters_entry(self, cid: int) -> int:
        """Word index (in `header`) of communicator `cid`'s counter entry, added if new; -1 when full."""
        used = self.header[W_COMM_COUNTERS_USED]
        for slot in range(used):
            base = COMM_COUNTERS_OFFSET // 8 + slot * COMM_COUNTER_WORDS
            if self.header[base + C_ID] == cid:
                return base
        if used >= MAX_COMM_COUNTERS:
            return -1
        base = COMM_COUNTERS_OFFSET // 8 + used * COMM_COUNTER_WORDS
        self.header[base + C_ID] = cid
        self.header[base + C_INFLIGHT_SEQ] = -1
        self.header[W_COMM_COUNTERS_USED] = used + 1
        return base

    def histogram_entry(self, counter_base: int) -> int:
        """Word index (in `header`) of the duration histogram of the communicator whose counter entry
        is at word `counter_base` (-1 for -1: no entry)."""
        if counter_base < 0:
            return -1
        slot = (counter_base - COMM_COUNTERS_OFFSET // 8) // COMM_COUNTER_WORDS
        return HISTOGRAM_OFFSET // 8 + slot * HISTOGRAM_WORDS

    def set_peer(self, serial: int, peer: int) -> None:
        """Fill in the peer of record `serial` once known (a receive from any source)."""
        slot = (serial - 1) % self.capacity
        if self.rec_q[slot * RECORD_WORDS] == serial:
            self.rec_i[slot * (RECORD_SIZE // 4) + R_PEER_I32] = peer

    def close(self) -> None:
        """Flush and unmap the file and release the liveness lock (the writer is unusable afterwards)."""
        self.release_lock()
        self._map.flush()
        for view in (self.header, self.table, self.rec_q, self.rec_i, self.rec_b):
            view.release()
        self._map.close()


def _release_in_child(ref: weakref.ref[RingWriter]) -> None:
    """After a fork: the child (e.g. a data loader worker) must not keep its parent's rank alive."""
    writer = ref()
    if writer is not None:
        writer.release_lock()


def writer_holds_lock(path: str | Path) -> bool | None:
    """Whether a live writer holds its lock on the ring file; None when the lock cannot be tested.

    Tries a non-blocking exclusive `flock` on a descriptor of its own and lets go at once, so it never
    waits and never disturbs the writer. Meaningful for files whose header has `writer_locks`.
    """
    try:
        fd = open_regular(path)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)
    return False


def _decode_text(raw: bytes) -> str:
    return raw.split(b"\x00", 1)[0].decode("utf-8", errors="replace")


def header_size_of(version: int) -> int:
    """The header's size in a ring file of format `version`."""
    if version >= 4:
        return HEADER_SIZE
    return HEADER_SIZE_V3 if version == 3 else HEADER_PAGE


def host_sample_word(slot: int) -> int:
    """Header word index of host sample slot `slot` (0 ≤ slot < HOST_SAMPLES)."""
    return HOST_SAMPLES_OFFSET // 8 + slot * HOST_SAMPLE_WORDS


def _host_samples_from(words: np.ndarray) -> tuple[HostSample, ...]:
    """The committed samples of the ring, oldest first (a slot caught mid-write is left out)."""
    count = int(words[HOST_SIGNALS_OFFSET // 8 + HS_SAMPLE_COUNT])
    samples = []
    for number in range(max(1, count - HOST_SAMPLES + 1), count + 1):
        entry = words[host_sample_word((number - 1) % HOST_SAMPLES) :][:HOST_SAMPLE_WORDS]
        if entry[HOST_SAMPLE_SERIAL] == number and entry[HOST_SAMPLE_CHECK] == number:
            samples.append(HostSample(*(int(value) for value in entry[1 : 1 + len(HOST_SAMPLE_FIELDS)])))
    return tuple(samples)


def _host_signals_from(words: np.ndarray, raw: bytes) -> dict:
    scalars = words[HOST_SIGNALS_OFFSET // 8 :]
    notes = _decode_text(raw[HOST_NOTES_OFFSET : HOST_NOTES_OFFSET + HOST_NOTES_BYTES])
    return {
        "host_samples": _host_samples_from(words),
        "cgroup_version": int(scalars[HS_CGROUP_VERSION]),
        "host_notes": tuple(line for line in notes.split("\n") if line),
        "main_thread_id": int(scalars[HS_MAIN_THREAD_ID]),
        "gc_collections": int(scalars[HS_GC_COLLECTIONS]),
        "gc_ns": int(scalars[HS_GC_NS]),
    }


def _comm_counters_from(words: np.ndarray, version: int) -> dict[int, CommCounters]:
    counters = {}
    for slot in range(min(int(words[W_COMM_COUNTERS_USED]), MAX_COMM_COUNTERS)):
        entry = words[COMM_COUNTERS_OFFSET // 8 + slot * COMM_COUNTER_WORDS :][:COMM_COUNTER_WORDS]
        later = {}
        if version >= 3:
            first = HISTOGRAM_OFFSET // 8 + slot * HISTOGRAM_WORDS
            later = {
                "max_duration_ns": int(entry[C_MAX_DURATION_NS]),
                "histogram": tuple(int(count) for count in words[first : first + HISTOGRAM_BUCKETS]),
                "duration_sum_ns": int(words[first + H_SUM_NS]),
            }
        counters[int(entry[C_ID])] = CommCounters(
            issued=int(entry[C_ISSUED]),
            completed=int(entry[C_COMPLETED]),
            inflight_op=OP_NAMES.get(int(entry[C_INFLIGHT_OP]), ""),
            inflight_seq=int(entry[C_INFLIGHT_SEQ]),
            inflight_enqueue_ns=int(entry[C_INFLIGHT_ENQUEUE_NS]),
            last_op=OP_NAMES.get(int(entry[C_LAST_OP]), ""),
            **later,
        )
    return counters


def _pauses_from(words: np.ndarray) -> dict[str, PauseState]:
    pauses = {}
    for code, name in PAUSE_KIND_NAMES.items():
        entry = words[PAUSES_OFFSET // 8 + (code - 1) * PAUSE_WORDS :][:PAUSE_WORDS]
        pauses[name] = PauseState(int(entry[P_SINCE_NS]), int(entry[P_ENDED]), int(entry[P_TOTAL_NS]))
    return pauses


def _header_from(words: np.ndarray, raw: bytes) -> RingHeader:
    def per_op(base: int) -> dict[str, int]:
        return {name: int(words[base + code]) for code, name in OP_NAMES.items()}

    version = int(words[W_VERSION])
    later: dict = {}
    if version >= 2:
        later = {
            "capture": CAPTURE_NAMES.get(int(words[W_CAPTURE]), ""),
            "cuda_device": int(words[W_CUDA_DEVICE]),
            "device_uuid": _decode_text(raw[DEVICE_UUID_OFFSET : DEVICE_UUID_OFFSET + DEVICE_UUID_BYTES]),
            "comm_counters": _comm_counters_from(words, version),
        }
    if version >= 3:
        later["pause_kind"] = PAUSE_KIND_NAMES.get(int(words[W_PAUSE_KIND]), "")
        later["pauses"] = _pauses_from(words)
    if version >= 4:
        later.update(_host_signals_from(words, raw))

    return RingHeader(
        version=version,
        job=_decode_text(raw[JOB_OFFSET : JOB_OFFSET + TEXT_FIELD_BYTES]),
        rank=int(words[W_RANK]),
        local_rank=int(words[W_LOCAL_RANK]),
        world_size=int(words[W_WORLD_SIZE]),
        host=_decode_text(raw[HOST_OFFSET : HOST_OFFSET + TEXT_FIELD_BYTES]),
        pid=int(words[W_PID]),
        start_time_ns=int(words[W_START_TIME_NS]),
        calls_by_op=per_op(W_CALLS_BY_OP),
        bytes_by_op=per_op(W_BYTES_BY_OP),
        wait_ns_total=int(words[W_WAIT_NS_TOTAL]),
        last_enqueue_ns=int(words[W_LAST_ENQUEUE_NS]),
        last_complete_ns=int(words[W_LAST_COMPLETE_NS]),
        oldest_inflight_enqueue_ns=int(words[W_OLDEST_INFLIGHT_ENQUEUE_NS]),
        oldest_inflight_op=OP_NAMES.get(int(words[W_OLDEST_INFLIGHT_OP]), ""),
        step_count=int(words[W_STEP_COUNT]),
        last_step_ns=int(words[W_LAST_STEP_NS]),
        last_step_end_ns=int(words[W_LAST_STEP_END_NS]),
        finished=bool(words[W_FINISHED]),
        capacity=int(words[W_CAPACITY]),
        records_written=int(sum(words[W_CALLS_BY_OP : W_CALLS_BY_OP + MAX_OPS])),
        pause_records=int(words[W_CALLS_BY_OP + OP_PAUSE]),
        dumps_written=int(words[W_DUMPS_WRITTEN]),
        stall_threshold_ns=int(words[W_STALL_THRESHOLD_NS]),
        writer_locks=bool(words[W_WRITER_FLAGS] & WRITER_HOLDS_LOCK),
        **later,
    )


def _check_header(path: Path, raw: bytes) -> np.ndarray:
    """The header words of `raw` (the file's first bytes, at least its header), checked."""
    if len(raw) < HEADER_PAGE:
        raise RingFormatError(f"{path}: too short for a ring file header ({len(raw)} bytes)")
    if raw[:8] != MAGIC:
        raise RingFormatError(f"{path}: not a Megatrace ring file (bad magic)")
    words = np.frombuffer(raw, dtype="<i8", count=HEADER_PAGE // 8)
    if words[W_VERSION] not in READABLE_VERSIONS:
        raise RingFormatError(f"{path}: ring format version {int(words[W_VERSION])} is not supported")
    size = header_size_of(int(words[W_VERSION]))
    if words[W_RECORD_SIZE] != RECORD_SIZE or words[W_HEADER_SIZE] != size:
        raise RingFormatError(f"{path}: unexpected header or record size")
    if len(raw) < size:
        raise RingFormatError(f"{path}: too short for a ring file header ({len(raw)} bytes)")
    return np.frombuffer(raw, dtype="<i8", count=size // 8)


def read_header(path: str | Path) -> RingHeader:
    """Only the header of a ring file (cheap: one 28 KiB read), e.g. for the exporter's counters."""
    path = Path(path)
    try:
        with open(open_regular(path), "rb") as handle:
            raw = handle.read(HEADER_SIZE)
    except OSError as exc:
        raise RingFormatError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    return header_of(path, raw)


def header_of(path: str | Path, raw: bytes) -> RingHeader:
    """The header in `raw`, the first `HEADER_SIZE` bytes of the ring file `path` (checked; a version 1
    or 2 file's header is its first `HEADER_PAGE` bytes, and `raw` may be shorter than `HEADER_SIZE`)."""
    return _header_from(_check_header(Path(path), raw), raw)


def parse_comm_table(table: bytes, count: int) -> dict[int, tuple[int, ...]]:
    """Communicator id → sorted member global ranks, from the first `count` entries of a table."""
    comms: dict[int, tuple[int, ...]] = {}
    pos = 0
    for _ in range(count):
        if pos + 16 > len(table):
            break
        cid, n = np.frombuffer(table, dtype="<i8", count=2, offset=pos)
        size = 16 + _round_up(int(n), 2) * 4
        if n < 0 or pos + size > len(table):
            break
        members = np.frombuffer(table, dtype="<i4", count=int(n), offset=pos + 16)
        comms[int(cid)] = tuple(members.tolist())
        pos += size
    return comms


def ops_only(records: np.ndarray) -> np.ndarray:
    """The records that are ops, without the span records (pauses, garbage collections)."""
    return records[~np.isin(records["op"], list(SPAN_NAMES))]


def read_ring(path: str | Path) -> RingSnapshot:
    """Read a ring file, also while its rank is writing it; slots caught mid-write are skipped."""
    path = Path(path)
    taken_ns = time.time_ns()
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            raw = handle.read(HEADER_SIZE)
            words = _check_header(path, raw)
            capacity = int(words[W_CAPACITY])
            records_offset = int(words[W_RECORDS_OFFSET])
            if records_offset + capacity * RECORD_SIZE > size:
                raise RingFormatError(f"{path}: file is shorter than its header says")
            mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise RingFormatError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        table_offset = int(words[W_COMM_TABLE_OFFSET])
        table_used = min(int(words[W_COMM_TABLE_USED]), int(words[W_COMM_TABLE_SIZE]))
        table = mapped[table_offset : table_offset + table_used]
        live = np.ndarray(capacity, dtype=RECORD_DTYPE, buffer=mapped, offset=records_offset)
        copied = live.copy()
        serial_after = live["serial"].copy()
        del live
        raw = mapped[:HEADER_SIZE]
    finally:
        mapped.close()
    words = np.frombuffer(raw, dtype="<i8", count=len(words))
    stable = (copied["serial"] != 0) & (copied["serial"] == serial_after)
    records = copied[stable]
    records = records[np.argsort(records["serial"], kind="stable")]
    return RingSnapshot(
        header=_header_from(words, raw),
        records=records,
        communicators=parse_comm_table(table, int(words[W_COMM_COUNT])),
        taken_ns=taken_ns,
    )
