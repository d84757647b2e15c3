"""The ttar reader that unpacks upstream sysfs fixtures (tests/support/ttar.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.ttar import TtarError, extract

SEPARATOR = b"# ttar - - - - - - - - - -\n"
ARCHIVE = SEPARATOR.join(
    [
        b"# Archive created by ttar -c -f x.ttar fixtures/\n",
        b"Directory: fixtures/sys\nMode: 755\n",
        b"Path: fixtures/sys/state\nLines: 1\n4: ACTIVE\nMode: 644\n",
        b"Path: fixtures/sys/guid\nLines: 1\n0a7f:bc12EOF\nMode: 444\n",
        b"Path: fixtures/sys/blob\nLines: 2\naNULLBYTEb\rc\nd\nMode: 600\n",
        b"Path: fixtures/sys/empty\nLines: 0\nMode: 644\n",
        b"Path: fixtures/sys/link\nSymlinkTo: state\n",
        b"Path: fixtures/proc/stat\nLines: 1\ncpu 1\nMode: 644\n",
    ]
)


def test_extracts_the_members_under_a_prefix(tmp_path: Path) -> None:
    assert extract(ARCHIVE, tmp_path, "fixtures/sys") == 6
    assert (tmp_path / "state").read_bytes() == b"4: ACTIVE\n"
    assert (tmp_path / "guid").read_bytes() == b"0a7f:bc12"  # EOF: no newline at the end
    assert (tmp_path / "blob").read_bytes() == b"a\0b\rc\nd\n"
    assert (tmp_path / "blob").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "empty").read_bytes() == b""
    assert os.readlink(tmp_path / "link") == "state"
    assert not (tmp_path / "proc").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob", "empty", "guid", "link", "state"]


@pytest.mark.parametrize(
    ("archive", "message"),
    [
        (b"Path: a\nLines: 3\nx\n", "promises 3 lines"),
        (b"Path: a\nLines: 1\nx\nOwner: me\n", "expected 'Mode'"),
        (b"Directory: a\n", "expected 'Mode'"),
        (b"Path: ../escape\nLines: 0\nMode: 644\n", "would leave the destination"),
        (b"Path: /etc/x\nLines: 0\nMode: 644\n", "would leave the destination"),
    ],
)
def test_malformed_or_escaping_archives_are_refused(archive: bytes, message: str, tmp_path: Path) -> None:
    with pytest.raises(TtarError, match=message):
        extract(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
