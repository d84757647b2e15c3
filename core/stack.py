"""The local stack: node agent, node_exporter, Prometheus, Alertmanager and the alert bot as local processes.

`up` generates every configuration into the state directory, starts the parts in dependency order,
waits until each answers its health URL from a socket the process it started holds (not another
stack's process on the same port), and records what it started (pid, command line) in
``stack.json``; `down` stops exactly the processes recorded there whose command line still matches;
`status` tells for each part whether it runs and answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import requests
import yaml

from megatrace.config import ConfigError
from megatrace.stack_config import StackConfig
from megatrace.stack_files import alertmanager_config, prometheus_config, write_rules

STATE_FILE = "stack.json"


class StackError(RuntimeError):
    """A part of the stack could not be started or is not healthy; the message says which and why."""


@dataclasses.dataclass
class Part:
    """One process of the stack."""

    name: str
    argv: list[str]
    health_url: str
    url: str
    port: int


@dataclasses.dataclass
class Running:
    """A started part as recorded in the state file."""

    name: str
    pid: int
    argv: list[str]
    health_url: str
    url: str
    log: str
    port: int = 0  # the port it serves on (0 in state files from before it was recorded)


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise StackError(f"{name} is not installed (Debian package providing it; `make test` installs it)")
    return path


def _megatrace_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatrace.cli", *args]


LOCAL_VERDICT_WAIT_S = 60.0


def alertbot_settings(config: StackConfig, state: Path, webhook_token: str) -> dict:
    """The bot's configuration: the user's file (if any) with the stack's listen address, store and URLs.

    Without Feishu in the user's file the bot writes every message it would send to
    ``<state>/messages.jsonl`` (its console channel).
    """
    settings: dict = {}
    if config.alertbot_config:
        loaded = yaml.safe_load(Path(config.alertbot_config).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{config.alertbot_config}: expected a mapping at the top level")
        settings = loaded
    prometheus = f"http://{config.host}:{config.ports.prometheus}"
    alertmanager = f"http://{config.host}:{config.ports.alertmanager}"
    settings["listen"] = f"{config.host}:{config.ports.alertbot}"
    settings.setdefault("store", {})["path"] = str(state / "alertbot.sqlite3")
    settings.setdefault("auth", {})["bearer_token"] = webhook_token
    settings.setdefault("alertmanager", {})["url"] = alertmanager
    drilldown = settings.setdefault("drilldown", {})
    drilldown.setdefault("trace_roots", [str(Path(config.trace_dir).resolve())])
    drilldown.setdefault("prometheus_url", prometheus)
    # The analyzer shares this machine with the training job: give the first card longer to name the culprit.
    drilldown.setdefault("verdict_wait_s", LOCAL_VERDICT_WAIT_S)
    links = settings.setdefault("links", {})
    links.setdefault("prometheus_url", prometheus)
    links.setdefault("alertmanager_url", alertmanager)
    if not settings.get("feishu"):
        settings.setdefault("delivery", {})["console_path"] = str(state / "messages.jsonl")
    settings.setdefault("report", {}).setdefault("directory", str(state / "reports"))
    return settings


def plan(config: StackConfig) -> list[Part]:
    """Write every configuration file into the state directory and return the parts in start order."""
    state = Path(config.state_dir)
    (state / "logs").mkdir(parents=True, exist_ok=True)
    state = state.resolve()
    Path(config.trace_dir).mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    host, ports = config.host, config.ports

    rule_files = write_rules(config, state / "rules")
    (state / "prometheus.yml").write_text(
        yaml.safe_dump(prometheus_config(config, rule_files), sort_keys=False)
    )
    (state / "alertmanager.yml").write_text(
        yaml.safe_dump(alertmanager_config(config, token), sort_keys=False)
    )
    bot_file = state / "alertbot.yaml"
    bot_file.write_text(yaml.safe_dump(alertbot_settings(config, state, token), sort_keys=False))
    bot_file.chmod(0o600)

    def http(port: int, path: str = "") -> str:
        return f"http://{host}:{port}{path}"

    return [
        Part(
            "exporter",
            _megatrace_argv(
                "exporter",
                "--listen",
                f"{host}:{ports.exporter}",
                "--sysfs-root",
                config.sysfs_root,
                "--trace-dir",
                config.trace_dir,
                "--collectors",
                ",".join(config.collectors),
            ),
            http(ports.exporter, "/healthz"),
            http(ports.exporter, "/metrics"),
            ports.exporter,
        ),
        Part(
            "node_exporter",
            [_binary("prometheus-node-exporter"), f"--web.listen-address={host}:{ports.node_exporter}"],
            http(ports.node_exporter, "/metrics"),
            http(ports.node_exporter, "/metrics"),
            ports.node_exporter,
        ),
        Part(
            "alertbot",
            _megatrace_argv("alertbot", "--config", str(bot_file)),
            http(ports.alertbot, "/readyz"),
            http(ports.alertbot),
            ports.alertbot,
        ),
        Part(
            "alertmanager",
            [
                _binary("prometheus-alertmanager"),
                f"--config.file={state / 'alertmanager.yml'}",
                f"--storage.path={state / 'alertmanager-data'}",
                f"--web.listen-address={host}:{ports.alertmanager}",
                "--cluster.listen-address=",
            ],
            http(ports.alertmanager, "/-/ready"),
            http(ports.alertmanager),
            ports.alertmanager,
        ),
        Part(
            "prometheus",
            [
                _binary("prometheus"),
                f"--config.file={state / 'prometheus.yml'}",
                f"--storage.tsdb.path={state / 'prometheus-data'}",
                f"--web.listen-address={host}:{ports.prometheus}",
                "--web.enable-lifecycle",
            ],
            http(ports.prometheus, "/-/ready"),
            http(ports.prometheus),
            ports.prometheus,
        ),
    ]


def read_state(state_dir: Path) -> list[Running]:
    """The parts recorded by the last `up` (empty when nothing was started)."""
    path = state_dir / STATE_FILE
    if not path.exists():
        return []
    return [Running(**entry) for entry in json.loads(path.read_text())]


def _write_state(state_dir: Path, running: list[Running]) -> None:
    path = state_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([dataclasses.asdict(item) for item in running], indent=2))
    tmp.replace(path)


def is_ours(item: Running) -> bool:
    """Whether the recorded pid is still the process we started (same command line), not a reused pid."""
    try:
        cmdline = Path(f"/proc/{item.pid}/cmdline").read_bytes()
    except OSError:
        return False
    status = Path(f"/proc/{item.pid}/stat").read_text()
    if status.rsplit(")", 1)[1].split()[0] == "Z":
        return False
    return cmdline.split(b"\0")[:-1] == [arg.encode() for arg in item.argv]


def healthy(url: str) -> bool:
    """Whether `url` answers 2xx within a second."""
    try:
        return requests.get(url, timeout=1).ok
    except requests.RequestException:
        return False


def _log_tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def port_in_use(host: str, port: int) -> bool:
    """Whether another socket already holds `host:port` (a listener, not a connection in TIME_WAIT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def listening_inodes(port: int) -> set[int]:
    """Socket inodes listening on TCP `port` (any address), from ``/proc/net/tcp`` and ``tcp6``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(fields[9]))
    return found


def serves(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on TCP `port`."""
    inodes = listening_inodes(port)
    try:
        links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:
        return False
    return any(link.startswith("socket:[") and int(link[8:-1]) in inodes for link in links)


def _port_taken(name: str, address: str) -> StackError:
    return StackError(
        f"{name}: {address} is already in use (address already in use) by a process this stack did not "
        f"start, e.g. another stack with another state directory; stop it or set ports.{name}"
    )


def _wait_healthy(item: Running, proc: subprocess.Popen, timeout: float, address: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(
                f"{item.name} exited with status {proc.returncode} while starting; "
                f"last lines of {item.log}:\n{_log_tail(item.log)}"
            )
        if healthy(item.health_url):
            if not item.port or serves(proc.pid, item.port):
                return
            if listening_inodes(item.port):  # someone answers, and it is not the process we started
                raise _port_taken(item.name, address)
        time.sleep(0.2)
    raise StackError(f"{item.name} did not answer {item.health_url} within {timeout:.0f}s; see {item.log}")


def up(config: StackConfig, say: Callable[[str], None] = print) -> list[Running]:
    """Start every part and wait until each is healthy; on failure stop what was started and raise."""
    state = Path(config.state_dir)
    alive = [item for item in read_state(state) if is_ours(item)]
    if alive:
        raise StackError(
            f"the stack in {state} is already running ({', '.join(i.name for i in alive)}); "
            "run `megatrace stack down` first"
        )
    running: list[Running] = []
    try:
        for part in plan(config):
            address = f"{config.host}:{part.port}"
            if port_in_use(config.host, part.port):
                raise _port_taken(part.name, address)
            log = state / "logs" / f"{part.name}.log"
            with open(log, "ab") as out:
                proc = subprocess.Popen(
                    part.argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            item = Running(part.name, proc.pid, part.argv, part.health_url, part.url, str(log), part.port)
            running.append(item)
            _write_state(state, running)
            _wait_healthy(item, proc, config.start_timeout_seconds, address)
            say(f"  {part.name:<14} up   {part.url}")
    except BaseException:
        stop(running)
        _write_state(state, [])
        raise
    return running


def _signal_group(item: Running, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(item.pid) == item.pid:
            os.killpg(item.pid, signum)
        else:
            os.kill(item.pid, signum)


def stop(running: list[Running], timeout: float = 10.0) -> list[str]:
    """Stop the recorded parts that are still ours (newest first); returns the names stopped."""
    stopped = []
    for item in reversed(running):
        if not is_ours(item):
            continue
        _signal_group(item, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while is_ours(item) and time.monotonic() < deadline:
            _reap(item.pid)
            time.sleep(0.1)
        if is_ours(item):
            _signal_group(item, signal.SIGKILL)
        _reap(item.pid)
        stopped.append(item.name)
    return stopped


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def down(config: StackConfig) -> list[str]:
    """Stop what the last `up` started (and nothing else); returns the names stopped."""
    state = Path(config.state_dir)
    running = read_state(state)
    stopped = stop(running)
    if running:
        _write_state(state, [])
    return stopped


@dataclasses.dataclass
class PartStatus:
    """What `status` reports for one part."""

    name: str
    pid: int
    running: bool
    healthy: bool
    url: str
    log: str


def status(config: StackConfig) -> list[PartStatus]:
    """Whether each recorded part runs and answers its health URL."""
    result = []
    for item in read_state(Path(config.state_dir)):
        alive = is_ours(item)
        result.append(
            PartStatus(item.name, item.pid, alive, alive and healthy(item.health_url), item.url, item.log)
        )
    return result
