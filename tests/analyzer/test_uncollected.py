"""Ranks whose data was not collected (`--uncollected-ranks`, `--uncollected-ranks-file`): a real 8-rank
gloo job hangs on rank 5, and only the other node's four ranks (4-7) are read, as when node A's agent
was unreachable. Without the flag, ranks 0-3 are blamed for leaving no log; with it, the hung rank is
first and no uncollected rank is named. With the hung rank's node uncollected, nobody is blamed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatrace.analyzer.uncollected import format_ranks, parse_ranks, read_ranks_file
from megatrace.cli import main
from tests.support.gloo_job import run_traced_job

HUNG_RANK = 5


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = {"MEGATRACE_FAULT_HANG_RANK": str(HUNG_RANK), "MEGATRACE_FAULT_HANG_AT_STEP": "3"}
    return run_traced_job(tmp_path_factory.mktemp("job"), nprocs=8, steps=6, env=env)


def one_node(job: Path, ranks: range, to: Path) -> Path:
    """The job's files of `ranks` only: what a drill-down collects from one node's agent."""
    to.mkdir(parents=True)
    for rank in ranks:
        for path in job.glob(f"rank-{rank}.*"):
            shutil.copy2(path, to / path.name)
    return to


def analyze(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(["analyze", *argv, "--format", "json", "--quiet"])
    return code, json.loads(capsys.readouterr().out)


def test_uncollected_ranks_are_not_blamed_and_the_hung_rank_comes_first(
    eight_ranks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node_b = str(one_node(eight_ranks, range(4, 8), tmp_path / "node-b"))
    code, before = analyze(capsys, node_b)
    assert code == 1 and before["verdict"] == "hang"
    # without being told, the analyzer blames the ranks it has no data of
    assert {s["rank"] for s in before["suspects"] if s["cause"] == "no_log"} == {0, 1, 2, 3}

    code, after = analyze(capsys, node_b, "--uncollected-ranks", "0-3")
    assert code == 1 and after["verdict"] == "hang", json.dumps(after)[:2000]
    first = after["suspects"][0]
    assert (first["rank"], first["cause"]) == (HUNG_RANK, "rank_missing")
    assert not [s for s in after["suspects"] if s["rank"] in range(4)]
    assert after["uncollected_ranks"] == [0, 1, 2, 3]
    assert set(after["victims"]) == {4, 6, 7}
    assert any("0-3" in note and "not collected" in note for note in after["notes"])

    listed = tmp_path / "uncollected.txt"
    listed.write_text("# node-a's agent did not answer\n0,1\n2 3\n")
    code, from_file = analyze(capsys, node_b, "--uncollected-ranks-file", str(listed))
    assert from_file["suspects"] == after["suspects"]


def test_the_hung_ranks_node_uncollected_leaves_nobody_blamed(
    eight_ranks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node_a = str(one_node(eight_ranks, range(4), tmp_path / "node-a"))
    code, report = analyze(capsys, node_a, "--uncollected-ranks", "4-7")
    assert code == 3 and report["verdict"] == "inconclusive", json.dumps(report)[:2000]
    assert report["suspects"] == []
    assert "rank(s) 4-7 were waited on by rank(s) 0-3" in " ".join(report["notes"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--uncollected-ranks", "0-x"], "--uncollected-ranks: '0-x' is not a rank"),
        (["--uncollected-ranks", "5-2"], "--uncollected-ranks: '5-2' is not a range"),
        (["--uncollected-ranks-file", "/nonexistent/ranks"], "--uncollected-ranks-file /nonexistent/ranks:"),
    ],
)
def test_a_bad_rank_list_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["analyze", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_rank_lists_read_back_as_written() -> None:
    assert parse_ranks("0-3,8") == frozenset({0, 1, 2, 3, 8})
    assert parse_ranks(" 7 , 1\n2-2 ") == frozenset({1, 2, 7})
    assert parse_ranks("") == frozenset()
    assert format_ranks({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert format_ranks(set()) == ""
    many = set(range(0, 4096, 2)) | set(range(100, 200))
    assert parse_ranks(format_ranks(many)) == many


def test_a_ranks_file_allows_comments(tmp_path: Path) -> None:
    path = tmp_path / "ranks"
    path.write_text("0-1 # the first node\n# nothing here\n9\n")
    assert read_ranks_file(path) == frozenset({0, 1, 9})
