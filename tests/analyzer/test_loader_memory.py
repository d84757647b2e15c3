"""What keeps the analyzer's memory near the size of its table: each rank's arrays freed as the table
is joined, pandas not loaded for ring files, communicators numbered in order of first appearance."""

from __future__ import annotations

import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from megatrace.analyzer.table import RankCalls, RankInfo, TableBuilder, empty_columns
from megatrace.analyzer.tracer_formats import factorize
from tests.support import scenarios as S

ROOT = Path(__file__).resolve().parents[2]


def test_the_builder_lets_go_of_each_ranks_arrays_once_joined() -> None:
    builder = TableBuilder()
    held = []
    for rank in range(3):
        cols = empty_columns(1000)
        cols["rank"][:] = rank
        calls = RankCalls(rank, cols, [(("comm", 1), (0, 1, 2), False)], RankInfo(rank))
        builder.add(calls, f"rank-{rank}")
        held.append((calls, [weakref.ref(array) for array in cols.values()]))
    table = builder.build()
    assert len(table) == 3000 and table["rank"].tolist() == [0] * 1000 + [1] * 1000 + [2] * 1000
    for calls, refs in held:  # the callers still hold their RankCalls, not the arrays
        assert calls.columns == {}
        assert [ref() for ref in refs] == [None] * len(refs)


@pytest.mark.parametrize("seed", range(5))
def test_factorize_numbers_values_in_order_of_first_appearance(seed: int) -> None:
    values = np.random.default_rng(seed).integers(-5, 40, size=500).astype(np.int64)
    codes, uniques = factorize(values)
    want_codes, want_uniques = pd.factorize(values)
    assert codes.tolist() == want_codes.tolist()
    assert uniques.tolist() == want_uniques.tolist()
    assert factorize(np.zeros(0, dtype=np.int64))[0].tolist() == []


def test_loading_ring_files_does_not_import_pandas(tmp_path: Path) -> None:
    trace = S.simulate(S.Scenario(world=4, tp=2, steps=3, layers=1))
    S.write_ring_files(trace, tmp_path / "job")
    code = (
        "import sys\n"
        "from megatrace.analyzer.loader import load\n"
        f"table, report = load([{str(tmp_path / 'job')!r}])\n"
        "assert report.files_by_format == {'ring': 4}, report\n"
        "print(len(table), 'pandas' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    rows, pandas_loaded = done.stdout.split()
    assert int(rows) > 0 and pandas_loaded == "False"
