"""The operator docs stay true to the code: every setting is in the configuration reference with its
real default, every chart value is documented, and the docs' links lead to files that exist."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from megatrace.alertbot.config import AlertbotConfig
from megatrace.analyzer.layout import LayoutConfig
from megatrace.exporters.settings import schema as exporter_schema
from megatrace.stack_config import StackConfig
from megatrace.tracer.settings import FaultSettings, TraceSettings
from tests.support.helm_chart import bot_configuration, lint_problems, load_schema, render, schema_paths
from tests.support.services import require_binary

DOCS = Path(__file__).resolve().parents[1] / "docs"
REFERENCE = DOCS / "configuration.md"
OPERATOR_DOCS = (
    "README.md",
    "install.md",
    "configuration.md",
    "operations.md",
    "architecture.md",
    "tracer.md",
)
# Defaults computed at run time (paths on this machine); the reference describes them in words.
COMPUTED_DEFAULTS = {"StackConfig": {"state_dir", "rules_dir", "trace_dir"}}


def settings(schema: type, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, default) of every leaf setting of a configuration dataclass."""
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(hints[field.name]):
            yield from settings(hints[field.name], f"{key}.")
        elif field.default is not dataclasses.MISSING:
            yield key, field.default
        else:
            yield key, field.default_factory()  # type: ignore[misc]


def documented_defaults(section: str) -> dict[str, str]:
    """Key → default cell of the tables in one `## section` of the reference."""
    text = REFERENCE.read_text()
    start = text.index(f"\n## {section}")
    end = text.find("\n## ", start + 1)
    rows = {}
    for line in text[start : end if end > 0 else None].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`[^`]+`", cells[0]):
            default = cells[2] if cells[1].startswith("`--") or cells[1] == "—" else cells[1]
            rows[cells[0].strip("`")] = default
    return rows


@pytest.mark.parametrize(
    ("schema", "section"),
    [
        (AlertbotConfig, "Alert bot"),
        (exporter_schema(), "Exporter"),
        (StackConfig, "Local stack"),
    ],
    ids=["alertbot", "exporter", "stack"],
)
def test_every_setting_is_in_the_reference_with_its_default(schema: type, section: str) -> None:
    rows = documented_defaults(section)
    skip = COMPUTED_DEFAULTS.get(schema.__name__, set())
    for key, default in settings(schema):
        assert key in rows, f"{schema.__name__}.{key} is missing from docs/configuration.md"
        if key in skip:
            continue
        cell = rows[key]
        found = re.fullmatch(r"`([^`]*)`", cell)
        assert found, f"{key}: default cell {cell!r} is not one `value`"
        raw = "" if found.group(1) == '""' else found.group(1)
        documented = raw if isinstance(default, str) else yaml.safe_load(raw)
        if isinstance(default, list) and isinstance(documented, str):
            documented = [part.strip() for part in documented.split(",")]
        assert documented == default, f"{key}: documented {documented!r}, code has {default!r}"


def test_every_tracer_variable_is_in_the_reference() -> None:
    rows = documented_defaults("Tracer")
    for prefix, schema in (("MEGATRACE_TRACE_", TraceSettings), ("MEGATRACE_FAULT_", FaultSettings)):
        for key, _default in settings(schema):
            assert f"{prefix}{key.upper()}" in rows, f"{prefix}{key.upper()} is missing"


def test_every_layout_key_is_in_the_reference() -> None:
    text = REFERENCE.read_text()
    for key, _default in settings(LayoutConfig):
        assert f"| `{key}` |" in text, f"layout key {key} is missing"


def test_every_chart_value_is_in_the_reference() -> None:
    text = REFERENCE.read_text()
    schema = load_schema()
    missing = [
        ".".join(path)
        for path in schema_paths(schema, schema["definitions"], follow_refs=False)
        if path != ("global",) and f"`{'.'.join(path)}`" not in text
    ]
    assert missing == []


def test_chart_defaults_in_the_reference_match_values_yaml() -> None:
    values = yaml.safe_load((Path(__file__).resolve().parents[1] / "helm/megatrace/values.yaml").read_text())
    rows = documented_defaults("Helm chart values")
    checked = 0
    for key, cell in rows.items():
        found = re.fullmatch(r"`(.*)`", cell)
        if not found:
            continue
        node = values
        for part in key.split("."):
            node = node[part]
        assert (yaml.safe_load(found.group(1)) if found.group(1) != '""' else "") == node, key
        checked += 1
    assert checked > 80


@pytest.mark.parametrize("name", OPERATOR_DOCS)
def test_links_lead_to_existing_files_and_headings(name: str) -> None:
    path = DOCS / name
    text = path.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        assert linked.exists(), f"{name}: link to missing {target}"
        if anchor and linked.suffix == ".md":
            headings = [
                re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                for line in linked.read_text().splitlines()
                if line.startswith("#")
            ]
            assert anchor in headings, f"{name}: link to missing heading {target}"


def test_native_alertmanager_snippet_in_install_doc_is_valid(tmp_path: Path) -> None:
    """The receiver/route for Alertmanager without the AlertmanagerConfig passes `amtool check-config`."""
    text = (DOCS / "install.md").read_text()
    blocks = [block for block in re.findall(r"```yaml\n(.*?)```", text, re.S) if "webhook_configs" in block]
    assert len(blocks) == 1
    snippet = yaml.safe_load(blocks[0])
    token = tmp_path / "webhook-token"
    token.write_text("t0ken")
    (receiver,) = snippet["receivers"]
    receiver["webhook_configs"][0]["http_config"]["authorization"]["credentials_file"] = str(token)
    config = {
        "route": {"receiver": "default", "routes": snippet["route"]["routes"]},
        "receivers": [{"name": "default"}, receiver],
    }
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    amtool = require_binary("amtool")
    done = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr

    def receivers(*labels: str) -> str:
        argv = [amtool, "config", "routes", "test", f"--config.file={path}", *labels]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout.strip()

    assert receivers("alertname=MegatraceJobStalled", "job=llama", "severity=P0") == "megatrace-alertbot"
    assert receivers("alertname=MegatraceGpuLost", "severity=P3") == "megatrace-alertbot"
    assert receivers("alertname=Watchdog", "severity=none") == "default"


def test_values_example_in_install_doc_installs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The install guide's values file passes lint and the schema, and the bot accepts what it renders."""
    text = (DOCS / "install.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "# megatrace-values.yaml" in b]
    values = yaml.safe_load(block)
    assert lint_problems(values) == []
    objects = render(values)
    config = bot_configuration(
        objects, {"webhook-token": "t", "feishu-app-secret": "s"}, tmp_path, monkeypatch
    )
    assert config.feishu.app.app_id == values["alertbot"]["config"]["feishu"]["app"]["app_id"]
    assert config.feishu.app.app_secret == "s"
