"""Opening files that others can plant (trace directories, sysfs trees) without ever blocking.

A FIFO, a socket or a device in such a place must not hang a reader: files are opened non-blocking
and used only when they turn out to be regular files.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class NotRegularFile(OSError):
    """The path names a FIFO, socket, device or directory, not a regular file."""


def open_regular(path: str | Path, dir_fd: int | None = None) -> int:
    """A read-only descriptor on `path`, opened without blocking; NotRegularFile unless it is a
    regular file (the descriptor is then closed)."""
    fd = os.open(path, OPEN_FLAGS, dir_fd=dir_fd)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
    return fd


def is_regular(path: str | Path) -> bool:
    """Whether `path` is (or links to) a regular file, asked without opening it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False
