"""A collector with a setting is one file plus one table row: tests/exporters/spool_collector.py,
added to the collectors table here, gets its key in the YAML file and the environment, its flag, its
check, its place on /metrics of the running agent, and its metrics checked against the reference."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import requests

from megatrace.cli import build_parser
from megatrace.config import ConfigError
from megatrace.exporters import cli as exporter_cli
from megatrace.exporters.collector_settings import declared_keys, setting
from megatrace.exporters.collectors import COLLECTORS, CollectorEntry
from megatrace.exporters.settings import ExporterConfig, load
from tests.exporters import spool_collector
from tests.exporters.test_metrics_doc import ROOT, everything_exported, undocumented
from tests.support.services import free_port

DOC_ROW = "| `megatrace_spool_files` | gauge | | files | files waiting in the spool folder |\n"


@dataclasses.dataclass(frozen=True)
class OtherTraceDir:
    """Settings declaring the tracer's `trace_dir` with another default."""

    trace_dir: str = setting("/srv/traces", "another folder of trace files")


@dataclasses.dataclass(frozen=True)
class ListenSettings:
    """Settings declaring a key of the agent's own."""

    listen: str = setting("127.0.0.1:1", "a second address")


def this_module_as_collector(monkeypatch: pytest.MonkeyPatch, name: str, settings: type) -> None:
    """A table row `name` whose module is this one, with `settings` as its SETTINGS."""
    monkeypatch.setattr(sys.modules[__name__], "SETTINGS", settings, raising=False)
    monkeypatch.setitem(COLLECTORS, name, CollectorEntry(__name__, False, "a collector only in name"))


@pytest.fixture
def spool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The spool collector's row in the table, and a spool folder holding three files."""
    monkeypatch.setitem(COLLECTORS, "spool", spool_collector.ROW)
    folder = tmp_path / "spool"
    folder.mkdir()
    for name in ("a.job", "b.job", "c.job"):
        (folder / name).write_text("waiting\n")
    (folder / "sub").mkdir()
    return folder


def parse_exporter_flags(*flags: str) -> ExporterConfig:
    """The configuration `megatrace exporter FLAGS…` would run with (no file, no environment)."""
    args = build_parser(["exporter"]).parse_args(["exporter", *flags])
    return load(args.config, exporter_cli.overrides(args), environ={})


def serve_once(config: ExporterConfig) -> str:
    """Run the agent (`megatrace exporter`'s own `run`) until one scrape of /metrics succeeded; the
    scraped text."""
    scraped: list[str] = []
    done = threading.Event()
    url = f"http://{config.listen}/metrics"

    def scrape_then_stop() -> None:
        while not done.is_set():
            try:
                response = requests.get(url, timeout=5)
            except requests.ConnectionError:
                done.wait(0.05)
                continue
            scraped.append(response.text)
            # The agent answers only once serve_forever runs, after its SIGTERM handler is installed.
            os.kill(os.getpid(), signal.SIGTERM)
            return

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    scraper = threading.Thread(target=scrape_then_stop, daemon=True)
    scraper.start()
    try:
        assert exporter_cli.run(config) == 0
    finally:
        done.set()
        scraper.join()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return scraped[0]


def test_the_row_brings_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="key 'spool_dir': unknown key"):
        load(None, {"spool_dir": str(tmp_path)}, environ={})
    monkeypatch.setitem(COLLECTORS, "spool", spool_collector.ROW)
    assert load(None, {"spool_dir": str(tmp_path)}, environ={}).settings("spool").spool_dir == str(tmp_path)
    assert declared_keys()["spool_dir"].collectors == ("spool",)


def test_enabled_by_flags_and_served_on_metrics(spool: Path) -> None:
    listen = f"127.0.0.1:{free_port()}"
    config = parse_exporter_flags("--listen", listen, "--collectors", "spool", "--spool-dir", str(spool))
    assert config.collectors == ["spool"]
    text = serve_once(config)
    assert "\nmegatrace_spool_files 3.0\n" in text
    assert 'megatrace_exporter_collector_up{collector="spool"} 1.0' in text


def test_setting_from_yaml_and_environment(spool: Path, tmp_path: Path) -> None:
    path = tmp_path / "exporter.yaml"
    path.write_text(f"collectors: [tracer, spool]\nspool_dir: {spool}\ntrace_dir: {tmp_path}\n")
    from_file = load(path, {}, environ={})
    assert from_file.collectors == ["tracer", "spool"]
    assert from_file.settings("spool") == spool_collector.SpoolSettings(spool_dir=str(spool))
    assert from_file.settings("tracer").trace_dir == str(tmp_path)
    from_env = load(
        None,
        {},
        environ={"MEGATRACE_EXPORTER_COLLECTORS": "spool", "MEGATRACE_EXPORTER_SPOOL_DIR": "/var/spool/0123"},
    )
    assert from_env.settings("spool").spool_dir == "/var/spool/0123"
    flag_wins = parse_exporter_flags("--config", str(path), "--spool-dir", "/elsewhere")
    assert flag_wins.settings("spool").spool_dir == "/elsewhere"


def test_its_own_check_names_its_key(spool: Path) -> None:
    with pytest.raises(ConfigError, match="key 'spool_dir': the spool collector needs a folder"):
        parse_exporter_flags("--collectors", "gpu,spool")
    assert parse_exporter_flags("--collectors", "gpu").settings("spool").spool_dir == ""


def test_its_metrics_are_checked_against_the_reference(spool: Path, tmp_path: Path) -> None:
    exported = everything_exported(tmp_path, {"spool_dir": str(spool)})
    reference = (ROOT / "docs" / "metrics.md").read_text()
    assert undocumented(exported, reference) == ["megatrace_spool_files"]
    assert undocumented(exported, reference + DOC_ROW) == []


def test_a_key_declared_twice_differently_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    this_module_as_collector(monkeypatch, "other", OtherTraceDir)
    with pytest.raises(
        TypeError, match="collectors tracer and other both declare key 'trace_dir', differently"
    ):
        declared_keys()


def test_a_collector_may_not_take_an_agent_key(monkeypatch: pytest.MonkeyPatch) -> None:
    this_module_as_collector(monkeypatch, "greedy", ListenSettings)
    with pytest.raises(TypeError, match="collector greedy: key 'listen' is one of the agent's own"):
        load(None, {}, environ={})
