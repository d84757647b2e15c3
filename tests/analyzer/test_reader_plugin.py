"""A reader with a setting is one file (`tests/analyzer/example_reader.py`) plus one row in `READERS`:
detected, parsed with its setting applied, analyzed end to end, and its setting checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrace.analyzer import formats
from megatrace.analyzer.loader import load
from megatrace.cli import main
from tests.analyzer import example_reader

US = 1000  # the example files' times are in microseconds


@pytest.fixture
def one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one row a new reader adds to the table."""
    monkeypatch.setitem(formats.READERS, example_reader.READER.name, example_reader.READER)


def _write_hung_job(folder: Path) -> None:
    """Four ranks, ten all-reduces, then ranks 0, 1 and 3 enter the eleventh and rank 2 never does;
    the traces are taken 3 s later. Times in microseconds."""
    folder.mkdir()
    start, step = 1_700_000_000_000_000, 10_000
    for rank in range(4):
        lines = ["# example-calls v1", f"observed {start + 10 * step + 3_000_000}"]
        for seq in range(10):
            enqueue = start + seq * step + rank
            lines.append(f"{rank} 0-1-2-3 {seq} all_reduce {enqueue} {enqueue + 500}")
        if rank != 2:
            lines.append(f"{rank} 0-1-2-3 10 all_reduce {start + 10 * step + rank} 0")
        (folder / f"calls-{rank}.txt").write_text("\n".join(lines) + "\n")


def _analyze(folder: Path, capsys: pytest.CaptureFixture[str], *options: str) -> tuple[int, dict]:
    code = main(["analyze", str(folder), "--format", "json", "--quiet", *options])
    return code, json.loads(capsys.readouterr().out)


def test_without_its_row_the_format_is_unknown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_hung_job(tmp_path / "job")
    code, report = _analyze(tmp_path / "job", capsys)
    assert (code, report["verdict"]) == (3, "no-data")


def test_a_new_reader_is_detected_parsed_with_its_setting_and_analyzed(
    one_row: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_hung_job(tmp_path / "job")
    code, report = _analyze(tmp_path / "job", capsys, "--reader-option", "example-calls.time_unit=us")
    assert code == 1 and report["verdict"] == "hang"
    assert report["suspects"][0]["rank"] == 2 and report["suspects"][0]["cause"] == "rank_missing"
    assert "3.0 s" in report["suspects"][0]["evidence"]
    assert report["inputs"]["files_by_format"] == {"example-calls": 4}


def test_the_setting_changes_what_is_read(
    one_row: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Read as nanoseconds (the default), the open calls are 3 ms old: no hang yet."""
    _write_hung_job(tmp_path / "job")
    table, _ = load(
        [tmp_path / "job"], settings=formats.reader_settings({"example-calls": {"time_unit": "us"}})
    )
    default, _ = load([tmp_path / "job"])
    assert int(table["enqueue_ns"].max()) == US * int(default["enqueue_ns"].max())
    code, report = _analyze(tmp_path / "job", capsys)
    assert code == 0 and report["verdict"] == "healthy"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("example-calls.time_unit=s", "key 'time_unit'"),
        ("example-calls.unit=us", "key 'unit': unknown key"),
        ("nosuch.time_unit=us", "unknown reader 'nosuch' (readers with settings: example-calls)"),
        ("example-calls=us", "expected READER.KEY=VALUE"),
    ],
)
def test_a_bad_reader_option_is_refused_naming_it(
    one_row: None, tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, message: str
) -> None:
    _write_hung_job(tmp_path / "job")
    assert main(["analyze", str(tmp_path / "job"), "--reader-option", option]) == 2
    assert message in capsys.readouterr().err


def test_the_built_in_readers_take_no_settings() -> None:
    assert formats.reader_settings() == {}
    with pytest.raises(ValueError, match="unknown reader 'ring'"):
        formats.reader_settings({"ring": {"x": "1"}})
