"""Card links people can open from a phone: runbook paths joined with the documentation base URL,
Prometheus and Alertmanager links moved onto the configured, reachable URLs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatrace.alertbot.cards import rebase_url, runbook_link
from tests.alertbot.conftest import Bot, alert, config, webhook

T0 = 1_790_000_000.0
RUNBOOK = "docs/runbooks/MegatraceRankHang.md"


def hang(runbook: str = RUNBOOK, generator: str = "http://vm:9090/graph?g0.expr=up%3D%3D0&g0.tab=1") -> dict:
    item = alert(job="llm", rank="3", instance="gpu-7:9450")
    item["annotations"]["runbook_url"] = runbook
    item["generatorURL"] = generator
    return item


def first_card(tmp_path: Path, item: dict[str, Any], **links: str) -> dict[str, Any]:
    bot = Bot(config(tmp_path, links=links))
    bot.receive(webhook(item), T0)
    bot.drain()
    (line,) = bot.console()
    return line["card"]


def buttons(card: dict[str, Any]) -> dict[str, str]:
    return {b["text"]["content"]: b["url"] for b in card["elements"][1]["actions"]}


def body(card: dict[str, Any]) -> str:
    return card["elements"][0]["text"]["content"]


@pytest.mark.parametrize(
    ("url", "base", "expected"),
    [
        (RUNBOOK, "https://git.example.com/megatrace/blob/main/", f"https://git.example.com/megatrace/blob/main/{RUNBOOK}"),
        (RUNBOOK, "https://git.example.com/megatrace/blob/main", f"https://git.example.com/megatrace/blob/main/{RUNBOOK}"),
        (f"/{RUNBOOK}", "https://docs.example.com", f"https://docs.example.com/{RUNBOOK}"),
        (RUNBOOK, "", ""),
        ("https://wiki.example.com/hang", "https://git.example.com/", "https://wiki.example.com/hang"),
        ("https://wiki.example.com/hang", "", "https://wiki.example.com/hang"),
        ("", "https://git.example.com/", ""),
    ],
)  # fmt: skip
def test_runbook_link(url: str, base: str, expected: str) -> None:
    assert runbook_link(url, base) == expected


@pytest.mark.parametrize(
    ("url", "base", "expected"),
    [
        ("http://vm:9090/graph?g0.expr=up&g0.tab=1", "https://prom.example.com",
         "https://prom.example.com/graph?g0.expr=up&g0.tab=1"),
        ("http://vm:9090/prometheus/graph?g0.expr=up", "https://mon.example.com/prom/",
         "https://mon.example.com/prom/graph?g0.expr=up"),
        ("http://vm:9090/graph?g0.expr=up#x", "http://10.0.0.5:30090", "http://10.0.0.5:30090/graph?g0.expr=up#x"),
        ("http://vm:9090/graph?g0.expr=up", "", "http://vm:9090/graph?g0.expr=up"),
        ("", "https://prom.example.com", ""),
    ],
)  # fmt: skip
def test_rebase_url(url: str, base: str, expected: str) -> None:
    assert rebase_url(url, base) == expected


def test_relative_runbook_joined_with_the_configured_base(tmp_path: Path) -> None:
    card = first_card(tmp_path, hang(), runbook_base_url="https://git.example.com/megatrace/blob/main/")
    assert buttons(card)["Runbook"] == f"https://git.example.com/megatrace/blob/main/{RUNBOOK}"
    assert "**Runbook**" not in body(card)


def test_relative_runbook_without_base_is_text_not_a_button(tmp_path: Path) -> None:
    card = first_card(tmp_path, hang())
    assert "Runbook" not in buttons(card)
    assert f"**Runbook**: `{RUNBOOK}`" in body(card)
    assert all(url.startswith("http") for url in buttons(card).values())


def test_absolute_runbook_passes_through(tmp_path: Path) -> None:
    card = first_card(
        tmp_path, hang("https://wiki.example.com/hang"), runbook_base_url="https://git.example.com/"
    )
    assert buttons(card)["Runbook"] == "https://wiki.example.com/hang"
    assert "**Runbook**" not in body(card)


def test_prometheus_link_moved_onto_the_configured_url(tmp_path: Path) -> None:
    card = first_card(tmp_path, hang(), prometheus_url="https://prom.example.com/prom")
    assert buttons(card)["Prometheus"] == "https://prom.example.com/prom/graph?g0.expr=up%3D%3D0&g0.tab=1"


def test_prometheus_link_kept_when_no_url_is_configured(tmp_path: Path) -> None:
    card = first_card(tmp_path, hang())
    assert buttons(card)["Prometheus"] == "http://vm:9090/graph?g0.expr=up%3D%3D0&g0.tab=1"


def test_silence_link_uses_the_configured_alertmanager(tmp_path: Path) -> None:
    configured = buttons(first_card(tmp_path / "a", hang(), alertmanager_url="https://am.example.com/am/"))
    assert configured["Silence"].startswith("https://am.example.com/am/#/silences/new?filter=%7B")
    assert "job%3D%22llm%22" in configured["Silence"]
    fallback = buttons(first_card(tmp_path / "b", hang()))
    assert fallback["Silence"].startswith("http://alertmanager.example:9093/#/silences/new?filter=")


def test_storm_card_links_follow_the_same_rules(tmp_path: Path) -> None:
    bot = Bot(
        config(
            tmp_path,
            dedupe={"storm_threshold": 1, "storm_hold_s": 0},
            links={"prometheus_url": "https://prom.example.com"},
        )
    )
    items = []
    for i in range(4):
        item = hang()
        item["labels"] = {**item["labels"], "job": f"llm-{i}"}  # one incident each
        item["fingerprint"] = f"fp{i}"
        items.append(item)
    bot.receive(webhook(*items), T0)
    bot.drain()
    storm = bot.console()[-1]["card"]
    assert storm["header"]["title"]["content"].startswith("[P0] STORM")
    assert buttons(storm)["Prometheus"].startswith("https://prom.example.com/graph?")
    assert "Runbook" not in buttons(storm) and f"**Runbook**: `{RUNBOOK}`" in body(storm)
