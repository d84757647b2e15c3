"""Configuration and logging at the edges: secrets of any characters stay masked, environment values
of string fields are taken verbatim, and bad files or values get a message, never a traceback."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import pytest

from megatrace.alertbot import config as bot_config
from megatrace.cli import main
from megatrace.config import ConfigError, load_config
from megatrace.logsetup import register_secret, setup_logging
from megatrace.stack_config import StackConfig

BOT_ENV = "MEGATRACE_ALERTBOT_"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("MEGATRACE_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize(
    ("variable", "raw", "field"),
    [
        ("AUTH__BEARER_TOKEN", "20261123987654321", ("auth", "bearer_token")),
        ("AUTH__BEARER_TOKEN", "SECRETtok #comment", ("auth", "bearer_token")),
        ("FEISHU__APP__APP_SECRET", "sec: ret-value", ("feishu", "app", "app_secret")),
        ("FEISHU__GROUP_BOTS__P0__SECRET", "[not, a, list]", ("feishu", "group_bots", "P0", "secret")),
    ],
)
def test_environment_values_of_string_fields_are_verbatim(
    clean_env: pytest.MonkeyPatch, variable: str, raw: str, field: tuple[str, ...]
) -> None:
    clean_env.setenv(f"{BOT_ENV}AUTH__BEARER_TOKEN", "token-from-the-environment")
    clean_env.setenv(f"{BOT_ENV}FEISHU__GROUP_BOTS__P0__WEBHOOK", "https://open.feishu.cn/hook/x-y-z")
    clean_env.setenv(f"{BOT_ENV}{variable}", raw)
    cfg = bot_config.load(None)
    node: object = cfg
    for part in field:
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    assert node == raw


def test_a_group_bot_given_as_a_bare_url_is_its_webhook(tmp_path: Path, clean_env) -> None:
    path = tmp_path / "bot.yaml"
    hook = "https://open.feishu.cn/open-apis/bot/v2/hook/7f3c-secret-hook-token"
    path.write_text(f"auth:\n  bearer_token: tok-1234\nfeishu:\n  group_bots:\n    P0: {hook}\n")
    assert bot_config.load(path).feishu.group_bots["P0"].webhook == hook


@pytest.mark.parametrize(
    "text",
    [
        "auth:\n  bearer_token: 20261123987654321\n",
        "auth:\n  bearer_token: tok-1234\nfeishu:\n  group_bots:\n    P0: [https://h/hook/20261123987654321]\n",
        "auth:\n  bearer_token: tok-1234\nfeishu:\n  app: {app_id: a, app_secret: {x: 20261123987654321}}\n",
    ],
)
def test_config_errors_never_print_a_secret(tmp_path: Path, clean_env, text: str) -> None:
    path = tmp_path / "bot.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        bot_config.load(path)
    assert "20261123987654321" not in str(exc.value)
    assert "not shown" in str(exc.value)


@pytest.mark.parametrize("secret", ['quo"te-secret', "back\\slash-secret", "ключ-secret-ü", "2026112398"])
def test_json_and_text_logs_mask_secrets_of_any_characters(secret: str) -> None:
    register_secret(secret)
    for fmt in ("json", "text"):
        stream = io.StringIO()
        setup_logging("info", fmt, stream=stream)
        log = logging.getLogger("megatrace.test")
        log.warning("token %s and %r", secret, secret, extra={"detail": f"x{secret}x"})
        out = stream.getvalue()
        for form in (secret, json.dumps(secret)[1:-1], repr(secret)[1:-1], ascii(secret)[1:-1]):
            assert form not in out, (fmt, form, out)
        assert "***" in out


def test_non_utf8_config_files_get_a_message_not_a_traceback(
    tmp_path: Path, clean_env, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("# Konfiguration für den Knoten\nlisten: 127.0.0.1:9450\n".encode("latin-1"))
    for argv in (
        ["exporter", "--config", str(path)],
        ["alertbot", "--config", str(path)],
        ["stack", "--config", str(path), "status"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "not UTF-8" in err and str(path) in err, argv


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"time_compression": 0}, "key 'time_compression': must be more than 0"),
        ({"ports": {"alertbot": 70000}}, "key 'ports.alertbot': a port is from 1 to 65535, got 70000"),
        ({"ports": {"prometheus": 0}}, "key 'ports.prometheus'"),
    ],
)
def test_stack_settings_are_validated_with_a_sentence(overrides: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(StackConfig, overrides=overrides)
    assert expected in str(exc.value)
    assert "{" not in str(exc.value)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://alert:hunter2pw@[::1/alerts", "key 'store.url'"),
        ("postgresql://alert:hunter2pw@db.example:99999/alerts", "key 'store.url'"),
        ("postgresql://alert:hunter2pw@db.example:five/alerts", "key 'store.url'"),
        ("postgresql://alert:hunter2pw@127.0.0.1:9/alerts", "store.url"),  # nothing listens on port 9
    ],
)
def test_a_bad_store_url_is_one_line_without_its_password(
    tmp_path: Path, clean_env, capsys: pytest.CaptureFixture[str], url: str, says: str
) -> None:
    path = tmp_path / "bot.yaml"
    path.write_text(f"auth:\n  bearer_token: tok-1234\nstore:\n  url: '{url}'\n")
    assert main(["alertbot", "--config", str(path)]) in (1, 2)
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and "hunter2pw" not in err


@pytest.mark.parametrize(
    "store",
    [
        "  url: [postgresql://alert:hunter2pw@db/alerts]\n",
        "  url: {postgresql://alert:hunter2pw@db/alerts: 1}\n",
        "  url: 20261123987654321\n",
    ],
)
def test_a_store_url_of_the_wrong_type_is_not_printed(tmp_path: Path, clean_env, store: str) -> None:
    path = tmp_path / "bot.yaml"
    path.write_text(f"auth:\n  bearer_token: tok-1234\nstore:\n{store}")
    with pytest.raises(ConfigError) as exc:
        bot_config.load(path)
    assert "key 'store.url'" in str(exc.value)
    assert "hunter2pw" not in str(exc.value) and "20261123987654321" not in str(exc.value)


@pytest.mark.parametrize("skew", [-1, 0, -0.5])
def test_a_callback_skew_that_refuses_every_callback_is_refused(
    tmp_path: Path, clean_env, skew: float
) -> None:
    path = tmp_path / "bot.yaml"
    path.write_text(f"auth:\n  bearer_token: tok-1234\nfeishu:\n  callback:\n    max_skew_s: {skew}\n")
    with pytest.raises(ConfigError, match=r"key 'feishu\.callback\.max_skew_s'"):
        bot_config.load(path)
