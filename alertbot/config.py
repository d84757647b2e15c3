"""Configuration schema of the alert bot (loaded with `megatrace.config.load_config`, env prefix
``MEGATRACE_ALERTBOT_``) and the checks a schema alone cannot express."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from apscheduler.triggers.cron import CronTrigger

from megatrace.config import ConfigError, env_overrides, merge, read_yaml, validate
from megatrace.listen import parse_host_port
from megatrace.logsetup import register_secret

LEVELS = ("P0", "P1", "P2", "P3")
ENV_PREFIX = "MEGATRACE_ALERTBOT_"


@dataclasses.dataclass
class AuthConfig:
    """Webhook and silence endpoint authentication: a bearer token, HTTP basic auth, or both."""

    bearer_token: str = ""
    basic_user: str = ""
    basic_password: str = ""


@dataclasses.dataclass
class AlertmanagerConfig:
    """Where Alertmanager's API v2 is (reconciliation and silences); empty url disables both."""

    url: str = ""
    receiver: str = ""
    reconcile_interval_s: float = 60.0
    resolve_grace_s: float = 300.0
    timeout_s: float = 10.0


@dataclasses.dataclass
class StoreConfig:
    """SQLite at `path` (one replica), or PostgreSQL at `url` (``postgresql://user:pw@host:5432/db``),
    which several replicas share. `lease_s`: how long a replica's claim on a send or a scheduled job
    lasts before another replica may take it over (longer than any one send can take)."""

    path: str = "alertbot.db"
    url: str = ""
    retention_days: int = 90
    synchronous: str = "FULL"
    lease_s: float = 60.0


@dataclasses.dataclass
class DedupeConfig:
    repeat_interval_s: float = 4 * 3600.0
    flap_window_s: float = 3600.0
    flap_threshold: int = 4
    flap_hold_s: float = 300.0
    storm_window_s: float = 120.0
    storm_threshold: int = 5
    storm_hold_s: float = 10.0
    storm_resolve_hold_s: float = 60.0


@dataclasses.dataclass
class GradingConfig:
    policy_file: str = ""
    default_level: str = "P2"
    escalate_after: int = 3
    escalate_window_s: float = 86400.0


@dataclasses.dataclass
class GroupBotConfig:
    """One Feishu custom group bot; `chat_id` (optional) lets the app confirm in-doubt posts after a crash."""

    webhook: str
    secret: str = ""
    chat_id: str = ""


@dataclasses.dataclass
class FeishuAppConfig:
    app_id: str = ""
    app_secret: str = ""
    chats: dict[str, str] = field(default_factory=dict)
    phone_levels: list[str] = field(default_factory=lambda: ["P0"])
    oncall: list[str] = field(default_factory=list)


@dataclasses.dataclass
class SheetConfig:
    spreadsheet_token: str = ""
    sheet_id: str = ""
    flush_interval_s: float = 10.0
    batch_size: int = 500


@dataclasses.dataclass
class CallbackConfig:
    """How Feishu delivers card actions: ``request_url`` (Feishu POSTs to ``/feishu/callback``;
    needs the app's verification token and encrypt key) or ``long_connection`` (the bot keeps
    lark-oapi's websocket open to Feishu; no public address needed). Empty: cards carry no actions."""

    mode: str = ""
    verification_token: str = ""
    encrypt_key: str = ""
    max_skew_s: float = 300.0
    long_connection_url: str = ""


@dataclasses.dataclass
class FeishuConfig:
    base_url: str = "https://open.feishu.cn"
    callback: CallbackConfig = field(default_factory=CallbackConfig)
    group_bots: dict[str, GroupBotConfig] = field(default_factory=dict)
    app: FeishuAppConfig = field(default_factory=FeishuAppConfig)
    sheet: SheetConfig = field(default_factory=SheetConfig)
    timeout_s: float = 10.0


@dataclasses.dataclass
class DeliveryConfig:
    max_attempts: int = 8
    backoff_base_s: float = 1.0
    backoff_max_s: float = 300.0
    bot_per_second: float = 5.0
    bot_per_minute: float = 100.0
    app_per_second: float = 50.0
    app_per_minute: float = 1000.0
    chat_per_second: float = 5.0
    report_only_levels: list[str] = field(default_factory=lambda: ["P3"])
    console_path: str = "-"


@dataclasses.dataclass
class LinksConfig:
    """Where people open things from a card: relative runbook paths are joined with
    `runbook_base_url`; Prometheus and Alertmanager links are moved onto the reachable URLs."""

    grafana_url: str = ""
    prometheus_url: str = ""
    alertmanager_url: str = ""
    runbook_base_url: str = ""
    # The archive sheet in Feishu's web UI: a storm card links to it for its members (all named there).
    archive_sheet_url: str = ""


@dataclasses.dataclass
class AgentFallbackConfig:
    """Where the drill-down finds the agents when Prometheus cannot tell: a static list of agents
    (``HOST`` or ``HOST:PORT`` of their trace endpoints) and a DNS name whose every address is an agent
    (a headless Service)."""

    static: list[str] = field(default_factory=list)
    dns_name: str = ""


@dataclasses.dataclass
class AgentsConfig:
    """How the drill-down reaches the node agents' trace endpoints (source "agents")."""

    port: int = 9452
    scheme: str = "http"
    token_file: str = ""
    timeout_s: float = 10.0
    # Longest a connection to an agent may take to open (an agent partitioned away drops the packets).
    connect_timeout_s: float = 3.0
    # Longest the whole gathering may take: what has not come by then is named as not collected.
    deadline_s: float = 120.0
    retries: int = 2
    parallel: int = 32
    records_per_rank: int = 10000
    # How far back Prometheus is asked for the job's ranks (an agent that went down stays known).
    lookback_s: float = 900.0
    # Where fetched windows are written while the analyzer reads them ("": the system's temp folder).
    work_dir: str = ""
    fallback: AgentFallbackConfig = field(default_factory=AgentFallbackConfig)


DRILLDOWN_SOURCES = ("directory", "agents")


@dataclasses.dataclass
class DrilldownConfig:
    # Alerts that get a drill-down; a job's alerts of these kinds form one incident (one card) per level.
    alerts: list[str] = field(
        default_factory=lambda: [
            "MegatraceJobHang",
            "MegatraceRankHang",
            "MegatraceJobStalled",
            "MegatraceSlowRank",
        ]
    )
    # "directory": the job's folder under trace_roots on this machine (one machine, `make demo`);
    # "agents": fetched from the node agents holding the job's ranks (a cluster).
    source: str = "directory"
    trace_roots: list[str] = field(default_factory=list)
    agents: AgentsConfig = field(default_factory=AgentsConfig)
    analyzer_command: list[str] = field(default_factory=list)
    timeout_s: float = 120.0
    prometheus_url: str = ""
    hint_lookback_s: float = 900.0
    rerun_after_s: float = 600.0
    workers: int = 2
    # How long the first card of an incident waits for the drill-down's verdict (0: never waits).
    verdict_wait_s: float = 5.0


@dataclasses.dataclass
class ReportConfig:
    directory: str = "reports"
    cron: str = "0 9 * * 1"
    timezone: str = "UTC"
    chat: str = ""
    top_n: int = 10


@dataclasses.dataclass
class Person:
    name: str
    open_id: str


@dataclasses.dataclass
class RotationOverride:
    """`name` is primary from `start` until `end` (ISO 8601 times with a UTC offset)."""

    start: str
    end: str
    name: str


@dataclasses.dataclass
class EscalationPolicy:
    """Per level: whom the first call goes to (``primary`` or ``everyone`` on the roster), after how
    many seconds unclaimed the next person on the roster is phoned (0: never), and after how many
    seconds unclaimed and firing the alert is raised to `raise_to` (0: never)."""

    phone: str = "primary"
    next_after_s: float = 0.0
    raise_after_s: float = 0.0
    raise_to: str = "P0"


@dataclasses.dataclass
class OncallConfig:
    """The on-call roster (only its people may act on cards), a rotation of `rotation_days` starting
    at `rotation_start` with the roster's first person, overrides, and escalation per level."""

    roster: list[Person] = field(default_factory=list)
    rotation_start: str = "2026-01-05T09:00:00+00:00"
    rotation_days: float = 7.0
    overrides: list[RotationOverride] = field(default_factory=list)
    escalation: dict[str, EscalationPolicy] = field(default_factory=dict)
    tick_s: float = 15.0


@dataclasses.dataclass
class AlertbotConfig:
    listen: str = "127.0.0.1:9451"
    max_body_bytes: int = 64 * 1024 * 1024
    # Seconds a client may take to send the rest of a request (and an idle keep-alive may last).
    read_timeout_s: float = 30.0
    templates_dir: str = ""
    auth: AuthConfig = field(default_factory=AuthConfig)
    alertmanager: AlertmanagerConfig = field(default_factory=AlertmanagerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    dedupe: DedupeConfig = field(default_factory=DedupeConfig)
    grading: GradingConfig = field(default_factory=GradingConfig)
    feishu: FeishuConfig = field(default_factory=FeishuConfig)
    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    links: LinksConfig = field(default_factory=LinksConfig)
    drilldown: DrilldownConfig = field(default_factory=DrilldownConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    oncall: OncallConfig = field(default_factory=OncallConfig)
    # Settings of the channels that declare their own (`megatrace.alertbot.channels`), by channel name.
    channels: dict[str, Any] = field(default_factory=dict)


DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat", "sun")


def cron_trigger(expression: str, timezone: str) -> CronTrigger:
    """A trigger for a standard 5-field crontab line. Numeric weekdays follow cron (0 and 7 are
    Sunday, 1 is Monday); APScheduler 3 would read them as Monday-based, so they become names."""
    fields = expression.split()
    if len(fields) != 5:
        raise ValueError(f"report.cron: expected 5 crontab fields, got {expression!r}")
    fields[4] = re.sub(
        r"(?<!/)\d+", lambda m: DAY_NAMES[int(m.group())] if int(m.group()) < 8 else m.group(), fields[4]
    )
    return CronTrigger.from_crontab(" ".join(fields), timezone=timezone)


def app_configured(cfg: AlertbotConfig) -> bool:
    return bool(cfg.feishu.app.app_id and cfg.feishu.app.app_secret)


def listen_address(listen: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (IPv6 hosts in brackets) into host and port; port 0 picks a free one."""
    try:
        host, port = parse_host_port(listen, allow_port_zero=True)
    except ValueError as exc:
        raise ConfigError(f"key 'listen': {exc}") from None
    return host, port


def drilldown_enabled(drill: DrilldownConfig) -> bool:
    """Whether alerts get a drill-down: the agents are its source, or a trace root is configured."""
    return drill.source == "agents" or bool(drill.trace_roots)


def drilldown_problems(drill: DrilldownConfig) -> list[str]:
    """What is wrong with the drill-down's data source settings (an empty list when nothing is)."""
    problems: list[str] = []
    if drill.source not in DRILLDOWN_SOURCES:
        problems.append(f"key 'drilldown.source': expected one of {', '.join(DRILLDOWN_SOURCES)}")
    if not 0 <= drill.verdict_wait_s <= 300:
        problems.append("key 'drilldown.verdict_wait_s': must be between 0 and 300")
    if drill.source == "agents":
        problems += agent_discovery_problems(drill)
        if not drill.agents.token_file:
            problems.append("key 'drilldown.agents.token_file': the agents' trace endpoints need a token")
        if drill.agents.scheme not in ("http", "https"):
            problems.append("key 'drilldown.agents.scheme': expected http or https")
        for key in ("parallel", "records_per_rank", "port"):
            if getattr(drill.agents, key) < 1:
                problems.append(f"key 'drilldown.agents.{key}': must be at least 1")
        if drill.agents.retries < 0:
            problems.append("key 'drilldown.agents.retries': must not be negative")
    return problems


AGENT_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*)(:\d{1,5})?")
DNS_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*\.?")


def agent_discovery_problems(drill: DrilldownConfig) -> list[str]:
    """What is wrong with how source agents finds and reaches the agents (Prometheus, the fallback,
    the timeouts)."""
    agents, problems = drill.agents, []
    fallback = agents.fallback
    if not drill.prometheus_url and not (fallback.static or fallback.dns_name):
        problems.append(
            "key 'drilldown.prometheus_url': source agents finds the agents through Prometheus "
            "(or set drilldown.agents.fallback.static or dns_name)"
        )
    for entry in fallback.static:
        match = AGENT_ADDRESS.fullmatch(entry)
        if match is None or (match.group(2) and not 0 < int(match.group(2)[1:]) <= 65535):
            problems.append(
                f"key 'drilldown.agents.fallback.static': {entry[:80]!r} is not HOST or HOST:PORT"
            )
    if fallback.dns_name and DNS_NAME.fullmatch(fallback.dns_name) is None:
        problems.append(f"key 'drilldown.agents.fallback.dns_name': {fallback.dns_name[:80]!r} is not a name")
    for key in ("timeout_s", "connect_timeout_s", "deadline_s"):
        if not 0 < getattr(agents, key) <= 3600:
            problems.append(f"key 'drilldown.agents.{key}': must be more than 0 and at most 3600")
    if agents.deadline_s < agents.timeout_s:
        problems.append("key 'drilldown.agents.deadline_s': must be at least drilldown.agents.timeout_s")
    return problems


def store_url_problems(url: str) -> list[str]:
    """What is wrong with `store.url`, in words that never repeat it (it may hold a password)."""
    if not url:
        return []
    if not re.match(r"^postgres(ql)?://", url):
        return ["key 'store.url': expected a postgresql:// URL (the value is not shown)"]
    try:
        urlsplit(url).port  # noqa: B018 -- parsing the port is the check
    except ValueError:
        return ["key 'store.url': not a valid URL (a bracket unclosed, or a port not from 0 to 65535)"]
    return []


def check(cfg: AlertbotConfig, source: str, serving: bool = True) -> AlertbotConfig:
    """Cross-field checks; raises ConfigError naming the key. Registers every secret for log masking.
    `serving=False` (reports) does not ask for the webhook credentials."""
    problems = []
    auth = cfg.auth
    if serving and not auth.bearer_token and not (auth.basic_user and auth.basic_password):
        problems.append("key 'auth': set auth.bearer_token or auth.basic_user + auth.basic_password")
    if not 0 < cfg.read_timeout_s <= 3600:
        problems.append("key 'read_timeout_s': must be more than 0 and at most 3600")
    listen_address(cfg.listen)
    level_maps: dict[str, dict[str, Any]] = {
        "feishu.group_bots": cfg.feishu.group_bots,
        "feishu.app.chats": cfg.feishu.app.chats,
    }
    for key, mapping in level_maps.items():
        problems += [f"key '{key}.{k}': not a level (P0..P3)" for k in mapping if k not in LEVELS]
    level_lists = {
        "feishu.app.phone_levels": cfg.feishu.app.phone_levels,
        "delivery.report_only_levels": cfg.delivery.report_only_levels,
        "grading.default_level": [cfg.grading.default_level],
    }
    for key, values in level_lists.items():
        problems += [f"key '{key}': {v!r} is not a level (P0..P3)" for v in values if v not in LEVELS]
    problems += store_url_problems(cfg.store.url)
    if not 3 * cfg.feishu.timeout_s < cfg.store.lease_s <= 3600:
        problems.append("key 'store.lease_s': must be more than 3 × feishu.timeout_s and at most 3600")
    if cfg.store.synchronous.upper() not in ("NORMAL", "FULL", "EXTRA"):
        problems.append("key 'store.synchronous': expected NORMAL, FULL or EXTRA")
    if cfg.feishu.sheet.spreadsheet_token and not app_configured(cfg):
        problems.append("key 'feishu.sheet': the sheet archive needs feishu.app.app_id and app_secret")
    if cfg.feishu.app.oncall and not app_configured(cfg):
        problems.append("key 'feishu.app.oncall': phoning needs feishu.app.app_id and app_secret")
    if cfg.feishu.app.oncall:
        problems += [
            f"key 'feishu.app.chats': phone level {level} needs an app chat to send the message first"
            for level in cfg.feishu.app.phone_levels
            if level not in cfg.feishu.app.chats and level not in cfg.delivery.report_only_levels
        ]
    if cfg.report.chat and not app_configured(cfg):
        problems.append("key 'report.chat': sending the workbook needs feishu.app.app_id and app_secret")
    if not 1 <= cfg.feishu.sheet.batch_size <= 5000:
        problems.append("key 'feishu.sheet.batch_size': must be between 1 and 5000")
    problems += drilldown_problems(cfg.drilldown)
    for root in cfg.drilldown.trace_roots:
        if not Path(root).is_absolute():
            problems.append(f"key 'drilldown.trace_roots': {root!r} is not an absolute path")
    try:
        cron_trigger(cfg.report.cron, cfg.report.timezone)
    except (ValueError, LookupError) as exc:
        problems.append(f"key 'report': invalid cron or timezone: {exc}")
    if cfg.templates_dir and not Path(cfg.templates_dir).is_dir():
        problems.append(f"key 'templates_dir': {cfg.templates_dir!r} is not a directory")
    problems += oncall_problems(cfg)
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    from megatrace.alertbot.channels import check_settings  # the channels read this module

    cfg.channels = check_settings(cfg.channels, source)
    for secret in (
        auth.bearer_token,
        cfg.store.url,
        urlsplit(cfg.store.url).password or "",
        auth.basic_password,
        cfg.feishu.app.app_secret,
        cfg.feishu.callback.verification_token,
        cfg.feishu.callback.encrypt_key,
        *(bot.secret for bot in cfg.feishu.group_bots.values()),
        *(bot.webhook for bot in cfg.feishu.group_bots.values()),
        *(bot.webhook.rsplit("/", 1)[-1] for bot in cfg.feishu.group_bots.values()),
    ):
        register_secret(secret)
    return cfg


def parse_time(value: str, key: str) -> float:
    """An ISO 8601 time with a UTC offset as Unix seconds; ValueError naming `key` otherwise."""
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"key '{key}': {value!r} is not an ISO 8601 time") from None
    if moment.tzinfo is None:
        raise ValueError(f"key '{key}': {value!r} needs a UTC offset (e.g. +08:00)")
    return moment.timestamp()


def oncall_problems(cfg: AlertbotConfig) -> list[str]:
    """What is wrong with the roster, rotation, escalation and callback settings."""
    problems = []
    oncall, callback = cfg.oncall, cfg.feishu.callback
    names = [p.name for p in oncall.roster]
    if len(set(names)) != len(names):
        problems.append("key 'oncall.roster': names must be unique")
    problems += [
        f"key 'oncall.roster': {p.name!r} has open_id {p.open_id!r}, expected ou_…"
        for p in oncall.roster
        if not p.open_id.startswith("ou_")
    ]
    times = [("oncall.rotation_start", oncall.rotation_start)]
    times += [(f"oncall.overrides[{i}]", t) for i, o in enumerate(oncall.overrides) for t in (o.start, o.end)]
    for key, value in times:
        try:
            parse_time(value, key)
        except ValueError as exc:
            problems.append(str(exc))
    problems += [
        f"key 'oncall.overrides[{i}].name': {o.name!r} is not on the roster"
        for i, o in enumerate(oncall.overrides)
        if o.name not in names
    ]
    if oncall.rotation_days <= 0 or oncall.tick_s <= 0:
        problems.append("key 'oncall': rotation_days and tick_s must be more than 0")
    for level, policy in oncall.escalation.items():
        if level not in LEVELS or policy.raise_to not in LEVELS:
            problems.append(f"key 'oncall.escalation.{level}': levels are P0..P3")
        if policy.phone not in ("primary", "everyone"):
            problems.append(f"key 'oncall.escalation.{level}.phone': expected primary or everyone")
    if oncall.escalation and not oncall.roster:
        problems.append("key 'oncall.escalation': needs oncall.roster")
    if callback.max_skew_s <= 0:
        problems.append("key 'feishu.callback.max_skew_s': must be more than 0 (seconds)")
    if callback.mode not in ("", "request_url", "long_connection"):
        problems.append("key 'feishu.callback.mode': expected request_url or long_connection")
    if callback.mode and (not app_configured(cfg) or not oncall.roster):
        problems.append("key 'feishu.callback': card actions need feishu.app and oncall.roster")
    if callback.mode == "request_url" and not (callback.verification_token and callback.encrypt_key):
        problems.append(
            "key 'feishu.callback': request_url needs verification_token and encrypt_key (signatures)"
        )
    return problems


def _upper_levels(data: dict[str, Any]) -> dict[str, Any]:
    """Level-keyed maps with upper-case keys (environment variable names arrive lower-cased), group
    bots given as a bare webhook URL as ``{webhook: URL}``."""
    feishu = data.get("feishu")
    if not isinstance(feishu, dict):
        return data
    feishu = dict(feishu)
    if isinstance(feishu.get("group_bots"), dict):  # a bare webhook URL is short for {webhook: URL}
        feishu["group_bots"] = {
            str(k).upper(): {"webhook": v} if isinstance(v, str) else v
            for k, v in feishu["group_bots"].items()
        }
    app = feishu.get("app")
    if isinstance(app, dict) and isinstance(app.get("chats"), dict):
        feishu["app"] = {**app, "chats": {str(k).upper(): v for k, v in app["chats"].items()}}
    return {**data, "feishu": feishu}


def load(path: str | Path | None, overrides: dict | None = None, serving: bool = True) -> AlertbotConfig:
    """Load and check the alert bot configuration (file, then environment, then `overrides`);
    the same steps as `megatrace.config.load_config`, with level keys (P0..P3) case-insensitive."""
    data = _upper_levels(read_yaml(path)) if path is not None else {}
    sources = [str(path)] if path is not None else []
    from_env = env_overrides(ENV_PREFIX, schema=AlertbotConfig)
    if from_env:
        data = merge(data, _upper_levels(from_env))
        sources.append(f"environment {ENV_PREFIX}*")
    if overrides:
        data = merge(data, overrides)
        sources.append("command line")
    source = " + ".join(sources) or "defaults"
    return check(validate(AlertbotConfig, data, source), source, serving)
