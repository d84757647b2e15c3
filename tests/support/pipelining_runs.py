"""Recorded runs of the users' corpus (bench/corpus.py --plan users) kept as test fixtures:
tests/fixtures/pipelining_runs.tar.gz, one folder a run with its ``label.json`` and ``plan.json`` and
its ring files (``rank-*.trace``) or torch's Flight Recorder dumps (``fr/``)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from megatrace.analyzer.layout import LayoutConfig

ARCHIVE = Path(__file__).parents[1] / "fixtures" / "pipelining_runs.tar.gz"


def extract(root: Path) -> Path:
    """Unpack the runs under `root`; returns the folder holding one folder a run."""
    with tarfile.open(ARCHIVE) as archive:
        archive.extractall(root, filter="data")
    return root / "pipelining_runs"


def layout_of(run: Path) -> LayoutConfig:
    """The layout the run used, as the flags would give it."""
    label = json.loads((run / "label.json").read_text())
    return LayoutConfig(world_size=label["world"], tp=1, pp=label["pp"], dp=label["dp"])
