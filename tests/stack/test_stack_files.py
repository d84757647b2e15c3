"""Generated configuration of the local stack: rule compression, Prometheus and Alertmanager files."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from megatrace.config import ConfigError, load_config
from megatrace.stack_config import SOURCE_ROOT, StackConfig
from megatrace.stack_files import (
    alertmanager_config,
    compress_expr,
    compress_seconds_literals,
    duration_seconds,
    prometheus_config,
    write_rules,
)
from tests.support.services import require_binary

RULE_FILE = {
    "groups": [
        {
            "name": "training",
            "rules": [
                {"record": "megatrace:x:rate5m", "expr": "rate(megatrace_tracer_steps_total[5m])"},
                {
                    "alert": "MegatraceRankHang",
                    "expr": "max_over_time(megatrace_tracer_oldest_inflight_seconds[10m:30s]) > 300",
                    "for": "2m",
                    "labels": {"severity": "P0"},
                    "annotations": {"summary": "rank {{ $labels.rank }} hangs"},
                },
            ],
        }
    ]
}


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25)])
def test_duration_seconds(text: str, seconds: float) -> None:
    assert duration_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "5", "m5", "5x", "5m junk"])
def test_bad_duration(text: str) -> None:
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        duration_seconds(text)


def test_compress_expr_windows_and_subqueries() -> None:
    assert compress_expr("rate(x[5m]) / rate(y[1h])", 10, 2) == "rate(x[30s]) / rate(y[360s])"
    assert compress_expr("max_over_time(x[10m:30s])", 10, 2) == "max_over_time(x[60s:3s])"
    assert compress_expr("max_over_time(x[10m:])", 10, 2) == "max_over_time(x[60s:])"
    assert compress_expr("rate(x[10s])", 10, 4) == "rate(x[4s])"
    assert compress_expr('x{le="5m"} > 3', 10, 2) == 'x{le="5m"} > 3'


def test_compress_seconds_literals_divides_only_vector_literals() -> None:
    expr = 'label_replace(vector(600), "kind", "checkpoint", "", "") or clamp_min(4 * x, 10) + vector(7.5)'
    assert compress_seconds_literals(expr, 20) == (
        'label_replace(vector(30), "kind", "checkpoint", "", "") or clamp_min(4 * x, 10) + vector(0.375)'
    )


def _real_rules_config(tmp_path: Path, **extra: object) -> StackConfig:
    """The stack's configuration over the repository's own rules/."""
    overrides = {"state_dir": str(tmp_path / "state"), "rules_dir": str(SOURCE_ROOT / "rules"), **extra}
    return load_config(StackConfig, environ={}, overrides=overrides)


def _training_rules(written: list[Path]) -> dict[str, dict[str, Any]]:
    (training,) = [path for path in written if path.name == "training.yml"]
    groups = yaml.safe_load(training.read_text())["groups"]
    return {
        rule.get("record") or rule["alert"]: {**rule, "group": group}
        for group in groups
        for rule in group["rules"]
    }


def test_compression_divides_the_stall_floor_and_the_pause_thresholds(tmp_path: Path) -> None:
    """The real rules at the demo's settings: the learned threshold's 10 s floor and the pause
    thresholds (600 s, 900 s, 300 s) shrink by the factor like `for:`; the 4 x multiplier and the
    measured op durations do not (they are not times of the rules)."""
    config = _real_rules_config(tmp_path, time_compression=20, scrape_interval="1s")
    written = write_rules(config, tmp_path / "out")
    rules = _training_rules(written)
    assert rules["megatrace:stall_threshold_floor:seconds"]["expr"] == "vector(0.5)"
    pauses = str(rules["megatrace:pause_stall_threshold:seconds"]["expr"])
    for kind, seconds in (("checkpoint", 30), ("eval", 45), ("dataloader", 15)):
        assert f'vector({seconds}), "kind", "{kind}"' in pauses
    assert "4 * max by (job, comm)" in str(rules["megatrace:comm_learned_stall_threshold:seconds"]["expr"])
    assert rules["MegatraceJobHang"]["for"] == rules["MegatraceRankHang"]["for"] == "1s"
    check = subprocess.run(
        [require_binary("promtool"), "check", "rules", *map(str, written)], capture_output=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize(("scrape_interval", "expected"), [("5s", "5s"), ("1s", "1s"), ("15s", "5s")])
def test_training_groups_are_evaluated_at_least_as_often_as_the_stack_scrapes(
    tmp_path: Path, scrape_interval: str, expected: str
) -> None:
    config = _real_rules_config(tmp_path, scrape_interval=scrape_interval)
    rules = _training_rules(write_rules(config, tmp_path / "out"))
    assert rules["MegatraceJobHang"]["group"]["interval"] == expected
    assert rules["MegatraceJobHang"]["for"] == "15s"


def _config(tmp_path: Path, **extra: object) -> StackConfig:
    rules = tmp_path / "rules"
    rules.mkdir(exist_ok=True)
    (rules / "training.yml").write_text(yaml.safe_dump(RULE_FILE))
    return load_config(
        StackConfig,
        environ={},
        overrides={"state_dir": str(tmp_path / "state"), "rules_dir": str(rules), **extra},
    )


def test_rules_copied_unchanged_without_compression(tmp_path: Path) -> None:
    config = _config(tmp_path)
    (written,) = write_rules(config, tmp_path / "out")
    assert yaml.safe_load(written.read_text()) == RULE_FILE


def test_compressed_rules_keep_logic_labels_annotations(tmp_path: Path) -> None:
    config = _config(tmp_path, time_compression=20, scrape_interval="1s")
    (written,) = write_rules(config, tmp_path / "out")
    record, alert = yaml.safe_load(written.read_text())["groups"][0]["rules"]
    assert record["expr"] == "rate(megatrace_tracer_steps_total[15s])"
    assert alert["expr"] == "max_over_time(megatrace_tracer_oldest_inflight_seconds[30s:2s]) > 300"
    assert alert["for"] == "6s"
    assert alert["labels"] == {"severity": "P0"}
    assert alert["annotations"] == RULE_FILE["groups"][0]["rules"][1]["annotations"]
    check = subprocess.run([require_binary("promtool"), "check", "rules", str(written)], capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_generated_prometheus_and_alertmanager_configs_are_valid(tmp_path: Path) -> None:
    config = _config(tmp_path)
    rule_files = write_rules(config, tmp_path / "out")
    prom = tmp_path / "prometheus.yml"
    prom.write_text(yaml.safe_dump(prometheus_config(config, rule_files)))
    result = subprocess.run([require_binary("promtool"), "check", "config", str(prom)], capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr
    scrape = {job["job_name"]: job for job in yaml.safe_load(prom.read_text())["scrape_configs"]}
    assert scrape["megatrace"]["honor_labels"] is True
    assert scrape["megatrace"]["static_configs"][0]["targets"] == ["127.0.0.1:19450"]
    for job in ("megatrace", "node"):  # cards name the machine, not the scrape address
        assert scrape[job]["static_configs"][0]["labels"] == {"node": socket.gethostname()}

    am = alertmanager_config(config, "tok-123456")
    receiver = am["receivers"][0]["webhook_configs"][0]
    assert receiver["url"] == "http://127.0.0.1:19451/alertmanager"
    assert receiver["http_config"]["authorization"] == {"type": "Bearer", "credentials": "tok-123456"}
    assert receiver["send_resolved"] is True
    assert am["route"]["group_wait"] == "2s"
    assert am["route"]["routes"] == [{"matchers": ['severity="P0"'], "group_wait": "1s"}]
    am_file = tmp_path / "alertmanager.yml"
    am_file.write_text(yaml.safe_dump(am))
    amtool = subprocess.run([require_binary("amtool"), "check-config", str(am_file)], capture_output=True)
    assert amtool.returncode == 0, amtool.stdout + amtool.stderr


def test_stack_config_rejects_bad_values(tmp_path: Path) -> None:
    bad = tmp_path / "stack.yaml"
    bad.write_text("ports:\n  prometheus: high\n")
    with pytest.raises(ConfigError, match=r"key 'ports.prometheus'"):
        load_config(StackConfig, bad, environ={})


def test_trace_dir_defaults_into_state_dir(tmp_path: Path) -> None:
    config = load_config(
        StackConfig, environ={"MEGATRACE_STACK_STATE_DIR": str(tmp_path)}, env_prefix="MEGATRACE_STACK_"
    )
    assert config.trace_dir == str(tmp_path / "trace")
