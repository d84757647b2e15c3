"""The alerting and recording rules in `rules/`: promtool accepts them, every alert is graded, explains
itself, has a runbook and a reference entry, and has promtool unit tests that fire it and near-miss it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.services import require_binary

ROOT = Path(__file__).resolve().parents[1]
RULES_DIR = ROOT / "rules"
RULE_TESTS_DIR = ROOT / "tests" / "rules"
RUNBOOKS_DIR = ROOT / "docs" / "runbooks"
RULE_FILES = sorted(RULES_DIR.glob("*.yml"))
RULE_TEST_FILES = sorted(RULE_TESTS_DIR.glob("*_test.yml"))
SEVERITIES = {"P0", "P1", "P2", "P3"}

# What each domain's descriptions must name, as template labels, so that a reader knows where to look.
NAMED_IN_DESCRIPTION = {
    "training.yml": ["job"],
    "gpu.yml": ["instance", "gpu"],
    "infiniband.yml": ["instance", "device", "port"],
    "node.yml": [],
}


def alert_rules() -> list[tuple[str, dict[str, Any]]]:
    """(rule file name, rule) for every alerting rule."""
    found = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            found.extend((path.name, rule) for rule in group["rules"] if "alert" in rule)
    return found


def recording_rules() -> list[dict[str, Any]]:
    rules = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules.extend(rule for rule in group["rules"] if "record" in rule)
    return rules


def unit_tests() -> list[dict[str, Any]]:
    """Every test entry of every promtool test file."""
    return [test for path in RULE_TEST_FILES for test in yaml.safe_load(path.read_text())["tests"]]


def alert_ids() -> list[str]:
    rules = alert_rules()
    return [f"{rule['alert']}-{rule['labels']['severity']}-{index}" for index, (_, rule) in enumerate(rules)]


def test_rule_files_cover_every_domain() -> None:
    assert [path.name for path in RULE_FILES] == ["gpu.yml", "infiniband.yml", "node.yml", "training.yml"]


def test_promtool_check_rules_is_clean() -> None:
    promtool = require_binary("promtool")
    result = subprocess.run(
        [promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True, timeout=60
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output.upper(), output


@pytest.mark.parametrize("test_file", RULE_TEST_FILES, ids=lambda path: path.name)
def test_promtool_unit_tests_pass(test_file: Path) -> None:
    promtool = require_binary("promtool")
    result = subprocess.run(
        [promtool, "test", "rules", test_file.name],
        cwd=RULE_TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def reads(expr: str, series: str) -> bool:
    """Whether a PromQL expression uses the series (a whole name, not a prefix of a longer one)."""
    return re.search(rf"(?<![\w:]){re.escape(series)}(?![\w:])", expr) is not None


@pytest.mark.parametrize("test_file", RULE_TEST_FILES, ids=lambda path: path.name)
def test_groups_that_record_are_evaluated_before_the_groups_that_read_them(test_file: Path) -> None:
    """promtool evaluates groups in a random order unless `group_eval_order` fixes one, so a rule that
    reads a series recorded in another group would see it one evaluation late, or not, by chance."""
    spec = yaml.safe_load(test_file.read_text())
    groups = [
        group
        for name in spec["rule_files"]
        for group in yaml.safe_load((RULE_TESTS_DIR / name).read_text())["groups"]
    ]
    recorded_in = {
        rule["record"]: group["name"] for group in groups for rule in group["rules"] if "record" in rule
    }
    position = {name: index for index, name in enumerate(spec.get("group_eval_order", []))}
    for group in groups:
        for rule in group["rules"]:
            for series, source in recorded_in.items():
                if source != group["name"] and reads(rule["expr"], series):
                    where = f"{test_file.name}: {rule.get('alert') or rule['record']} reads {series}"
                    assert position.get(source, len(position)) < position.get(group["name"], -1), where


def test_every_rule_file_has_a_unit_test_file() -> None:
    tested = set()
    for path in RULE_TEST_FILES:
        tested.update(Path(name).name for name in yaml.safe_load(path.read_text())["rule_files"])
    assert tested == {path.name for path in RULE_FILES}


@pytest.mark.parametrize(("file_name", "rule"), alert_rules(), ids=alert_ids())
def test_alert_is_graded_and_explains_itself(file_name: str, rule: dict[str, Any]) -> None:
    name = rule["alert"]
    assert re.fullmatch(r"Megatrace[A-Z][A-Za-z0-9]+", name)
    assert rule["labels"]["severity"] in SEVERITIES
    annotations = rule["annotations"]
    assert set(annotations) >= {"summary", "description", "runbook_url"}
    assert annotations["runbook_url"] == f"docs/runbooks/{name}.md"
    assert (ROOT / annotations["runbook_url"]).is_file()
    where = r"\$labels\.(instance|node|job)\b"
    assert re.search(where, annotations["summary"]), "the summary must say where"
    for label in NAMED_IN_DESCRIPTION[file_name]:
        assert f"$labels.{label} " in annotations["description"], f"description must name the {label}"


@pytest.mark.parametrize(("file_name", "rule"), alert_rules(), ids=alert_ids())
def test_alert_has_a_firing_test_and_a_near_miss(file_name: str, rule: dict[str, Any]) -> None:
    name = rule["alert"]
    static_labels = rule["labels"]
    fired = near_missed = False
    for test in unit_tests():
        checks = [check for check in test.get("alert_rule_test", []) if check["alertname"] == name]
        for check in checks:
            for alert in check["exp_alerts"]:
                labels = alert["exp_labels"]
                if all(labels.get(key) == value for key, value in static_labels.items()):
                    fired = True
                    assert alert["exp_annotations"]["runbook_url"] == rule["annotations"]["runbook_url"]
        if checks and all(not check["exp_alerts"] for check in checks):
            near_missed = True
    assert fired, f"no promtool test expects {name} with labels {static_labels} to fire"
    assert near_missed, f"no promtool test is a near miss of {name}"


def test_recording_rules_follow_the_naming_convention() -> None:
    names = [rule["record"] for rule in recording_rules()]
    assert names, "the slow-rank alert needs its recording rules"
    for name in names:
        assert re.fullmatch(r"megatrace:[a-z0-9_]+:[a-z0-9_]+", name), name
    assert len(names) == len(set(names))


def test_time_literals_are_written_where_time_compression_finds_them() -> None:
    """A time in seconds inside an expression is written `vector(N)`, only in recording rules of seconds:
    the local stack's time compression divides exactly those (core/stack_files.py, docs/alerts.md)."""
    literals = []
    for rule in recording_rules():
        if "vector(" in rule["expr"]:
            assert rule["record"].endswith(":seconds"), rule["record"]
            literals += re.findall(r"vector\(([0-9.]+)\)", rule["expr"])
    for _, rule in alert_rules():
        assert "vector(" not in rule["expr"], rule["alert"]
    assert sorted(literals, key=float) == ["10", "300", "600", "900"]


def test_hang_alerts_wait_briefly_in_groups_evaluated_every_5_seconds() -> None:
    """The time-to-page budget of docs/alerts.md: the training groups run every 5 s, the hang alerts'
    `for:` is at most 15 s."""
    groups = yaml.safe_load((RULES_DIR / "training.yml").read_text())["groups"]
    assert {group["name"]: group.get("interval") for group in groups} == {
        "megatrace-training-recording": "5s",
        "megatrace-training-culprits": "5s",
        "megatrace-training": "5s",
    }
    hang = [rule for group in groups for rule in group["rules"] if rule.get("alert", "").endswith("Hang")]
    assert {rule["alert"]: rule["for"] for rule in hang} == {
        "MegatraceJobHang": "15s",
        "MegatraceRankHang": "15s",
    }


def test_every_runbook_belongs_to_an_alert() -> None:
    alerts = {rule["alert"] for _, rule in alert_rules()}
    runbooks = {path.stem for path in RUNBOOKS_DIR.glob("*.md")}
    assert runbooks == alerts


@pytest.mark.parametrize("name", sorted({rule["alert"] for _, rule in alert_rules()}))
def test_runbook_says_what_it_means_how_to_confirm_and_what_to_do(name: str) -> None:
    text = (RUNBOOKS_DIR / f"{name}.md").read_text()
    assert text.startswith(f"# {name}\n")
    for heading in ("## What it means", "## How to confirm", "## What to do"):
        assert heading in text, f"{name}.md lacks {heading!r}"


def test_alert_reference_lists_every_alert_with_its_level() -> None:
    reference = (ROOT / "docs" / "alerts.md").read_text()
    rows = {}
    for line in reference.splitlines():
        match = re.match(r"\| `(Megatrace\w+)` \| (P[0-3](?:/P[0-3])?) \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    levels: dict[str, set[str]] = {}
    for _, rule in alert_rules():
        levels.setdefault(rule["alert"], set()).add(rule["labels"]["severity"])
    assert set(rows) == set(levels)
    for name, severities in levels.items():
        assert set(rows[name].split("/")) == severities, name
