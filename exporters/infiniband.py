"""InfiniBand/RoCE collector: every HCA port under ``<sysfs>/class/infiniband``, read at scrape time.

Series are ``megatrace_infiniband_*{device,port}`` with node_exporter's names after the prefix where
node_exporter has one (so rules and dashboards move across), RoCE ``hw_counters/`` as
``megatrace_infiniband_hw_<counter>_total``. Files that cannot be read or read ``N/A (no PMA)``
are skipped quietly: that series is simply absent.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import Metric

from megatrace.exporters.families import FamilySet

log = logging.getLogger(__name__)

# counters/<file> -> (name after megatrace_infiniband_, help); names as node_exporter's.
COUNTERS: dict[str, tuple[str, str]] = {
    "VL15_dropped": ("vl15_dropped_total", "Subnet management packets dropped for lack of buffers."),
    "excessive_buffer_overrun_errors": (
        "excessive_buffer_overrun_errors_total",
        "Times consecutive flow-control update periods saw a receive buffer overrun.",
    ),
    "link_downed": ("link_downed_total", "Times the link failed to recover from errors and went down."),
    "link_error_recovery": ("link_error_recovery_total", "Times the link recovered from an error state."),
    "local_link_integrity_errors": (
        "local_link_integrity_errors_total",
        "Times the local physical errors exceeded the link's threshold.",
    ),
    "multicast_rcv_packets": ("multicast_packets_received_total", "Multicast packets received."),
    "multicast_xmit_packets": ("multicast_packets_transmitted_total", "Multicast packets sent."),
    "port_rcv_constraint_errors": (
        "port_constraint_errors_received_total",
        "Received packets dropped by partition or raw-packet constraints.",
    ),
    "port_rcv_data": ("port_data_received_bytes_total", "Data received, in bytes (4-byte words x 4)."),
    "port_rcv_discards": ("port_discards_received_total", "Received packets discarded."),
    "port_rcv_errors": ("port_errors_received_total", "Received packets that contained an error."),
    "port_rcv_packets": ("port_packets_received_total", "Packets received, errors included."),
    "port_rcv_remote_physical_errors": (
        "port_receive_remote_physical_errors_total",
        "Received packets marked bad by an upstream physical error.",
    ),
    "port_rcv_switch_relay_errors": (
        "port_receive_switch_relay_errors_total",
        "Received packets the switch could not relay.",
    ),
    "port_xmit_constraint_errors": (
        "port_constraint_errors_transmitted_total",
        "Packets not sent because of partition or raw-packet constraints.",
    ),
    "port_xmit_data": ("port_data_transmitted_bytes_total", "Data sent, in bytes (4-byte words x 4)."),
    "port_xmit_discards": (
        "port_discards_transmitted_total",
        "Outbound packets discarded (port down or congested).",
    ),
    "port_xmit_packets": ("port_packets_transmitted_total", "Packets sent, errors included."),
    "port_xmit_wait": (
        "port_transmit_wait_total",
        "Ticks in which the port had data to send but sent none (congestion).",
    ),
    "symbol_error": ("symbol_error_total", "Minor link errors detected on a physical lane."),
    "unicast_rcv_packets": ("unicast_packets_received_total", "Unicast packets received."),
    "unicast_xmit_packets": ("unicast_packets_transmitted_total", "Unicast packets sent."),
}

# counters_ext/<file> (64-bit counters of kernels before 4.5) -> names as node_exporter's legacy_* ones.
LEGACY_COUNTERS: dict[str, tuple[str, str]] = {
    "port_multicast_rcv_packets": (
        "legacy_multicast_packets_received_total",
        "Multicast packets received (64-bit).",
    ),
    "port_multicast_xmit_packets": (
        "legacy_multicast_packets_transmitted_total",
        "Multicast packets sent (64-bit).",
    ),
    "port_rcv_data_64": ("legacy_data_received_bytes_total", "Data received, in bytes (64-bit, words x 4)."),
    "port_rcv_packets_64": ("legacy_packets_received_total", "Packets received (64-bit)."),
    "port_unicast_rcv_packets": (
        "legacy_unicast_packets_received_total",
        "Unicast packets received (64-bit).",
    ),
    "port_unicast_xmit_packets": (
        "legacy_unicast_packets_transmitted_total",
        "Unicast packets sent (64-bit).",
    ),
    "port_xmit_data_64": ("legacy_data_transmitted_bytes_total", "Data sent, in bytes (64-bit, words x 4)."),
    "port_xmit_packets_64": ("legacy_packets_transmitted_total", "Packets sent (64-bit)."),
}

# Data counters count 4-byte words (per lane); the kernel documents them as "divided by 4".
WORD_COUNTERS = frozenset({"port_rcv_data", "port_xmit_data", "port_rcv_data_64", "port_xmit_data_64"})

# hw_counters/ files that are settings, not counters (lifespan: how long the driver caches the values).
HW_SETTINGS = frozenset({"lifespan"})

_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")
READ_LIMIT = 4096


def _read_at(directory_fd: int | None, path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY, dir_fd=directory_fd)
    except OSError as exc:
        log.debug("skipping %s: %s", path, exc)
        return None
    try:
        return os.read(fd, READ_LIMIT).strip()
    except OSError as exc:
        log.debug("skipping %s: %s", path, exc)
        return None
    finally:
        os.close(fd)


def read_text(path: str | Path) -> str | None:
    """A sysfs attribute's text without the trailing newline; None when it cannot be read."""
    data = _read_at(None, str(path))
    return None if data is None else data.decode("ascii", errors="replace")


def read_directory(path: str | Path) -> list[tuple[str, bytes]]:
    """(name, stripped content) of every readable file in a sysfs directory, sorted by name.

    Files are opened relative to the directory (one path walk for the whole directory); entries that
    cannot be read (EACCES, EINVAL, EISDIR, dangling links, ...) are left out.
    """
    try:
        directory_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    try:
        found = []
        for name in sorted(os.listdir(directory_fd)):
            data = _read_at(directory_fd, name)
            if data is not None:
                found.append((name, data))
        return found
    finally:
        os.close(directory_fd)


def parse_counter(data: bytes) -> int | None:
    """A counter's value; None when not a number (``N/A (no PMA)``)."""
    return int(data) if data.isdigit() else None


def parse_state(text: str | None) -> int | None:
    """The number in ``4: ACTIVE`` / ``5: LinkUp``."""
    if text is None:
        return None
    head, sep, _ = text.partition(":")
    return int(head) if sep and head.strip().isdigit() else None


def parse_rate(text: str | None) -> float | None:
    """Bytes per second from ``400 Gb/sec (4X NDR)`` (1 Gb/s = 125,000,000 bytes/s)."""
    if text is None:
        return None
    value, _, unit = text.partition(" ")
    if not unit.startswith("Gb/sec"):
        return None
    try:
        return float(value) * 125_000_000
    except ValueError:
        return None


def _metric_name(file_name: str) -> str:
    return _NAME_UNSAFE.sub("_", file_name).lower()


def _subdirectories(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _port_number(name: str) -> int:
    return int(name) if name.isdigit() else -1


class InfinibandCollector:
    """Reads every port of every HCA under `sysfs_root`/class/infiniband at each scrape."""

    def __init__(self, sysfs_root: str | Path = "/sys") -> None:
        self.class_dir = Path(sysfs_root) / "class" / "infiniband"

    def collect(self) -> Iterator[Metric]:
        families = FamilySet("infiniband")
        for device in _subdirectories(self.class_dir):
            device_dir = self.class_dir / device
            identity = {
                "board_id": read_text(device_dir / "board_id") or "",
                "firmware_version": read_text(device_dir / "fw_ver") or "",
                "hca_type": read_text(device_dir / "hca_type") or "",
                "node_guid": read_text(device_dir / "node_guid") or "",
            }
            for port in sorted(_subdirectories(device_dir / "ports"), key=_port_number):
                if _port_number(port) >= 0:
                    self._collect_port(families, device, identity, device_dir / "ports" / port)
        return iter(families.families())

    def _collect_port(
        self, families: FamilySet, device: str, identity: dict[str, str], port_dir: Path
    ) -> None:
        labels = {"device": device, "port": port_dir.name}
        link_layer = read_text(port_dir / "link_layer") or ""
        families.gauge(
            "info",
            "HCA port identity; link_layer is InfiniBand, or Ethernet for RoCE.",
            {**labels, **identity, "link_layer": link_layer},
            1.0,
        )
        state = parse_state(read_text(port_dir / "state"))
        if state is not None:
            families.gauge(
                "state_id",
                "Logical port state (1 down, 2 init, 3 armed, 4 active, 5 active defer).",
                labels,
                state,
            )
        phys_state = parse_state(read_text(port_dir / "phys_state"))
        if phys_state is not None:
            families.gauge(
                "physical_state_id",
                "Physical port state (2 polling, 3 disabled, 4 port configuration training, 5 link up, "
                "6 link error recovery, 7 phy test).",
                labels,
                phys_state,
            )
        rate = parse_rate(read_text(port_dir / "rate"))
        if rate is not None:
            families.gauge(
                "rate_bytes_per_second", "Signalling rate of the port, in bytes per second.", labels, rate
            )
        self._counters(families, labels, port_dir / "counters", COUNTERS, "")
        self._counters(families, labels, port_dir / "counters_ext", LEGACY_COUNTERS, "legacy_")
        for name, data in read_directory(port_dir / "hw_counters"):
            value = parse_counter(data)
            if value is not None and name not in HW_SETTINGS:
                families.counter(
                    f"hw_{_metric_name(name)}_total",
                    f"Driver hardware counter hw_counters/{name} of the port (RoCE/mlx5).",
                    labels,
                    value,
                )

    @staticmethod
    def _counters(
        families: FamilySet,
        labels: dict[str, str],
        directory: Path,
        known: dict[str, tuple[str, str]],
        unknown_prefix: str,
    ) -> None:
        for file_name, data in read_directory(directory):
            value = parse_counter(data)
            if value is None:
                continue
            if file_name in WORD_COUNTERS:
                value *= 4
            known_name = known.get(file_name)
            if known_name is None:
                known_name = (
                    f"{unknown_prefix}{_metric_name(file_name)}_total",
                    f"Port counter {directory.name}/{file_name}.",
                )
            families.counter(known_name[0], known_name[1], labels, value)
