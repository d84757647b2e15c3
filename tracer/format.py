"""The ring file format, defined once: header words, offsets, the record's fields, flags and code tables.

`megatrace.tracer.ringfile` (the Python writer and every reader) takes its layout from here, and the
native capture's C++ header is generated from it (`cpp_header`, written into the build folder by
`megatrace.tracer.native` at build time), so the two writers cannot disagree. The op-code table
(`OP_NAMES`) is also the analyzer's: every trace format is read into these codes. Changing a value here
changes the on-disk format (``docs/tracer-format.md``): bump `FORMAT_VERSION` and keep old versions
readable.
"""

from __future__ import annotations

import math
import re

import numpy as np

FORMAT_VERSION = 4
# Versions the readers accept: older files lack what later versions added (read as unset).
READABLE_VERSIONS = frozenset({1, 2, 3, 4})
MAGIC = b"MEGATRC\x00"
# Version 4 grew the header from three pages to seven, for the host signals (`header_size_of` in
# ringfile gives each version's size).
HEADER_SIZE = 28672
# Version 3 grew it from one page (4096 bytes) to three, for the pauses and the histograms.
HEADER_SIZE_V3 = 12288
# The first page: what versions 1 and 2 called the header (readers of those versions read only it).
HEADER_PAGE = 4096
RECORD_SIZE = 72
# Per-op counters in the header: one word per op code below MAX_OPS.
MAX_OPS = 32

# Header: 8-byte little-endian words at these word indices.
W_MAGIC = 0
W_VERSION = 1
W_HEADER_SIZE = 2
W_RECORD_SIZE = 3
W_CAPACITY = 4
W_COMM_TABLE_OFFSET = 5
W_COMM_TABLE_SIZE = 6
W_RECORDS_OFFSET = 7
W_RANK = 8
W_LOCAL_RANK = 9
W_WORLD_SIZE = 10
W_PID = 11
W_START_TIME_NS = 12
W_WAIT_NS_TOTAL = 14
W_LAST_ENQUEUE_NS = 15
W_LAST_COMPLETE_NS = 16
W_OLDEST_INFLIGHT_ENQUEUE_NS = 17
W_OLDEST_INFLIGHT_OP = 18
W_STEP_COUNT = 19
W_LAST_STEP_NS = 20
W_LAST_STEP_END_NS = 21
W_FINISHED = 22
W_COMM_COUNT = 23
W_COMM_TABLE_USED = 24
W_DUMPS_WRITTEN = 25
# Added to version 1 later; older writers left these words 0 (the file is created zero-filled).
W_STALL_THRESHOLD_NS = 26
W_WRITER_FLAGS = 27
# Added in version 2: how ops are captured, the rank's CUDA device, per-communicator counters.
W_CAPTURE = 28
W_CUDA_DEVICE = 29
W_COMM_COUNTERS_USED = 30
# Added in version 3: the kind of the pause begun last among those in progress (0: not in a pause).
W_PAUSE_KIND = 31
W_CALLS_BY_OP = 32
W_BYTES_BY_OP = W_CALLS_BY_OP + MAX_OPS
# Byte offsets of the text fields (UTF-8, NUL-padded).
JOB_OFFSET = 768
HOST_OFFSET = 1024
TEXT_FIELD_BYTES = 256
DEVICE_UUID_OFFSET = 1280
DEVICE_UUID_BYTES = 64
# Per-communicator counters (version 2): up to MAX_COMM_COUNTERS entries of COMM_COUNTER_WORDS words,
# from byte COMM_COUNTERS_OFFSET; the C_* names are word indices inside one entry.
COMM_COUNTERS_OFFSET = 1536
COMM_COUNTER_WORDS = 8
MAX_COMM_COUNTERS = 40
C_ID = 0
C_ISSUED = 1
C_COMPLETED = 2
C_INFLIGHT_OP = 3
C_INFLIGHT_SEQ = 4
C_INFLIGHT_ENQUEUE_NS = 5
C_LAST_OP = 6
# Version 3: the longest completed op of the communicator, enqueue to completion, ns.
C_MAX_DURATION_NS = 7

# Pauses (version 3): one entry of PAUSE_WORDS words per pause kind k (PAUSE_KIND_NAMES), at word
# PAUSES_OFFSET // 8 + (k - 1) * PAUSE_WORDS; the P_* names are word indices inside one entry.
PAUSES_OFFSET = 4096
PAUSE_WORDS = 4
MAX_PAUSE_KINDS = 8
P_SINCE_NS = 0
P_ENDED = 1
P_TOTAL_NS = 2
PAUSE_KIND_NAMES: dict[int, str] = {1: "checkpoint", 2: "eval", 3: "dataloader"}
PAUSE_KIND_CODES: dict[str, int] = {name: code for code, name in PAUSE_KIND_NAMES.items()}

# Per-communicator histograms of completed op durations (version 3): entry i (the communicator of
# counter entry i) is HISTOGRAM_WORDS words at byte HISTOGRAM_OFFSET + i * HISTOGRAM_WORDS * 8; word b
# counts ops whose duration d (ns) has bit length 20 + b: bucket 0 holds d < 2^20 ns (~1 ms), bucket b
# holds 2^(19+b) <= d < 2^(20+b), and the last, HISTOGRAM_BUCKETS - 1, everything from 2^40 ns (~18 min).
# The entry's word H_SUM_NS holds the sum of the durations; its last word is reserved.
HISTOGRAM_OFFSET = PAUSES_OFFSET + MAX_PAUSE_KINDS * PAUSE_WORDS * 8
HISTOGRAM_WORDS = 24
HISTOGRAM_BUCKETS = 22
HISTOGRAM_FIRST_BITS = 20
# Word of a histogram entry after the buckets: the sum of the counted durations, ns.
H_SUM_NS = HISTOGRAM_BUCKETS

# Host signals (version 4), written by the rank's own watchdog thread (`megatrace.tracer.host_signals`)
# and the garbage collector's callback: HOST_SIGNAL_WORDS scalar words from byte HOST_SIGNALS_OFFSET (the
# HS_* names are word indices inside them), the notes saying why a signal is unavailable (UTF-8 lines,
# NUL-padded) at HOST_NOTES_OFFSET, and a ring of the last HOST_SAMPLES samples at HOST_SAMPLES_OFFSET.
HOST_SIGNALS_OFFSET = HEADER_SIZE_V3
HOST_SIGNAL_WORDS = 64
# The rank's cgroup hierarchy: 0 unknown, 1 (v1 controllers) or 2 (unified).
HS_CGROUP_VERSION = 0
# threading.main_thread().ident, the thread id faulthandler prints for the main thread.
HS_MAIN_THREAD_ID = 1
# Garbage collections on this rank (every generation) and their total pause, ns.
HS_GC_COLLECTIONS = 2
HS_GC_NS = 3
# Samples written so far: sample n (1-based) lives in slot (n - 1) % HOST_SAMPLES.
HS_SAMPLE_COUNT = 4
# The sampling interval (MEGATRACE_TRACE_HOST_SAMPLE_MS) in ns; 0: the rank does not sample.
HS_SAMPLE_INTERVAL_NS = 5
HOST_NOTES_OFFSET = HOST_SIGNALS_OFFSET + HOST_SIGNAL_WORDS * 8
HOST_NOTES_BYTES = 3584
HOST_SAMPLES_OFFSET = HOST_NOTES_OFFSET + HOST_NOTES_BYTES
HOST_SAMPLES = 64
# One sample slot: word 0 holds the sample's number n, then one word per HOST_SAMPLE_FIELDS name, then
# reserved words, and the last word holds n again. The sampler zeroes the last word first and writes
# it, then word 0, at the end: a reader takes a slot only where both words hold the same nonzero n.
HOST_SAMPLE_WORDS = 24
HOST_SAMPLE_SERIAL = 0
HOST_SAMPLE_CHECK = HOST_SAMPLE_WORDS - 1
# The sample's fields in word order from word 1 (`ringfile.HostSample`; -1 = unavailable on this host).
HOST_SAMPLE_FIELDS = (
    "time_ns", "cpu_ns", "runq_ns", "voluntary_switches", "nonvoluntary_switches", "major_faults",
    "read_bytes", "blkio_delay_ns", "main_io_wait_samples", "cfs_periods", "cfs_throttled_periods",
    "cfs_throttled_ns", "memory_limit_hits", "memory_high_events", "oom_kills", "cpu_pressure_ns",
    "memory_pressure_ns", "io_pressure_ns", "gc_collections", "gc_ns", "dataloader_ns",
)  # fmt: skip

# Writer flag (word W_WRITER_FLAGS): the writing process holds a shared flock on the file while it lives.
WRITER_HOLDS_LOCK = 1
# Record flags: the caller asked for an async op; recorded by the native capture at the process-group
# layer (where whether the caller asked async is unknown).
FLAG_ASYNC = 1
FLAG_PROCESS_GROUP = 2
# Word W_CAPTURE: how the rank's ops are captured.
CAPTURE_NAMES: dict[int, str] = {0: "", 1: "python", 2: "native"}


def _packed(*fields: tuple[str, str]) -> tuple[tuple[str, str, int], ...]:
    """(field, NumPy type, byte offset) of fields laid out back to back in the order given."""
    out, offset = [], 0
    for name, fmt in fields:
        out.append((name, fmt, offset))
        offset += np.dtype(fmt).itemsize
    return tuple(out)


# Record (72 bytes): (field, little-endian NumPy type, byte offset), packed in this order. `serial` is
# the commit word, written last (0 while the slot is being written); the rest of the record is padding.
RECORD_FIELDS = _packed(
    ("serial", "<u8"), ("comm_id", "<u8"), ("seq", "<i8"), ("nbytes", "<u8"), ("enqueue_ns", "<i8"),
    ("complete_ns", "<i8"), ("step", "<i8"), ("rank", "<i4"), ("peer", "<i4"),
    ("op", "u1"), ("dtype", "u1"), ("flags", "u1"),
)  # fmt: skip


def fields_end() -> int:
    """The byte after a record's last field (the padding runs from there to RECORD_SIZE)."""
    _, fmt, offset = RECORD_FIELDS[-1]
    return offset + np.dtype(fmt).itemsize


RECORD_DTYPE = np.dtype(
    {
        "names": [name for name, _, _ in RECORD_FIELDS],
        "formats": [fmt for _, fmt, _ in RECORD_FIELDS],
        "offsets": [offset for _, _, offset in RECORD_FIELDS],
        "itemsize": RECORD_SIZE,
    }
)

# The op codes of every trace format: the tracers write them into records and per-op counters, and the
# analyzer reads every format into them.
OP_NAMES: dict[int, str] = {
    1: "all_reduce",
    2: "all_gather",
    3: "reduce_scatter",
    4: "broadcast",
    5: "reduce",
    6: "all_to_all",
    7: "barrier",
    8: "send",
    9: "recv",
    10: "gather",
    11: "scatter",
}
OP_CODES: dict[str, int] = {name: code for code, name in OP_NAMES.items()}
# The analyzer's code for an op of another format that the table does not name (no tracer writes it).
OP_OTHER = 12
# Records that are not ops (version 3): a pause span (comm_id 0; peer: the pause kind; seq: the
# pause's number among those of its kind). No tracer counts them as collectives; the analyzer skips them.
OP_PAUSE = 13
# A garbage collection (version 4) that lasted at least MEGATRACE_TRACE_GC_SPAN_MS: comm_id 0; peer: the
# generation collected; seq: the collection's number on this rank; nbytes: the objects it collected.
OP_GC = 14
SPAN_NAMES: dict[int, str] = {OP_PAUSE: "pause", OP_GC: "gc"}
# Every record's op byte by name: the ops and the spans.
RECORD_OP_NAMES: dict[int, str] = {**OP_NAMES, **SPAN_NAMES}
RECORD_OP_CODES: dict[str, int] = {name: code for code, name in RECORD_OP_NAMES.items()}
P2P_OPS = frozenset({OP_CODES["send"], OP_CODES["recv"]})


def op_name(code: int) -> str:
    """The name of op code `code` ("pause", "gc" for span records); "other" for a code no table holds."""
    return RECORD_OP_NAMES.get(code, "other")


def histogram_bucket(duration_ns: int) -> int:
    """The histogram bucket of an op that took `duration_ns` (the native capture computes the same with
    one count-leading-zeros)."""
    return min(max(duration_ns.bit_length() - HISTOGRAM_FIRST_BITS, 0), HISTOGRAM_BUCKETS - 1)


def bucket_upper_ns(bucket: int) -> int:
    """The exclusive upper edge of `bucket` in ns; 0 for the last bucket, which has none."""
    return 0 if bucket >= HISTOGRAM_BUCKETS - 1 else 1 << (HISTOGRAM_FIRST_BITS + bucket)


def quantile_upper_ns(histogram: tuple[int, ...] | list[int], max_ns: int, q: float) -> int:
    """An upper bound of the `q` quantile of the durations counted in `histogram`: the upper edge of the
    bucket holding it, or the longest duration `max_ns` where that is smaller (always so in the last
    bucket). 0 for an empty histogram."""
    total = sum(histogram)
    if total <= 0:
        return 0
    rank = max(1, math.ceil(round(q * total, 9)))
    seen = 0
    for bucket, count in enumerate(histogram):
        seen += count
        if seen >= rank:
            edge = bucket_upper_ns(bucket)
            return min(edge, max_ns) if edge and max_ns > 0 else max_ns or edge
    return max_ns


DTYPE_NAMES: dict[int, str] = {
    0: "none",
    1: "float32",
    2: "float16",
    3: "bfloat16",
    4: "float64",
    5: "int8",
    6: "uint8",
    7: "int16",
    8: "int32",
    9: "int64",
    10: "bool",
    11: "float8_e4m3fn",
    12: "float8_e5m2",
    13: "complex64",
    14: "complex128",
    15: "other",
}
DTYPE_CODES: dict[str, int] = {name: code for code, name in DTYPE_NAMES.items()}

_UPPER_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
_C_TYPES = {"<u8": "uint64_t", "<i8": "int64_t", "<i4": "int32_t", "u1": "uint8_t"}


def layout_constants() -> dict[str, int]:
    """Every integer constant of this module by name (word indices, sizes, offsets, flags, version)."""
    constants = {
        name: value for name, value in globals().items() if _UPPER_NAME.match(name) and type(value) is int
    }
    return dict(sorted(constants.items()))


def native_layout() -> dict[str, int]:
    """What the native module's ``layout()`` must report: the constants, the op and dtype codes, and
    each record field's offset and the record's size as the compiler laid out the C++ struct."""
    layout = dict(layout_constants())
    layout.update({f"OP_{name.upper()}": code for code, name in OP_NAMES.items()})
    layout.update({f"SPAN_{name.upper()}": code for code, name in SPAN_NAMES.items()})
    layout.update({f"DTYPE_{name.upper()}": code for code, name in DTYPE_NAMES.items()})
    layout.update({f"RECORD_{name.upper()}_OFFSET": offset for name, _, offset in RECORD_FIELDS})
    layout["RECORD_STRUCT_SIZE"] = RECORD_SIZE
    return layout


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.lower().split("_"))


def _cpp_constants() -> list[str]:
    lines = []
    for name, value in layout_constants().items():
        kind = "uint8_t" if name.startswith("FLAG_") else "int64_t"
        lines.append(f"constexpr {kind} k{_camel(name)} = {value};")
    magic = ", ".join(str(byte) for byte in MAGIC)
    lines.append(f"constexpr uint8_t kMagic[{len(MAGIC)}] = {{{magic}}};")
    ops = ", ".join(f"k{_camel(name)} = {code}" for code, name in OP_NAMES.items())
    ops += ", " + ", ".join(f"kSpan{_camel(name)} = {code}" for code, name in SPAN_NAMES.items())
    lines += ["", f"enum Op : uint8_t {{ {ops} }};", ""]
    lines += [f"constexpr uint8_t kDtype{_camel(name)} = {code};" for code, name in DTYPE_NAMES.items()]
    return lines


def _cpp_record() -> list[str]:
    lines = ["struct Record {"]
    lines += [f"  {_C_TYPES[fmt]} {name};" for name, fmt, _ in RECORD_FIELDS]
    lines += [f"  uint8_t pad[{RECORD_SIZE - fields_end()}];", "};"]
    lines.append('static_assert(sizeof(Record) == kRecordSize, "record");')
    for name, _, offset in RECORD_FIELDS:
        lines.append(f'static_assert(offsetof(Record, {name}) == {offset}, "record field {name}");')
    return lines


def _cpp_layout_entries() -> list[str]:
    entries = [(name, f"k{_camel(name)}") for name in layout_constants()]
    entries += [(f"OP_{name.upper()}", f"k{_camel(name)}") for name in OP_NAMES.values()]
    entries += [(f"SPAN_{name.upper()}", f"kSpan{_camel(name)}") for name in SPAN_NAMES.values()]
    entries += [(f"DTYPE_{name.upper()}", f"kDtype{_camel(name)}") for name in DTYPE_NAMES.values()]
    entries += [
        (f"RECORD_{name.upper()}_OFFSET", f"offsetof(Record, {name})") for name, _, _ in RECORD_FIELDS
    ]
    entries.append(("RECORD_STRUCT_SIZE", "sizeof(Record)"))
    return [
        "// Every constant above by its Python name, for the loader's comparison.",
        "",
        "inline std::vector<std::pair<const char*, int64_t>> layout_entries() {",
        "  return {",
        *(f'      {{"{name}", static_cast<int64_t>({expr})}},' for name, expr in entries),
        "  };",
        "}",
    ]


def cpp_header() -> str:
    """The C++ header the native capture compiles against (``ring_format.h``): the same layout as
    constants (``W_STEP_COUNT`` becomes ``kWStepCount``), the op and dtype codes, the `Record` struct,
    and ``layout_entries()``, which the module's ``layout()`` returns for the loader to compare."""
    lines = [
        "// Generated by megatrace.tracer.format.cpp_header() at build time; do not edit.",
        "#pragma once",
        "#include <cstddef>",
        "#include <cstdint>",
        "#include <utility>",
        "#include <vector>",
        "",
        "namespace megatrace {",
        "",
        *_cpp_constants(),
        "",
        *_cpp_record(),
        "",
        *_cpp_layout_entries(),
        "",
        "}  // namespace megatrace",
        "",
    ]
    return "\n".join(lines)
