"""Configuration of the local stack (`megatrace stack`): where state lives, ports, timings."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[1]


def default_state_dir() -> str:
    """``$XDG_STATE_HOME/megatrace/stack``, i.e. ``~/.local/state/megatrace/stack`` by default."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "megatrace" / "stack")


@dataclasses.dataclass
class Ports:
    """Loopback ports of the parts; chosen away from the usual 9090/9093/9100 so a real stack can coexist."""

    prometheus: int = 19090
    alertmanager: int = 19093
    node_exporter: int = 19100
    exporter: int = 19450
    alertbot: int = 19451

    def __post_init__(self) -> None:
        for name, port in dataclasses.asdict(self).items():
            if not 1 <= port <= 65535:
                raise ValueError(f"key 'ports.{name}': a port is from 1 to 65535, got {port}")


@dataclasses.dataclass
class AlertGrouping:
    """Alertmanager route timings (short by default: the local stack is for seeing alerts quickly);
    P0 alerts have a sub-route of their own whose first wait is `p0_group_wait`."""

    group_wait: str = "2s"
    p0_group_wait: str = "1s"
    group_interval: str = "10s"
    repeat_interval: str = "4h"


@dataclasses.dataclass
class StackConfig:
    """Everything `megatrace stack up` needs; every field has an embedded default."""

    state_dir: str = dataclasses.field(default_factory=default_state_dir)
    host: str = "127.0.0.1"
    cluster: str = "local"
    ports: Ports = dataclasses.field(default_factory=Ports)
    scrape_interval: str = "5s"
    time_compression: float = 1.0
    rules_dir: str = str(SOURCE_ROOT / "rules")
    trace_dir: str = ""
    sysfs_root: str = "/sys"
    collectors: list[str] = dataclasses.field(default_factory=lambda: ["infiniband", "tracer"])
    alert_grouping: AlertGrouping = dataclasses.field(default_factory=AlertGrouping)
    alertbot_config: str = ""
    start_timeout_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.time_compression <= 0:
            raise ValueError(
                f"key 'time_compression': must be more than 0 (1 is real time), got {self.time_compression}"
            )
        self.state_dir = str(Path(self.state_dir).expanduser().absolute())
        self.trace_dir = str(Path(self.trace_dir or Path(self.state_dir) / "trace").expanduser().absolute())
