"""Tracer settings from the environment, `megatrace trace` argument handling, and disabled = unpatched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatrace.cli import main
from megatrace.config import ConfigError
from megatrace.tracer.settings import fault_settings, trace_settings


def test_megatrace_names_win_over_nccl_names() -> None:
    env = {
        "NCCL_MEGATRACE_ENABLE": "1",
        "NCCL_MEGATRACE_LOG_PATH": "/nccl/logs",
        "NCCL_MEGATRACE_SENSTIME": "700",
        "MEGATRACE_TRACE_STALL_MS": "900",
        "SLURM_JOB_ID": "4242",
    }
    settings = trace_settings(env)
    assert (settings.enable, settings.dir, settings.stall_ms, settings.job) == (
        True,
        "/nccl/logs",
        900,
        "4242",
    )


def test_job_defaults_from_launchers() -> None:
    assert trace_settings({"TORCHELASTIC_RUN_ID": "run/7", "SLURM_JOB_ID": "1"}).job == "run_7"
    assert trace_settings({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "12"}).job == "12"
    assert trace_settings({}).job == "local" and not trace_settings({}).enable


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"MEGATRACE_TRACE_STALL_MS": "abc"}, "stall_ms"),
        ({"NCCL_MEGATRACE_SENSTIME": "0"}, "stall_ms"),
        ({"MEGATRACE_TRACE_CAPACITY": "3"}, "capacity"),
        ({"MEGATRACE_TRACE_STALLMS": "5"}, "stallms"),
    ],
)
def test_bad_trace_settings_name_the_key(env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        trace_settings(env)


def test_fault_settings() -> None:
    faults = fault_settings({"MEGATRACE_FAULT_HANG_RANK": "2", "MEGATRACE_FAULT_HANG_AT_CALL": "7"})
    assert (faults.hang_rank, faults.hang_at_call, faults.slow_rank) == (2, 7, -1)
    with pytest.raises(ConfigError, match="slow_pct"):
        fault_settings({"MEGATRACE_FAULT_SLOW_PCT": "-5"})


def test_trace_command_needs_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--"]) == 2
    assert "no command given" in capsys.readouterr().err


def test_trace_command_rejects_bad_settings_when_strict(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("MEGATRACE_TRACE_CAPACITY", "many")
    assert main(["trace", "--strict", "--", sys.executable, "-c", "pass"]) == 2
    assert "capacity" in capsys.readouterr().err


def test_trace_command_runs_python_with_tracer_env_and_keeps_exit_status(tmp_path: Path) -> None:
    script = (
        "import os, sys; import megatrace.tracer.autoload as a; "
        "print(os.environ['MEGATRACE_TRACE_ENABLE'], os.environ['MEGATRACE_TRACE_JOB'], "
        "os.path.basename(os.path.dirname(sys.modules['sitecustomize'].__file__))[:15]); sys.exit(3)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRACE_")}
    argv = [sys.executable, "-m", "megatrace.cli", "trace", "--trace-dir", str(tmp_path), "--job", "j1"]
    done = subprocess.run(
        [*argv, "--", sys.executable, "-c", script], env=env, capture_output=True, text=True
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.split() == ["1", "j1", "megatrace-site-"]
    assert f"tracing into {tmp_path / 'j1'}" in done.stderr


def test_disabled_tracer_patches_nothing() -> None:
    code = (
        "import torch.distributed as dist, megatrace.tracer as t; before = dist.all_reduce; "
        "assert t.install() is False; assert dist.all_reduce is before; print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRACE_", "NCCL_MEGATRACE_"))}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
