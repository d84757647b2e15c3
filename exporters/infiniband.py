"""InfiniBand/RoCE collector: every HCA port under ``<sysfs>/class/infiniband``, read at scrape time.

Series are ``megatrace_infiniband_*{device,port}`` with node_exporter's names after the prefix where
node_exporter has one (so rules and dashboards move across), RoCE ``hw_counters/`` too (files
node_exporter does not know as ``megatrace_infiniband_hw_<counter>_total``). ``_info`` is per device
with node_exporter's labels; ``_port_info`` adds what node_exporter leaves out (link layer, node GUID).
Files that cannot be read or read ``N/A (no PMA)`` are skipped quietly: that series is simply absent.
Only regular files are read, opened without blocking, so a FIFO planted in the tree cannot hang a
scrape. A sysfs root that cannot be read fails the collector (``collector_up 0``); a readable one
without ``class/infiniband`` has no ports.

Which devices, ports and attribute files exist (and the devices' identity) changes only when hardware
or drivers do, so it is scanned once and again every `RESCAN_SECONDS`; a scrape then only re-reads
the attribute files, each with one ``pread`` at offset 0 on a descriptor held open (sysfs produces
an attribute's current value on every read from offset 0), and writes series whose text was
prepared by the scan.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import resource
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from megatrace.exporters.collector_settings import setting
from megatrace.exporters.families import PREFIX, FixedSeriesFamily, series_text
from megatrace.regular_files import open_regular

if TYPE_CHECKING:
    from megatrace.exporters.settings import ExporterConfig

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

# hw_counters/<file> (mlx5, RoCE) -> name after megatrace_infiniband_, as node_exporter names them
# (collector/infiniband_linux.go, after procfs maps the files to fields); other files: hw_<file>_total.
HW_COUNTERS: dict[str, str] = {
    "duplicate_request": "duplicate_requests_packets_total",
    "implied_nak_seq_err": "implied_nak_seq_errors_total",
    "local_ack_timeout_err": "local_ack_timeout_errors_total",
    "np_cnp_sent": "np_cnp_packets_sent_total",
    "np_ecn_marked_roce_packets": "np_ecn_marked_roce_packets_received_total",
    "out_of_buffer": "out_of_buffer_drops_total",
    "out_of_sequence": "out_of_sequence_packets_received_total",
    "packet_seq_err": "packet_sequence_errors_total",
    "req_cqe_error": "req_cqes_errors_total",
    "req_cqe_flush_error": "req_cqes_flush_errors_total",
    "req_remote_access_errors": "req_remote_access_errors_total",
    "req_remote_invalid_request": "req_remote_invalid_request_errors_total",
    "resp_cqe_error": "resp_cqes_errors_total",
    "resp_cqe_flush_error": "resp_cqes_flush_errors_total",
    "resp_local_length_error": "resp_local_length_errors_total",
    "resp_remote_access_errors": "resp_remote_access_errors_total",
    "rnr_nak_retry_err": "rnr_nak_retry_packets_received_total",
    "roce_adp_retrans": "roce_adp_retransmits_total",
    "roce_adp_retrans_to": "roce_adp_retransmits_timeout_total",
    "roce_slow_restart": "roce_slow_restart_used_total",
    "roce_slow_restart_cnps": "roce_slow_restart_cnps_total",
    "roce_slow_restart_trans": "roce_slow_restart_total",
    "rp_cnp_handled": "rp_cnp_packets_handled_total",
    "rp_cnp_ignored": "rp_cnp_ignored_packets_received_total",
    "rx_atomic_requests": "rx_atomic_requests_total",
    "rx_dct_connect": "rx_dct_connect_requests_total",
    "rx_icrc_encapsulated": "rx_icrc_encapsulated_errors_total",
    "rx_read_requests": "rx_read_requests_total",
    "rx_write_requests": "rx_write_requests_total",
}

# hw_counters/lifespan is a setting, not a counter: how long (ms) the driver caches the values it reads.
HW_LIFESPAN = "lifespan"

_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")
READ_LIMIT = 4096
RESCAN_SECONDS = 30.0
# Descriptors left for everything else in the agent (HTTP connections, tracer files, NVML).
RESERVED_FDS = 256
FAMILY_PREFIX = f"{PREFIX}infiniband_"


def _read_at(directory_fd: int | None, path: str) -> bytes | None:
    try:
        fd = open_regular(path, dir_fd=directory_fd)
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


def parse_counter(data: bytes) -> int | None:
    """A counter's value as the file says it (the guard leaves out a negative one); None when not a number
    (``N/A (no PMA)``)."""
    data = data.strip()
    return int(data) if data.removeprefix(b"-").isdigit() else None


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


def _state_value(data: bytes) -> int | None:
    return parse_state(data.strip().decode("ascii", errors="replace"))


def _rate_value(data: bytes) -> float | None:
    return parse_rate(data.strip().decode("ascii", errors="replace"))


def _milliseconds_as_seconds(data: bytes) -> float | None:
    milliseconds = parse_counter(data)
    return None if milliseconds is None else milliseconds / 1000


def _metric_name(file_name: str) -> str:
    return _NAME_UNSAFE.sub("_", file_name).lower()


def _listing(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _port_number(name: str) -> int:
    return int(name) if name.isdigit() else -1


def _fd_budget() -> int:
    """How many more descriptors a scan may hold: the soft limit less those open and `RESERVED_FDS`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 0
    limit = 1 << 20 if soft == resource.RLIM_INFINITY else soft
    return max(limit - RESERVED_FDS - in_use, 0)


def _close_held(attributes: list[_Attribute]) -> None:
    for attribute in attributes:
        if attribute.fd >= 0:
            os.close(attribute.fd)
            attribute.fd = -1


@dataclasses.dataclass
class _Attribute:
    """One sysfs file read at every scrape, and the series it gives."""

    path: str
    fd: int  # held open; -1 when over the descriptor budget (then opened per read)
    family: int  # index into _Layout.families
    text: str  # exposition text before the value
    labels: dict[str, str]
    parse: Callable[[bytes], float | None]
    scale: int = 1


@dataclasses.dataclass
class _Layout:
    """What one scan found: families (name, help, type), fixed-value series and attributes to read."""

    families: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    constant: list[tuple[int, str, dict[str, str], float]] = dataclasses.field(default_factory=list)
    attributes: list[_Attribute] = dataclasses.field(default_factory=list)
    scanned_at: float = 0.0
    _index: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Held descriptors are closed by `close`, or when the layout is garbage-collected.
        self.close = weakref.finalize(self, _close_held, self.attributes)

    def family(self, name: str, doc: str, typ: str) -> int:
        full = FAMILY_PREFIX + name
        index = self._index.get(full)
        if index is None:
            index = self._index[full] = len(self.families)
            self.families.append((full, doc, typ))
        return index

    def sample_name(self, index: int) -> str:
        name, _, typ = self.families[index]
        return name if typ == "gauge" or name.endswith("_total") else f"{name}_total"


_INFO_HELP = "HCA identity, value 1 (labels as node_exporter's node_infiniband_info)."
_PORT_INFO_HELP = "HCA port identity, value 1; link_layer is InfiniBand, or Ethernet for RoCE."
_LIFESPAN_HELP = "How long the driver caches hw_counters/ values; two reads within it may agree."
_STATE_HELP = "Logical port state (1 down, 2 init, 3 armed, 4 active, 5 active defer)."
_PHYS_STATE_HELP = (
    "Physical port state (2 polling, 3 disabled, 4 port configuration training, 5 link up, "
    "6 link error recovery, 7 phy test)."
)


class _Scanner:
    """Builds a `_Layout` from the tree, holding descriptors up to the budget."""

    def __init__(self, layout: _Layout, budget: int) -> None:
        self.layout = layout
        self.budget = budget

    def attribute(
        self,
        path: Path,
        family: int,
        labels: dict[str, str],
        parse: Callable[[bytes], float | None],
        scale: int = 1,
    ) -> None:
        fd = -1
        if self.budget > 0:
            try:
                fd = open_regular(path)
            except OSError as exc:
                log.debug("skipping %s: %s", path, exc)
                return
            self.budget -= 1
        text = series_text(self.layout.sample_name(family), labels)
        self.layout.attributes.append(_Attribute(str(path), fd, family, text, labels, parse, scale))

    def constant(self, name: str, doc: str, labels: dict[str, str]) -> None:
        """An ``_info``-style series of value 1."""
        family = self.layout.family(name, doc, "gauge")
        self.layout.constant.append(
            (family, series_text(self.layout.sample_name(family), labels), labels, 1.0)
        )

    def port(self, device: str, node_guid: str, port_dir: Path) -> None:
        layout = self.layout
        labels = {"device": device, "port": port_dir.name}
        link_layer = read_text(port_dir / "link_layer") or ""
        self.constant(
            "port_info", _PORT_INFO_HELP, {**labels, "link_layer": link_layer, "node_guid": node_guid}
        )
        self.attribute(
            port_dir / "state", layout.family("state_id", _STATE_HELP, "gauge"), labels, _state_value
        )
        phys = layout.family("physical_state_id", _PHYS_STATE_HELP, "gauge")
        self.attribute(port_dir / "phys_state", phys, labels, _state_value)
        rate = layout.family(
            "rate_bytes_per_second", "Signalling rate of the port, in bytes per second.", "gauge"
        )
        self.attribute(port_dir / "rate", rate, labels, _rate_value)
        self.counters(labels, port_dir / "counters", COUNTERS, "")
        self.counters(labels, port_dir / "counters_ext", LEGACY_COUNTERS, "legacy_")
        hw_dir = port_dir / "hw_counters"
        for name in _listing(hw_dir):
            if name == HW_LIFESPAN:
                lifespan = layout.family("lifespan_seconds", _LIFESPAN_HELP, "gauge")
                self.attribute(hw_dir / name, lifespan, labels, _milliseconds_as_seconds)
                continue
            family = layout.family(
                HW_COUNTERS.get(name, f"hw_{_metric_name(name)}_total"),
                f"Driver hardware counter hw_counters/{name} of the port (RoCE/mlx5).",
                "counter",
            )
            self.attribute(hw_dir / name, family, labels, parse_counter)

    def counters(
        self, labels: dict[str, str], directory: Path, known: dict[str, tuple[str, str]], unknown_prefix: str
    ) -> None:
        for file_name in _listing(directory):
            name, doc = known.get(file_name) or (
                f"{unknown_prefix}{_metric_name(file_name)}_total",
                f"Port counter {directory.name}/{file_name}.",
            )
            family = self.layout.family(name, doc, "counter")
            scale = 4 if file_name in WORD_COUNTERS else 1
            self.attribute(directory / file_name, family, labels, parse_counter, scale)


def _read_once(path: str) -> bytes:
    fd = open_regular(path)
    try:
        return os.read(fd, READ_LIMIT)
    finally:
        os.close(fd)


class InfinibandCollector:
    """Reads every port of every HCA under `sysfs_root`/class/infiniband at each scrape."""

    def __init__(self, sysfs_root: str | Path = "/sys", rescan_seconds: float = RESCAN_SECONDS) -> None:
        self.sysfs_root = Path(sysfs_root)
        self.class_dir = self.sysfs_root / "class" / "infiniband"
        self.rescan_seconds = rescan_seconds
        self._layout: _Layout | None = None
        self._lock = threading.Lock()

    def _scan(self) -> _Layout:
        try:
            os.listdir(self.sysfs_root)
        except OSError as exc:
            raise OSError(f"sysfs root {self.sysfs_root} cannot be read: {exc.strerror or exc}") from None
        layout = _Layout(scanned_at=time.monotonic())
        scanner = _Scanner(layout, _fd_budget())
        for device in _listing(self.class_dir):
            device_dir = self.class_dir / device
            identity = {
                "device": device,
                "board_id": read_text(device_dir / "board_id") or "",
                "firmware_version": read_text(device_dir / "fw_ver") or "",
                "hca_type": read_text(device_dir / "hca_type") or "",
            }
            scanner.constant("info", _INFO_HELP, identity)
            node_guid = read_text(device_dir / "node_guid") or ""
            for port in sorted(_listing(device_dir / "ports"), key=_port_number):
                if _port_number(port) >= 0:
                    scanner.port(device, node_guid, device_dir / "ports" / port)
        return layout

    def collect(self) -> Iterator[FixedSeriesFamily]:
        with self._lock:
            layout = self._layout
            if layout is None or time.monotonic() - layout.scanned_at >= self.rescan_seconds:
                if layout is not None:
                    layout.close()
                layout = self._layout = self._scan()
            families = [FixedSeriesFamily(name, doc, typ) for name, doc, typ in layout.families]
            for family, text, labels, value in layout.constant:
                families[family].series.append((text, labels, value))
            pread = os.pread
            for attribute in layout.attributes:
                try:
                    fd = attribute.fd
                    data = pread(fd, READ_LIMIT, 0) if fd >= 0 else _read_once(attribute.path)
                except OSError as exc:
                    log.debug("skipping %s: %s", attribute.path, exc)
                    continue
                value = attribute.parse(data)
                if value is not None:
                    families[attribute.family].series.append(
                        (attribute.text, attribute.labels, value * attribute.scale)
                    )
        return iter(sorted((f for f in families if f.series), key=lambda f: f.sample_name))

    def close(self) -> None:
        """Let go of the descriptors held on attribute files."""
        with self._lock:
            if self._layout is not None:
                self._layout.close()
                self._layout = None


@dataclasses.dataclass(frozen=True)
class InfinibandSettings:
    """The InfiniBand/RoCE collector's keys."""

    sysfs_root: str = setting("/sys", "sysfs mount point", metavar="DIR")


SETTINGS = InfinibandSettings


def build(settings: InfinibandSettings, agent: ExporterConfig, nvml: object = None) -> InfinibandCollector:
    """The agent's InfiniBand/RoCE collector (`collectors` table entry "infiniband")."""
    return InfinibandCollector(settings.sysfs_root)
