"""The Helm chart as tests see it: rendered offline with Helm's own library (helm-python-sdk), linted,
its values schema, and the alert bot's view of the configuration the chart gives it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from megatrace.alertbot.config import ENV_PREFIX as ALERTBOT_ENV_PREFIX
from megatrace.alertbot.config import load as load_alertbot_config

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "megatrace"
RELEASE = "mt"
NAMESPACE = "monitoring"


def objects_of(manifests: dict[str, str]) -> list[dict[str, Any]]:
    """The Kubernetes objects in rendered manifests (NOTES.txt is text for the user, not an object)."""
    objects = []
    for path, text in sorted(manifests.items()):
        if not path.endswith("NOTES.txt"):
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's objects as `helm template` would print them, values checked against the schema."""
    with helm_python.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        return objects_of(chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True))


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [obj for obj in objects if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == kind]


def by_component(objects: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    found = [
        obj
        for obj in of_kind(objects, kind)
        if obj["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, f"expected one {kind} of {component}, found {len(found)}"
    return found[0]


def lint_problems(values: dict[str, Any] | None = None) -> list[str]:
    report = helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    problems = [f"{msg['path']}: {msg['error']}" for msg in report["messages"] if msg["severity"] >= 2]
    return problems + list(report["errors"])


def schema_paths(
    schema: dict[str, Any], definitions: dict[str, Any], follow_refs: bool, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """Key paths the schema names properties for (inside shared definitions too when `follow_refs`)."""
    if "$ref" in schema:
        if not follow_refs:
            return
        schema = definitions[schema["$ref"].rsplit("/", 1)[1]]
    for key, sub in schema.get("properties", {}).items():
        yield (*prefix, key)
        yield from schema_paths(sub, definitions, follow_refs, (*prefix, key))


def load_schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


def bot_configuration(
    objects: list[dict[str, Any]], secret: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Any:
    """Load the rendered config file and environment exactly as the bot in the pod does."""
    config_map = by_component(objects, "ConfigMap", "alertbot")
    path = tmp_path / "alertbot.yaml"
    path.write_text(config_map["data"]["alertbot.yaml"])
    for name in list(os.environ):
        if name.startswith(ALERTBOT_ENV_PREFIX):
            monkeypatch.delenv(name)
    for item in only(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]:
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref is None:
            monkeypatch.setenv(item["name"], item["value"])
        elif ref["key"] in secret:
            monkeypatch.setenv(item["name"], secret[ref["key"]])
    return load_alertbot_config(path)
