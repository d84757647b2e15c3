"""Fixtures of the cause tests: the seeded plan of which rank gets which fault, and the faults → class
table the tests fill (``MEGATRACE_CAUSE_TABLE``, default .pytest_cache/megatrace-cause-faults.md in the
repository), printed at the end of the run."""

from __future__ import annotations

import os
import random
import secrets
from dataclasses import dataclass
from pathlib import Path

import pytest

SEED_VAR = "MEGATRACE_CAUSE_SEED"
COLUMNS = ("fault", "seed", "culprit", "expected", "named class", "named rank", "evidence", "injection took")


def table_path(config: pytest.Config) -> Path:
    default = config.rootpath / ".pytest_cache" / "megatrace-cause-faults.md"
    return Path(os.environ.get("MEGATRACE_CAUSE_TABLE") or default)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controlling process starts a fresh table
        table_path(config).unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    path = table_path(config)
    if not hasattr(config, "workerinput") and path.exists():
        terminalreporter.write_sep("-", f"faults → cause class ({path})")
        terminalreporter.write_line(path.read_text())


@dataclass(frozen=True)
class Plan:
    """Which rank the fault hits (`culprit`), which other rank a decoy fault hits (`bystander`) and the
    CPU the culprit is pinned to, drawn from the run's seed and the test's name."""

    culprit: int
    bystander: int
    cpu: int


@pytest.fixture(scope="session")
def cause_seed() -> int:
    """The run's seed: ``MEGATRACE_CAUSE_SEED`` to replay a run, else a fresh one (in every row)."""
    return int(os.environ.get(SEED_VAR) or secrets.randbelow(1 << 31))


@pytest.fixture
def plan(cause_seed: int, request: pytest.FixtureRequest) -> callable:
    def draw(world: int) -> Plan:
        rng = random.Random(f"{cause_seed}:{request.node.name}")
        culprit, bystander = rng.sample(range(world), 2)
        return Plan(culprit, bystander, rng.randrange(2))

    return draw


@pytest.fixture
def record_row(request: pytest.FixtureRequest, cause_seed: int) -> callable:
    """Adds one row to the faults → class table (`plan` None: no rank was given a fault)."""

    def add(fault: str, plan: Plan | None, expected: str, why: dict, took: str) -> None:
        path = table_path(request.config)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [] if path.exists() else ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        culprit = "—" if plan is None else str(plan.culprit)
        cells = (
            fault, str(cause_seed), culprit, expected, str(why.get("class", "—")), str(why.get("rank", "—")),
            str(why.get("evidence", "")), took,
        )  # fmt: skip
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        with open(path, "a") as out:
            out.write("\n".join(lines) + "\n")

    return add
