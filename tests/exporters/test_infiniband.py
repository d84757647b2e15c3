"""InfiniBand/RoCE collector on fixture sysfs trees laid out as the kernel lays them out.

`node_exporter` and `procfs` are the ``class/infiniband`` trees of node_exporter's and procfs' own test
fixtures (tests/fixtures/sysfs/README.md says where from); procfs' mlx5_0 carries ``hw_counters/``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import requests

from megatrace.exporters import infiniband
from megatrace.exporters.infiniband import InfinibandCollector, parse_rate, parse_state
from tests.exporters.exposition import promtool_check, render, samples, value
from tests.support.services import free_port, require_binary, running

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"
PORT_DIR = "devices/pci0000:00/0000:00:02.0/0000:3b:00.0/infiniband/mlx5_0/ports/1"


FIXTURE_TREES = ["infiniband", "roce", "node_exporter", "procfs"]


@pytest.mark.parametrize("fixture", FIXTURE_TREES)
def test_whole_exposition_matches_expected_file(fixture: str) -> None:
    text = render(InfinibandCollector(FIXTURES / fixture))
    assert text == (FIXTURES / f"{fixture}.prom").read_text()


@pytest.mark.parametrize("fixture", FIXTURE_TREES)
def test_promtool_accepts_the_exposition(fixture: str) -> None:
    result = promtool_check(render(InfinibandCollector(FIXTURES / fixture)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == b""


def test_data_counters_are_words_times_four_and_na_is_skipped() -> None:
    text = render(InfinibandCollector(FIXTURES / "infiniband"))
    ib = "megatrace_infiniband_"
    received = value(text, ib + "port_data_received_bytes_total", device="mlx5_0", port="1")
    assert received == 1217340391482 * 4
    legacy = value(text, ib + "legacy_data_transmitted_bytes_total", device="mlx4_0", port="1")
    assert legacy == 38574914832 * 4
    down_port = {("device", "mlx4_0"), ("port", "2")}
    names_on_down_port = {name for name, labels in samples(text) if down_port <= set(labels)}
    # port_xmit_wait and the unicast/multicast counters read "N/A (no PMA)" on the down port
    assert "megatrace_infiniband_port_transmit_wait_total" not in names_on_down_port
    assert "megatrace_infiniband_unicast_packets_received_total" not in names_on_down_port
    assert "megatrace_infiniband_legacy_data_received_bytes_total" not in names_on_down_port
    assert value(text, "megatrace_infiniband_state_id", device="mlx4_0", port="2") == 1
    assert value(text, "megatrace_infiniband_physical_state_id", device="mlx4_0", port="2") == 2


def test_roce_port_has_hw_counters_and_ethernet_link_layer() -> None:
    text = render(InfinibandCollector(FIXTURES / "roce"))
    assert value(text, "megatrace_infiniband_np_cnp_packets_sent_total", device="mlx5_2", port="1") == 891234
    assert value(text, "megatrace_infiniband_out_of_buffer_drops_total", device="mlx5_2", port="1") == 2231
    assert (
        value(text, "megatrace_infiniband_port_info", device="mlx5_2", port="1", link_layer="Ethernet") == 1
    )
    # lifespan is a setting in milliseconds (how long the driver caches counters), not a counter
    assert value(text, "megatrace_infiniband_lifespan_seconds", device="mlx5_2", port="1") == 0.01
    assert not any(name.startswith("megatrace_infiniband_hw_lifespan") for name, _ in samples(text))
    assert value(text, "megatrace_infiniband_rate_bytes_per_second", device="mlx5_2", port="1") == 12.5e9


def test_unreadable_files_are_skipped_quietly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "sys"
    shutil.copytree(FIXTURES / "infiniband", root, symlinks=True)
    port = root / PORT_DIR
    (port / "counters" / "symbol_error").unlink()
    (port / "counters" / "symbol_error").mkdir()  # read() fails with EISDIR, even for root
    (port / "counters" / "link_downed").unlink()
    (port / "counters" / "link_downed").symlink_to("gone")  # ENOENT
    (port / "rate").unlink()
    (port / "rate").mkdir()
    (port / "hw_counters" / "out_of_buffer").write_text("N/A (no PMA)\n")
    caplog.set_level(logging.INFO)

    text = render(InfinibandCollector(root))

    got = samples(text)
    expected = samples((FIXTURES / "infiniband.prom").read_text())
    port_labels = (("device", "mlx5_0"), ("port", "1"))
    missing = {name for name, labels in set(expected) - set(got)}
    assert missing == {
        "megatrace_infiniband_symbol_error_total",
        "megatrace_infiniband_link_downed_total",
        "megatrace_infiniband_rate_bytes_per_second",
        "megatrace_infiniband_out_of_buffer_drops_total",
    }
    assert all(labels == port_labels for name, labels in set(expected) - set(got))
    assert set(got) <= set(expected)
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


def test_each_scrape_rereads_values_and_a_rescan_finds_new_ports(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    shutil.copytree(FIXTURES / "infiniband", root, symlinks=True)
    port = root / PORT_DIR
    collector = InfinibandCollector(root, rescan_seconds=3600)
    received = "megatrace_infiniband_port_data_received_bytes_total"
    assert value(render(collector), received, device="mlx5_0", port="1") == 1217340391482 * 4
    (port / "counters" / "port_rcv_data").write_text("1217340391500\n")  # same file, new content
    (port / "state").write_text("1: DOWN\n")
    text = render(collector)
    assert value(text, received, device="mlx5_0", port="1") == 1217340391500 * 4
    assert value(text, "megatrace_infiniband_state_id", device="mlx5_0", port="1") == 1

    # a second port appears: seen once the layout is rescanned, not before
    shutil.copytree(port, port.parent / "2")
    new_port = {("device", "mlx5_0"), ("port", "2")}
    assert not [labels for _, labels in samples(render(collector)) if new_port <= set(labels)]
    collector.rescan_seconds = 0
    assert value(render(collector), received, device="mlx5_0", port="2") == 1217340391500 * 4
    collector.close()


def test_without_descriptors_to_spare_files_are_opened_per_scrape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(infiniband, "_fd_budget", lambda: 0)
    root = tmp_path / "sys"
    shutil.copytree(FIXTURES / "roce", root, symlinks=True)
    collector = InfinibandCollector(root)
    assert render(collector) == (FIXTURES / "roce.prom").read_text()
    assert all(attribute.fd == -1 for attribute in collector._layout.attributes)


def test_no_infiniband_class_means_no_series(tmp_path: Path) -> None:
    assert samples(render(InfinibandCollector(tmp_path))) == {}


def test_parsers() -> None:
    assert parse_state("4: ACTIVE") == 4
    assert parse_state("5: LinkUp") == 5
    assert parse_state("ACTIVE") is None
    assert parse_state(None) is None
    assert parse_rate("400 Gb/sec (4X NDR)") == 50e9
    assert parse_rate("2.5 Gb/sec (1X SDR)") == 312_500_000
    assert parse_rate("fast") is None


def test_info_is_per_device_with_node_exporters_labels_and_port_info_per_port() -> None:
    text = render(InfinibandCollector(FIXTURES / "infiniband"))
    infos = {labels for name, labels in samples(text) if name == "megatrace_infiniband_info"}
    assert {dict(labels)["device"] for labels in infos} == {"mlx4_0", "mlx5_0"}
    assert {tuple(key for key, _ in labels) for labels in infos} == {
        ("board_id", "device", "firmware_version", "hca_type")
    }
    ports = {labels for name, labels in samples(text) if name == "megatrace_infiniband_port_info"}
    assert {(dict(labels)["device"], dict(labels)["port"]) for labels in ports} == {
        ("mlx4_0", "1"),
        ("mlx4_0", "2"),
        ("mlx5_0", "1"),
    }
    guid = (FIXTURES / "infiniband/class/infiniband/mlx4_0/node_guid").read_text().strip()
    assert value(text, "megatrace_infiniband_port_info", device="mlx4_0", port="2", node_guid=guid) == 1


def _node_exporter_hw_names() -> dict[str, str]:
    lines = (FIXTURES / "node_exporter_hw_names.tsv").read_text().splitlines()
    return dict(line.split("\t") for line in lines if line and not line.startswith("#"))


@pytest.mark.parametrize(
    ("fixture", "device"), [("procfs", "mlx5_0"), ("roce", "mlx5_2")], ids=["procfs-mlx5", "roce"]
)
def test_hw_counters_carry_node_exporters_names(fixture: str, device: str) -> None:
    """Each hw_counters/ file node_exporter's current source knows is ours under the name it gives it."""
    names = _node_exporter_hw_names()
    ours = samples(render(InfinibandCollector(FIXTURES / fixture)))
    hw_dir = next((FIXTURES / fixture).glob(f"**/infiniband/{device}/ports/1/hw_counters"))
    known = sorted(f.name for f in hw_dir.iterdir() if f.name in names)
    assert len(known) > 20
    for file in known:
        raw = int((hw_dir / file).read_text())
        want = raw / 1000 if file == "lifespan" else raw
        got = ours.get((f"megatrace_infiniband_{names[file]}", (("device", device), ("port", "1"))))
        assert got == want, file


def _only_ours(name: str) -> bool:
    """Series node_exporter 1.5 (Debian's) does not have: port identity, hw_counters/ (newer releases)."""
    hw_names = {f"megatrace_infiniband_{n}" for n in infiniband.HW_COUNTERS.values()}
    return (
        name in hw_names
        or name.startswith("megatrace_infiniband_hw_")
        or name in {"megatrace_infiniband_port_info", "megatrace_infiniband_lifespan_seconds"}
    )


@pytest.mark.slow
@pytest.mark.parametrize("fixture", FIXTURE_TREES)
def test_same_series_as_node_exporter(fixture: str, tmp_path: Path) -> None:
    """node_exporter's node_infiniband_* series on the same tree are exactly ours as megatrace_infiniband_*.

    Besides them we have only the series `_only_ours` names.
    """
    port = free_port()
    argv = [
        require_binary("prometheus-node-exporter"),
        f"--path.sysfs={FIXTURES / fixture}",
        "--collector.disable-defaults",
        "--collector.infiniband",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    url = f"http://127.0.0.1:{port}/metrics"
    with running(argv, url, tmp_path / "node_exporter.log"):
        exposition = requests.get(url, timeout=10).text
    theirs = {
        ("megatrace_" + name.removeprefix("node_"), labels): their_value
        for (name, labels), their_value in samples(exposition).items()
        if name.startswith("node_infiniband_")
    }
    assert value(exposition, "node_scrape_collector_success", collector="infiniband") == 1
    ours = samples(render(InfinibandCollector(FIXTURES / fixture)))
    assert {key: ours.get(key) for key in theirs} == theirs
    assert {name for name, _ in set(ours) - set(theirs) if not _only_ours(name)} == set()
    assert len(theirs) > 15
