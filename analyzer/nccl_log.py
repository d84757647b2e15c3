"""Reader for Megatrace NCCL logs (``rank_<r>.log`` from the patched NCCL): bytes to columns, vectorized.

Each line is ``[save_count N] [sec.nsec] [Rank r] Fun Op Data count stream 0x.. opCount n [groupHash h]``.
A file whose every line has the full shape takes the fast path: pandas' C tokenizer reads the
numeric fields directly (over a million lines per second per core). Any other file goes through the
validating parser, which works on the whole file as a NumPy byte array (no per-line Python) and
checks every token; lines that do not have the exact shape (garbage, a line cut by a crash, a final
line without newline) are counted and skipped, never fatal. Both paths give the same result.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatrace.tracer.format import OP_CODES

HEAD = b"[save_count "
NCCL_OPS = {
    b"AllReduce": "all_reduce",
    b"AllGather": "all_gather",
    b"ReduceScatter": "reduce_scatter",
    b"Broadcast": "broadcast",
    b"Reduce": "reduce",
    b"Send": "send",
    b"Recv": "recv",
}
# fast path: field positions once brackets and the timestamp's dot are spaces (see `_fast_fields`)
_POW10 = np.array([10**k for k in range(20)], dtype=np.uint64)
_FAST_TRANSLATE = bytes.maketrans(b"[].", b"   ")
_FAST_FIELDS = 22
_FAST_INTS = {"sec": 5, "nsec": 6, "rank": 10, "count": 15, "op_count": 19, "group_hash": 21}
_FAST_COLUMNS = {**_FAST_INTS, "op": 13, "stream": 17, "head": 1, "opCount": 18}
# token index -> literal it must equal (tokens are separated by single spaces)
LITERALS = {
    0: b"[save_count",
    3: b"[Rank",
    5: b"Fun",
    7: b"Data",
    9: b"stream",
    11: b"opCount",
    13: b"groupHash",
}


@dataclass
class NcclRankLog:
    """Parsed calls of one rank's log, deduplicated across save batches, in opCount order per stream."""

    path: str
    rank: int
    enqueue_ns: np.ndarray
    op: np.ndarray
    count: np.ndarray
    stream: np.ndarray
    op_count: np.ndarray
    group_hash: np.ndarray  # int64; meaningful where has_hash
    has_hash: np.ndarray
    hash_digits: np.ndarray
    lines: int
    skipped: int
    duplicates: int


def looks_like_nccl_log(head: bytes) -> bool:
    return head.lstrip().startswith(HEAD)


def _token_bounds(data: np.ndarray, starts: np.ndarray, ends: np.ndarray, ntok: int):
    """Byte offsets [start, end) of the first `ntok` space-separated tokens of each line.

    Tokens a line does not have are empty (start = end = line end). Also returns the space count.
    """
    spaces = np.flatnonzero(data == 32)
    first = np.searchsorted(spaces, starts)
    nspace = np.searchsorted(spaces, ends) - first
    padded = np.concatenate((spaces, [len(data)])).astype(np.int64)
    tok_start = np.empty((len(starts), ntok), dtype=np.int64)
    tok_end = np.empty((len(starts), ntok), dtype=np.int64)
    for k in range(ntok):
        begin = starts if k == 0 else padded[np.minimum(first + k - 1, len(spaces))] + 1
        stop = padded[np.minimum(first + k, len(spaces))]
        tok_start[:, k] = np.where(k <= nspace, begin, ends)
        tok_end[:, k] = np.where(k < nspace, stop, ends)
    return tok_start, tok_end, nspace


def _gather(data: np.ndarray, start: np.ndarray, end: np.ndarray, width: int):
    """Bytes [start, end) of each row left-aligned in a (n, width) matrix, 0-padded; and lengths."""
    length = end - start
    cols = np.arange(width)
    idx = start[:, None] + cols[None, :]
    inside = cols[None, :] < length[:, None]
    out = np.where(inside, data[np.minimum(idx, len(data) - 1)], 0)
    return out.astype(np.uint8), length


def _digits(data: np.ndarray, start: np.ndarray, end: np.ndarray, width: int = 20):
    """Parse unsigned decimal tokens; returns (values, ok)."""
    chars, length = _gather(data, start, end, width)
    inside = np.arange(width)[None, :] < length[:, None]
    digit = chars.astype(np.int64) - 48
    ok = ((~inside) | ((digit >= 0) & (digit <= 9))).all(axis=1) & (length > 0) & (length <= min(width, 19))
    value = np.zeros(len(start), dtype=np.int64)
    for j in range(width):
        value = np.where(inside[:, j], value * 10 + digit[:, j], value)
    return value, ok


def _signed(data: np.ndarray, start: np.ndarray, end: np.ndarray):
    neg = data[np.minimum(start, len(data) - 1)] == ord("-")
    value, ok = _digits(data, start + neg, end)
    return np.where(neg, -value, value), ok, end - start - neg


def _hex(data: np.ndarray, start: np.ndarray, end: np.ndarray, width: int = 18):
    chars, length = _gather(data, start, end, width)
    ok = (chars[:, 0] == ord("0")) & (chars[:, 1] == ord("x")) & (length > 2) & (length <= width)
    value = np.zeros(len(start), dtype=np.int64)
    for j in range(2, width):
        c = chars[:, j].astype(np.int64)
        d = np.where(c >= 97, c - 87, c - 48)
        inside = j < length
        ok &= (~inside) | ((d >= 0) & (d <= 15) & ((c <= 57) | (c >= 97)))
        value = np.where(inside, (value << 4) | d, value)
    return value, ok


def _literal(data: np.ndarray, start: np.ndarray, end: np.ndarray, word: bytes) -> np.ndarray:
    chars, length = _gather(data, start, end, len(word))
    return (length == len(word)) & (chars == np.frombuffer(word, dtype=np.uint8)[None, :]).all(axis=1)


def _op_codes(data: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Our op code per line, or -1 for an unknown op name."""
    code = np.full(len(start), -1, dtype=np.int16)
    for word, name in NCCL_OPS.items():
        code[_literal(data, start, end, word)] = OP_CODES[name]
    return code


def _fast_fields(raw: bytes) -> tuple[dict[str, np.ndarray], int] | None:
    """Fields of a log whose every line has the full documented shape (with ``groupHash``), parsed by
    pandas' C tokenizer; None when any line does not, so that the validating parser handles it.

    Brackets and the timestamp's dot become spaces, which gives every well-formed line the same 22
    single-space-separated fields; only the numeric fields, the op name and the stream are read.
    """
    import pandas as pd  # here, not at the top: a load of ring files alone does without its ~40 MiB

    if not raw.endswith(b"\n"):
        return None
    lines = raw.count(b"\n")  # blank lines, CRLF or a bad field below send the file to the other parser
    try:
        frame = pd.read_csv(
            io.BytesIO(raw.translate(_FAST_TRANSLATE)),
            sep=" ",
            header=None,
            names=list(range(_FAST_FIELDS)),
            usecols=list(_FAST_COLUMNS.values()),
            dtype={
                column: "category" if name not in _FAST_INTS else np.int64
                for name, column in _FAST_COLUMNS.items()
            },
            quoting=csv.QUOTE_NONE,
            encoding="latin-1",
            engine="c",
            na_filter=False,
        )
    except (ValueError, pd.errors.ParserError):
        return None
    if len(frame) != lines or any(frame[c].dtype != np.int64 for c in _FAST_INTS.values()):
        return None
    fields = {name: frame[column].to_numpy() for name, column in _FAST_INTS.items()}
    op_cat = frame[_FAST_COLUMNS["op"]].cat
    op_map = [NCCL_OPS.get(str(name).encode()) for name in op_cat.categories]
    stream_cat = frame[_FAST_COLUMNS["stream"]].cat
    if None in op_map or not all(str(v).startswith("0x") for v in stream_cat.categories):
        return None
    if [list(frame[_FAST_COLUMNS[word]].cat.categories) for word in ("head", "opCount")] != [
        ["save_count"],
        ["opCount"],
    ]:
        return None
    try:
        streams = np.array([int(str(v), 16) for v in stream_cat.categories], dtype=np.int64)
    except (ValueError, OverflowError):
        return None
    if (fields["nsec"] >= 1_000_000_000).any() or (fields["nsec"] < 0).any():
        return None
    fields["op"] = np.array([OP_CODES[name] for name in op_map], dtype=np.uint8)[op_cat.codes.to_numpy()]
    fields["stream"] = streams[stream_cat.codes.to_numpy()]
    return fields, lines


def _hash_digits(values: np.ndarray) -> np.ndarray:
    """Number of decimal digits of each value (sign not counted)."""
    magnitude = np.abs(values).astype(np.uint64)  # abs(-2**63) wraps to 2**63, right as uint64
    return np.maximum(np.searchsorted(_POW10, magnitude, side="right"), 1).astype(np.int64)


def _from_fast(fields: dict[str, np.ndarray], lines: int, path: str) -> NcclRankLog:
    rank = int(np.bincount(fields["rank"] - fields["rank"].min()).argmax() + fields["rank"].min())
    keep = fields["rank"] == rank
    sel = {name: value[keep] for name, value in fields.items()}
    return _finish(
        path,
        rank,
        lines,
        {
            "enqueue_ns": sel["sec"] * 1_000_000_000 + sel["nsec"],
            "op": sel["op"],
            "count": sel["count"],
            "stream": sel["stream"],
            "op_count": sel["op_count"],
            "group_hash": sel["group_hash"],
            "has_hash": np.ones(len(sel["rank"]), dtype=bool),
            "hash_digits": _hash_digits(sel["group_hash"]),
        },
    )


def parse_nccl_bytes(raw: bytes, path: str = "") -> NcclRankLog:
    """Parse the bytes of one Megatrace NCCL log; see the module docstring for what is skipped."""
    fast = _fast_fields(raw)
    if fast is not None:
        return _from_fast(*fast, path)
    data = np.frombuffer(raw, dtype=np.uint8)
    newlines = np.flatnonzero(data == 10)
    starts = np.concatenate(([0], newlines + 1)).astype(np.int64)
    ends = np.concatenate((newlines, [len(data)])).astype(np.int64)
    complete_line = np.concatenate((np.ones(len(newlines), bool), [False]))
    nonblank = ends > starts
    # a final line without newline was cut mid-write: it cannot be trusted
    total_lines = int(nonblank.sum())
    keep = nonblank & complete_line
    starts, ends = starts[keep], ends[keep]
    # tolerate CRLF
    cr = (ends > starts) & (data[np.maximum(ends - 1, 0)] == 13) if len(data) else np.zeros(0, bool)
    ends = ends - cr
    ts_, te_, nspace = _token_bounds(data, starts, ends, 15)
    ok = (nspace == 12) | (nspace == 14)
    for k, word in LITERALS.items():
        ok &= _literal(data, ts_[:, k], te_[:, k], word) | ((k == 13) & (nspace == 12))
    _save_count, good = _digits(data, ts_[:, 1], te_[:, 1] - 1)
    ok &= good & (data[np.maximum(te_[:, 1] - 1, 0)] == ord("]"))
    # timestamp "[sec.nsec]"
    tstart, tend = ts_[:, 2] + 1, te_[:, 2] - 1
    ok &= (data[np.minimum(ts_[:, 2], len(data) - 1)] == ord("[")) & (data[np.maximum(tend, 0)] == ord("]"))
    dot = _find_byte(data, tstart, tend, ord("."))
    sec, good = _digits(data, tstart, dot, 12)
    ok &= good
    frac, good = _digits(data, dot + 1, tend, 9)
    ok &= good | (dot == tend)
    flen = np.clip(tend - dot - 1, 0, 9)
    frac = np.where(dot == tend, 0, frac * (10 ** (9 - flen)))
    rank, good = _digits(data, ts_[:, 4], te_[:, 4] - 1, 10)
    ok &= good & (data[np.maximum(te_[:, 4] - 1, 0)] == ord("]"))
    op = _op_codes(data, ts_[:, 6], te_[:, 6])
    ok &= op >= 0
    count, good = _digits(data, ts_[:, 8], te_[:, 8])
    ok &= good
    stream, good = _hex(data, ts_[:, 10], te_[:, 10])
    ok &= good
    op_count, good = _digits(data, ts_[:, 12], te_[:, 12])
    ok &= good
    has_hash = nspace == 14
    ghash, good, hdigits = _signed(data, ts_[:, 14], te_[:, 14])
    ok &= good | ~has_hash

    rank_ok = rank[ok]
    file_rank = int(np.bincount(rank_ok).argmax()) if len(rank_ok) else _rank_from_name(path)
    ok &= rank == file_rank
    sel = np.flatnonzero(ok)
    enqueue = sec[sel] * 1_000_000_000 + frac[sel]
    fields = {
        "enqueue_ns": enqueue,
        "op": op[sel].astype(np.uint8),
        "count": count[sel],
        "stream": stream[sel],
        "op_count": op_count[sel],
        "group_hash": np.where(has_hash[sel], ghash[sel], 0),
        "has_hash": has_hash[sel],
        "hash_digits": np.where(has_hash[sel], hdigits[sel], 0),
    }
    return _finish(path, file_rank, total_lines, fields)


def _finish(path: str, rank: int, total_lines: int, fields: dict[str, np.ndarray]) -> NcclRankLog:
    """Drop repeated records of overlapping save batches (one row per (stream, opCount)), time-ordered."""
    kept = len(fields["enqueue_ns"])
    order = np.lexsort((fields["op_count"], fields["stream"]))  # stable: the first copy is kept
    key_s, key_o = fields["stream"][order], fields["op_count"][order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = (key_s[1:] != key_s[:-1]) | (key_o[1:] != key_o[:-1])
    keep_rows = order[first]
    keep_rows = keep_rows[np.argsort(fields["enqueue_ns"][keep_rows], kind="stable")]
    fields = {name: value[keep_rows] for name, value in fields.items()}
    return NcclRankLog(
        path=path,
        rank=rank,
        lines=total_lines,
        skipped=total_lines - kept,
        duplicates=kept - len(keep_rows),
        **fields,
    )


def _find_byte(
    data: np.ndarray, start: np.ndarray, end: np.ndarray, byte: int, width: int = 24
) -> np.ndarray:
    """Offset of the first `byte` within [start, end), or `end` when absent."""
    chars, length = _gather(data, start, end, width)
    hit = (chars == byte) & (np.arange(width)[None, :] < length[:, None])
    pos = np.where(hit.any(axis=1), hit.argmax(axis=1), length)
    return start + pos


def _rank_from_name(path: str) -> int:
    stem = Path(path).stem
    digits = "".join(ch for ch in stem.rsplit("_", 1)[-1] if ch.isdigit())
    return int(digits) if digits else -1


def read_nccl_log(path: str | Path) -> NcclRankLog:
    return parse_nccl_bytes(Path(path).read_bytes(), str(path))
