"""The whole pipeline on this machine, as `make demo` runs it (shorter): real training job, tracer,
node agent, Prometheus with the project's rules, Alertmanager, alert bot and analyzer."""

from __future__ import annotations

from pathlib import Path

import openpyxl
import pytest

from megatrace.config import load_config
from megatrace.demo import DemoFailed, Scenario, bot_diagnostics, card_text, headline_rank, run
from megatrace.stack import read_state
from megatrace.stack_config import StackConfig
from tests.support.services import free_port


@pytest.mark.timeout(600)
def test_hang_and_slow_rank_are_named_in_delivered_messages(tmp_path: Path) -> None:
    ports = {
        name: free_port() for name in ("prometheus", "alertmanager", "node_exporter", "exporter", "alertbot")
    }
    config = load_config(
        StackConfig,
        environ={},
        overrides={
            "state_dir": str(tmp_path / "stack"),
            "ports": ports,
            "scrape_interval": "1s",
            "time_compression": 30,
            "sysfs_root": str(Path(__file__).parents[1] / "fixtures" / "sysfs" / "infiniband"),
        },
    )
    try:
        outcome = run(config, Scenario(seed=7, step_timeout=180), say=lambda line: None)
    except DemoFailed as exc:
        pytest.fail("\n".join([str(exc), *bot_diagnostics(Path(config.state_dir))]))

    assert outcome.hang_message["level"] == "P0"
    assert "demo-hang" in card_text(outcome.hang_message)
    assert headline_rank(outcome.hang_message) == outcome.hung_rank  # the first card names the culprit
    assert outcome.hang_cards == 1
    assert outcome.hang_resolved["kind"] == "resolved"
    assert outcome.hang_resolved["replaces"] in card_text(outcome.hang_message)  # the same card, resolved

    assert outcome.slow_message["level"] == "P1"
    assert f"Rank {outcome.slow_rank} " in card_text(outcome.slow_message)
    assert headline_rank(outcome.slow_message) == outcome.slow_rank
    assert outcome.slow_cards == 1

    workbook = openpyxl.load_workbook(outcome.report_path)
    detail = workbook[workbook.sheetnames[1]]
    alertnames = {cell.value for row in detail.iter_rows() for cell in row}
    assert "MegatraceSlowRank" in alertnames and "MegatraceJobHang" in alertnames
    culprits = {row[10] for row in detail.iter_rows(min_row=2, values_only=True)}
    assert f"rank {outcome.hung_rank}" in {str(c).split(" on ")[0] for c in culprits}

    assert read_state(Path(config.state_dir)) == []
