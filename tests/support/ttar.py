"""Reader for ttar, the plain-text archives in which Prometheus projects keep their sysfs/procfs fixtures.

An archive is a sequence of records separated by ``# ...`` comment lines: ``Directory: <path>``
then ``Mode: <octal>``; ``Path: <path>`` then ``SymlinkTo: <target>``; or ``Path: <path>``,
``Lines: <n>``, n lines of content, then ``Mode: <octal>``. In content, ``NULLBYTE`` stands for a
zero byte and a last line ending in ``EOF`` has no trailing newline.

`extract` writes the members under a prefix into a directory, refusing paths that would leave it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath


class TtarError(ValueError):
    """The archive is not well formed (the message names the line)."""


@dataclasses.dataclass(frozen=True)
class Member:
    """One archive entry: a directory, a regular file (``data``) or a symlink (``target``)."""

    path: str
    kind: str  # "dir", "file" or "symlink"
    mode: int = 0o755
    data: bytes = b""
    target: str = ""


def _field(lines: list[bytes], index: int, key: str) -> str:
    tag = f"{key}: ".encode()
    if index >= len(lines) or not lines[index].startswith(tag):
        got = lines[index][:80] if index < len(lines) else "end of archive"
        raise TtarError(f"line {index + 1}: expected {key!r}, got {got!r}")
    return lines[index][len(tag) :].decode()


def _content(lines: list[bytes]) -> bytes:
    data = b"\n".join(lines) + b"\n" if lines else b""
    if data.endswith(b"EOF\n"):
        data = data[: -len(b"EOF\n")]
    return data.replace(b"NULLBYTE", b"\0")


def members(archive: bytes) -> Iterator[Member]:
    """The entries of an archive (its bytes: content may hold any byte but newline), in order."""
    lines = archive.split(b"\n")
    index = 0
    while index < len(lines):
        line = lines[index]
        if not line or line.startswith(b"#"):
            index += 1
            continue
        if line.startswith(b"Directory: "):
            mode = int(_field(lines, index + 1, "Mode"), 8)
            yield Member(_field(lines, index, "Directory"), "dir", mode)
            index += 2
            continue
        path = _field(lines, index, "Path")
        if index + 1 < len(lines) and lines[index + 1].startswith(b"SymlinkTo: "):
            yield Member(path, "symlink", target=_field(lines, index + 1, "SymlinkTo"))
            index += 2
            continue
        count = int(_field(lines, index + 1, "Lines"))
        body = lines[index + 2 : index + 2 + count]
        if len(body) < count:
            raise TtarError(f"line {index + 2}: {path} promises {count} lines, archive ends first")
        mode = int(_field(lines, index + 2 + count, "Mode"), 8)
        yield Member(path, "file", mode, _content(body))
        index += 3 + count


def _relative(path: str, prefix: str) -> PurePosixPath | None:
    pure = PurePosixPath(path)
    if pure.is_absolute() or ".." in pure.parts:
        raise TtarError(f"member {path!r} would leave the destination")
    try:
        return pure.relative_to(prefix)
    except ValueError:
        return None


def extract(archive: bytes, destination: Path, prefix: str = ".") -> int:
    """Write the members under `prefix` (that part of their path dropped) into `destination`.

    Returns how many members were written. Symlinks are written as they are (their targets are
    relative paths inside the tree in the upstream fixtures).
    """
    written = 0
    for member in members(archive):
        relative = _relative(member.path, prefix)
        if relative is None:
            continue
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if member.kind == "dir":
            target.mkdir(exist_ok=True)
        elif member.kind == "symlink":
            os.symlink(member.target, target)
        else:
            target.write_bytes(member.data)
            target.chmod(member.mode)
        written += 1
    return written
