"""The foundation: package layout, the `megatrace` command, the configuration loader, logging."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import megatrace
from megatrace.cli import main
from megatrace.config import ConfigError, env_overrides, load_config
from megatrace.logsetup import register_secret, setup_logging


@dataclasses.dataclass
class Feishu:
    webhook: str = ""
    secret: str = ""


@dataclasses.dataclass
class Sample:
    listen: str = "127.0.0.1:9451"
    port: int = 9451
    ratio: float = 0.5
    enabled: bool = True
    levels: list[str] = dataclasses.field(default_factory=lambda: ["P0", "P1"])
    feishu: Feishu = dataclasses.field(default_factory=Feishu)


def test_components_import_under_one_package() -> None:
    import megatrace.alertbot
    import megatrace.analyzer
    import megatrace.exporters
    import megatrace.tracer

    root = Path(__file__).resolve().parents[1]
    assert Path(megatrace.tracer.__file__).parent == root / "tracer"
    assert Path(megatrace.analyzer.__file__).parent == root / "analyzer"
    assert Path(megatrace.exporters.__file__).parent == root / "exporters"
    assert Path(megatrace.alertbot.__file__).parent == root / "alertbot"


def test_core_does_not_import_torch() -> None:
    code = "import sys, megatrace.cli, megatrace.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("command", "absent"),
    [
        ("exporter", ("pandas", "apscheduler", "torch")),
        ("trace", ("pandas", "torch")),
        ("analyze", ("torch",)),
    ],
)
def test_a_subcommand_imports_only_its_component(command: str, absent: tuple[str, ...]) -> None:
    probe = f"""
import contextlib, sys
from megatrace.cli import build_parser
with contextlib.suppress(SystemExit):
    build_parser([{command!r}]).parse_args([{command!r}, "--help"])
print(sorted(set({list(absent)!r}) & set(sys.modules)))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert f"usage: megatrace {command}" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_every_subcommand_has_help() -> None:
    from megatrace.cli import COMMANDS

    for command in COMMANDS:
        exe = Path(sys.executable).parent / "megatrace"
        out = subprocess.run([str(exe), command, "--help"], capture_output=True, text=True, check=True)
        assert out.stdout.startswith(f"usage: megatrace {command}")


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"megatrace {megatrace.__version__}"


def test_console_script_help() -> None:
    exe = Path(sys.executable).parent / "megatrace"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("usage: megatrace")
    assert "--log-format" in out.stdout
    for command in ("exporter", "analyze", "alertbot", "trace", "stack"):
        assert command in out.stdout


def test_no_subcommand_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: megatrace" in capsys.readouterr().out


def test_config_defaults_without_file() -> None:
    cfg = load_config(Sample, environ={})
    assert cfg == Sample()


def test_config_file_and_env_override(tmp_path: Path) -> None:
    path = tmp_path / "bot.yaml"
    path.write_text("port: 9000\nfeishu:\n  webhook: https://example.invalid/hook\nlevels: [P0]\n")
    env = {"MT_PORT": "9100", "MT_FEISHU__SECRET": "s3cret", "MT_LEVELS": "[P2, P3]", "OTHER": "x"}
    cfg = load_config(Sample, path, env_prefix="MT_", environ=env)
    assert cfg.port == 9100
    assert cfg.levels == ["P2", "P3"]
    assert cfg.feishu == Feishu(webhook="https://example.invalid/hook", secret="s3cret")


def test_overrides_win_over_environment(tmp_path: Path) -> None:
    cfg = load_config(Sample, env_prefix="MT_", environ={"MT_PORT": "1"}, overrides={"port": 2})
    assert cfg.port == 2


def test_bad_value_names_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("feishu:\n  webhook: 12\nport: eighty\n")
    with pytest.raises(ConfigError) as exc:
        load_config(Sample, path, environ={})
    message = str(exc.value)
    assert str(path) in message
    assert "key 'port'" in message
    assert "integer" in message
    assert "'eighty'" in message


def test_unknown_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("prot: 80\n")
    with pytest.raises(ConfigError, match=r"key 'prot': unknown key"):
        load_config(Sample, path, environ={})


def test_bad_env_value_names_the_environment() -> None:
    with pytest.raises(ConfigError, match=r"environment MT_\*.*key 'ratio'"):
        load_config(Sample, env_prefix="MT_", environ={"MT_RATIO": "lots"})


@pytest.mark.parametrize(
    ("text", "match"),
    [("port: [1, 2\n", r"line \d+ not valid YAML"), ("- a\n- b\n", "expected a mapping")],
)
def test_unparsable_file(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(Sample, path, environ={})


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read configuration file"):
        load_config(Sample, tmp_path / "absent.yaml", environ={})


def test_env_empty_segment_rejected() -> None:
    with pytest.raises(ConfigError, match="empty key segment"):
        env_overrides("MT_", {"MT_FEISHU____X": "1"})


def test_text_logs_mask_secrets() -> None:
    stream = io.StringIO()
    setup_logging("info", "text", stream=stream)
    register_secret("tok-abcdef123456")
    logging.getLogger("megatrace.test").info("posting with token %s", "tok-abcdef123456")
    assert "tok-abcdef123456" not in stream.getvalue()
    assert "posting with token ***" in stream.getvalue()


def test_json_logs_are_one_object_per_line_and_masked() -> None:
    stream = io.StringIO()
    setup_logging("debug", "json", stream=stream)
    register_secret("hook-secret-xyz")
    log = logging.getLogger("megatrace.test")
    log.warning("url https://h/hook-secret-xyz failed", extra={"attempt": 3})
    log.debug("second")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["level"] == "warning"
    assert first["attempt"] == 3
    assert first["msg"] == "url https://h/*** failed"
    assert json.loads(lines[1])["msg"] == "second"


def test_bad_log_format_rejected() -> None:
    with pytest.raises(ValueError, match="log format"):
        setup_logging("info", "xml")


def test_unknown_nested_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("feishu:\n  webhok: x\n")
    with pytest.raises(ConfigError, match=r"key 'feishu.webhok': unknown key"):
        load_config(Sample, path, environ={})
