"""Stall dumps: a rank's ring snapshot written out as greppable text, and read back.

A dump is ``<trace_dir>/<job>/rank-<N>.<pid>.<k>.dump``: ``#`` lines carry the header, the
communicator table and (stall and signal dumps) every thread's Python stack, then one ``key=value``
line per op, oldest first (format in ``docs/tracer-format.md``). `read_dump` returns the same
`RingSnapshot` as `read_ring`, with the stacks.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from urllib.parse import quote, unquote

import numpy as np

from megatrace.tracer.format import OP_PAUSE, PAUSE_KIND_NAMES, RECORD_OP_CODES, RECORD_OP_NAMES
from megatrace.tracer.ringfile import (
    DTYPE_CODES,
    DTYPE_NAMES,
    FLAG_ASYNC,
    FLAG_PROCESS_GROUP,
    FORMAT_VERSION,
    OP_NAMES,
    READABLE_VERSIONS,
    RECORD_DTYPE,
    CommCounters,
    HostSample,
    PauseState,
    RingHeader,
    RingSnapshot,
)
from megatrace.tracer.stacks import StackLinesError, StackSection, stack_lines

DUMP_MAGIC = "# megatrace-dump"
DUMP_SUFFIX = ".dump"
DEFAULT_DUMP_RECORDS = 10000
_IDENTITY_KEYS = ("job", "rank", "local_rank", "world_size", "host", "pid", "start_time_ns")
_COUNTER_KEYS = (
    "wait_ns_total", "last_enqueue_ns", "last_complete_ns", "oldest_inflight_enqueue_ns",
    "oldest_inflight_op", "step_count", "last_step_ns", "last_step_end_ns", "finished",
    "capacity", "records_written", "dumps_written",
)  # fmt: skip
# Header words added to version 1 later: written always, read as 0 from dumps that lack them.
_LATER_KEYS: dict[str, type] = {"stall_threshold_ns": int, "writer_locks": bool, "pause_records": int}
# Added in version 2 (read as unset from version 1 dumps).
_V2_KEYS = ("capture", "cuda_device", "device_uuid")
_COUNTER_FIELDS = ("issued", "completed", "inflight_op", "inflight_seq", "inflight_enqueue_ns", "last_op")
# Added in version 3: the fields of a "# pause" line (one per pause kind).
_PAUSE_FIELDS = ("since_ns", "ended", "total_ns")
# Added in version 4: the host-signal scalars ("# host-signals"), one "# host-note" line per note, one
# "# host" line per host sample (oldest first, the `HostSample` fields).
_HOST_SIGNAL_KEYS = ("cgroup_version", "main_thread_id", "gc_collections", "gc_ns")
_HOST_SAMPLE_KEYS = tuple(field.name for field in dataclasses.fields(HostSample))
_RECORD_INT_KEYS = ("serial", "rank", "comm", "seq", "nbytes", "peer", "enqueue_ns", "complete_ns", "step")


class DumpFormatError(ValueError):
    """A dump file that cannot be read; the message names the file and line."""


def dump_path(job_dir: Path, rank: int, pid: int, index: int) -> Path:
    """Path of the `index`-th dump written by process `pid` as rank `rank`."""
    return Path(job_dir) / f"rank-{rank}.{pid}.{index}{DUMP_SUFFIX}"


def _value(value: object) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, str):
        return quote(value, safe="") if value else "-"
    return str(value)


def _pairs(items: list[tuple[str, object]]) -> str:
    return " ".join(f"{key}={_value(value)}" for key, value in items)


def format_record(row: np.void) -> str:
    """One record as a dump line."""
    state = "completed" if row["complete_ns"] else "inflight"
    op = int(row["op"])
    kind = [("kind", PAUSE_KIND_NAMES.get(int(row["peer"]), ""))] if op == OP_PAUSE else []
    return _pairs(
        [
            ("serial", int(row["serial"])),
            ("rank", int(row["rank"])),
            ("op", RECORD_OP_NAMES.get(op, f"op{op}")),
            *kind,
            ("comm", int(row["comm_id"])),
            ("seq", int(row["seq"])),
            ("nbytes", int(row["nbytes"])),
            ("dtype", DTYPE_NAMES.get(int(row["dtype"]), "other")),
            ("peer", int(row["peer"])),
            ("enqueue_ns", int(row["enqueue_ns"])),
            ("complete_ns", int(row["complete_ns"])),
            ("step", int(row["step"])),
            ("async", int(row["flags"]) & FLAG_ASYNC),
            ("pg", int(bool(int(row["flags"]) & FLAG_PROCESS_GROUP))),
            ("state", state),
        ]
    )


def write_dump(
    path: str | Path,
    snapshot: RingSnapshot,
    reason: str,
    taken_ns: int | None = None,
    max_records: int = DEFAULT_DUMP_RECORDS,
) -> Path:
    """Write `snapshot` (its newest `max_records` records) as a dump file, atomically; returns the path."""
    path = Path(path)
    h = snapshot.header
    taken_ns = time.time_ns() if taken_ns is None else taken_ns
    lines = [
        f"{DUMP_MAGIC} version={FORMAT_VERSION}",
        "# " + _pairs([("reason", reason), ("taken_ns", taken_ns)]),
        "# " + _pairs([(key, getattr(h, key)) for key in _IDENTITY_KEYS]),
        "# " + _pairs([(key, getattr(h, key)) for key in (*_COUNTER_KEYS, *_LATER_KEYS)]),
        "# " + _pairs([(key, getattr(h, key)) for key in _V2_KEYS]),
        "# " + _pairs([("pause_kind", h.pause_kind)]),
        "# calls " + _pairs(sorted(h.calls_by_op.items())),
        "# bytes " + _pairs(sorted(h.bytes_by_op.items())),
    ]
    for cid, ranks in sorted(snapshot.communicators.items()):
        lines.append(f"# comm id={cid} ranks={','.join(str(r) for r in ranks)}")
    for cid, counters in sorted(h.comm_counters.items()):
        histogram = ",".join(str(count) for count in counters.histogram) or "-"
        fields = [(key, getattr(counters, key)) for key in _COUNTER_FIELDS]
        fields += [
            ("max_duration_ns", counters.max_duration_ns),
            ("duration_sum_ns", counters.duration_sum_ns),
            ("histogram", histogram),
        ]
        lines.append("# counters " + _pairs([("id", cid), *fields]))
    for kind, pause in sorted(h.pauses.items()):
        lines.append(
            "# pause " + _pairs([("kind", kind), *((key, getattr(pause, key)) for key in _PAUSE_FIELDS)])
        )
    lines.append("# host-signals " + _pairs([(key, getattr(h, key)) for key in _HOST_SIGNAL_KEYS]))
    lines.extend("# host-note " + _pairs([("text", note)]) for note in h.host_notes)
    lines.extend(
        "# host " + _pairs([(key, getattr(sample, key)) for key in _HOST_SAMPLE_KEYS])
        for sample in h.host_samples
    )
    lines.extend(stack_lines(snapshot.stacks, h.oldest_inflight_op, h.oldest_inflight_enqueue_ns))
    records = snapshot.records[-max_records:] if max_records > 0 else snapshot.records[:0]
    lines.extend(format_record(row) for row in records)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _parse_pairs(text: str, where: str) -> dict[str, str]:
    pairs = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if not sep or not key:
            raise DumpFormatError(f"{where}: expected key=value, got {token!r}")
        pairs[key] = value
    return pairs


def _int(pairs: dict[str, str], key: str, where: str) -> int:
    try:
        return int(pairs[key])
    except KeyError:
        raise DumpFormatError(f"{where}: missing {key}=") from None
    except ValueError:
        raise DumpFormatError(f"{where}: {key}= is not an integer: {pairs[key]!r}") from None


def _text(raw: str) -> str:
    return "" if raw == "-" else unquote(raw)


def _per_op(pairs: dict[str, str], where: str) -> dict[str, int]:
    counts = {name: 0 for name in OP_NAMES.values()}
    for key in pairs:
        counts[key] = _int(pairs, key, where)
    return counts


def _v3_counters(pairs: dict[str, str], where: str) -> dict:
    """The version 3 fields of a counters line (none in older dumps)."""
    if "max_duration_ns" not in pairs:
        return {}
    raw = _text(pairs.get("histogram", "-"))
    try:
        histogram = tuple(int(count) for count in raw.split(",")) if raw else ()
    except ValueError:
        raise DumpFormatError(f"{where}: histogram= must be comma-separated integers") from None
    return {
        "max_duration_ns": _int(pairs, "max_duration_ns", where),
        "duration_sum_ns": _int(pairs, "duration_sum_ns", where),
        "histogram": histogram,
    }


def _parse_record(pairs: dict[str, str], where: str) -> tuple:
    values = {key: _int(pairs, key, where) for key in _RECORD_INT_KEYS}
    op = RECORD_OP_CODES.get(pairs.get("op", ""))
    if op is None:
        raise DumpFormatError(f"{where}: unknown op {pairs.get('op')!r}")
    dtype = DTYPE_CODES.get(pairs.get("dtype", ""), DTYPE_CODES["other"])
    flags = (FLAG_ASYNC if pairs.get("async") == "1" else 0) | (
        FLAG_PROCESS_GROUP if pairs.get("pg") == "1" else 0
    )
    return (
        values["serial"], values["comm"], values["seq"], values["nbytes"], values["enqueue_ns"],
        values["complete_ns"], values["step"], values["rank"], values["peer"], op, dtype, flags,
    )  # fmt: skip


def read_dump(path: str | Path) -> RingSnapshot:
    """Parse a dump file back into a `RingSnapshot` (records oldest first, dtype RECORD_DTYPE)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DumpFormatError(f"{path}: cannot read: {exc}") from exc
    if not lines or not lines[0].startswith(DUMP_MAGIC):
        raise DumpFormatError(f"{path}: not a Megatrace dump (first line must start {DUMP_MAGIC!r})")
    version = _int(_parse_pairs(lines[0][len(DUMP_MAGIC) :], f"{path}:1"), "version", f"{path}:1")
    if version not in READABLE_VERSIONS:
        raise DumpFormatError(f"{path}: dump format version {version} is not supported")
    meta: dict[str, str] = {}
    calls: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    comms: dict[int, tuple[int, ...]] = {}
    counters: dict[int, CommCounters] = {}
    pauses: dict[str, PauseState] = {}
    host: dict = {"host_samples": [], "host_notes": []}
    stacks = StackSection()
    rows = []
    for number, line in enumerate(lines[1:], start=2):
        where = f"{path}:{number}"
        if not line.strip():
            continue
        if line.startswith("# calls "):
            calls = _per_op(_parse_pairs(line[len("# calls ") :], where), where)
        elif line.startswith("# bytes "):
            nbytes = _per_op(_parse_pairs(line[len("# bytes ") :], where), where)
        elif line.startswith("# comm "):
            pairs = _parse_pairs(line[len("# comm ") :], where)
            try:
                members = tuple(int(r) for r in pairs.get("ranks", "").split(",") if r)
            except ValueError:
                raise DumpFormatError(f"{where}: ranks= must be comma-separated integers") from None
            comms[_int(pairs, "id", where)] = members
        elif line.startswith("# counters "):
            pairs = _parse_pairs(line[len("# counters ") :], where)
            counters[_int(pairs, "id", where)] = CommCounters(
                **{
                    key: _text(pairs.get(key, "-")) if key.endswith("_op") else _int(pairs, key, where)
                    for key in _COUNTER_FIELDS
                },
                **_v3_counters(pairs, where),
            )
        elif line.startswith("# pause "):
            pairs = _parse_pairs(line[len("# pause ") :], where)
            pauses[_text(pairs.get("kind", "-"))] = PauseState(
                *(_int(pairs, key, where) for key in _PAUSE_FIELDS)
            )
        elif line.startswith("# host-signals "):
            pairs = _parse_pairs(line[len("# host-signals ") :], where)
            host.update({key: _int(pairs, key, where) for key in _HOST_SIGNAL_KEYS})
        elif line.startswith("# host-note "):
            host["host_notes"].append(
                _text(_parse_pairs(line[len("# host-note ") :], where).get("text", "-"))
            )
        elif line.startswith("# host "):
            pairs = _parse_pairs(line[len("# host ") :], where)
            host["host_samples"].append(HostSample(*(_int(pairs, key, where) for key in _HOST_SAMPLE_KEYS)))
        elif StackSection.holds(line):
            try:
                stacks.add(line)
            except StackLinesError as exc:
                raise DumpFormatError(f"{where}: {exc}") from None
        elif line.startswith("#"):
            meta.update(_parse_pairs(line[1:], where))
        else:
            rows.append(_parse_record(_parse_pairs(line, where), where))
    where = f"{path} header"
    missing = [key for key in (*_IDENTITY_KEYS, *_COUNTER_KEYS) if key not in meta]
    if missing:
        raise DumpFormatError(f"{where}: missing {', '.join(missing)}")
    header = RingHeader(
        version=version,
        job=_text(meta["job"]),
        host=_text(meta["host"]),
        oldest_inflight_op=_text(meta["oldest_inflight_op"]),
        finished=meta["finished"] == "1",
        calls_by_op=calls or _per_op({}, where),
        bytes_by_op=nbytes or _per_op({}, where),
        **{
            key: _int(meta, key, where)
            for key in (*_IDENTITY_KEYS, *_COUNTER_KEYS)
            if key not in ("job", "host", "oldest_inflight_op", "finished")
        },
        **{key: kind(_int(meta, key, where)) for key, kind in _LATER_KEYS.items() if key in meta},
        capture=_text(meta.get("capture", "-")),
        cuda_device=_int(meta, "cuda_device", where) if "cuda_device" in meta else -1,
        device_uuid=_text(meta.get("device_uuid", "-")),
        comm_counters=counters,
        pause_kind=_text(meta.get("pause_kind", "-")),
        pauses=pauses,
        **{**host, "host_samples": tuple(host["host_samples"]), "host_notes": tuple(host["host_notes"])},
    )
    return RingSnapshot(
        header=header,
        records=np.array(rows, dtype=RECORD_DTYPE),
        communicators=comms,
        taken_ns=_int(meta, "taken_ns", where) if "taken_ns" in meta else 0,
        reason=_text(meta.get("reason", "-")),
        stacks=stacks.stacks(),
    )
