"""Tracer and fault-injection settings, read from the environment and validated.

``MEGATRACE_TRACE_{ENABLE,DIR,JOB,STALL_MS,CAPACITY,NATIVE,HOST_SAMPLE_MS,GC_SPAN_MS,STACKS_FALLBACK}``
configure the tracer; the Megatrace NCCL names ``NCCL_MEGATRACE_{ENABLE,LOG_PATH,SENSTIME}`` are
honoured when the former are unset.
``MEGATRACE_FAULT_*`` inject a hang or a slow rank. Bad values raise `ConfigError` naming the variable.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

from pydantic import Field

from megatrace.config import ConfigError, validate
from megatrace.tracer.ringfile import DEFAULT_CAPACITY

TRACE_PREFIX = "MEGATRACE_TRACE_"
FAULT_PREFIX = "MEGATRACE_FAULT_"
DEFAULT_TRACE_DIR = "/run/megatrace"
DEFAULT_STALL_MS = 3000
DEFAULT_HOST_SAMPLE_MS = 1000
DEFAULT_GC_SPAN_MS = 1
NCCL_NAMES = {
    "NCCL_MEGATRACE_ENABLE": "enable",
    "NCCL_MEGATRACE_LOG_PATH": "dir",
    "NCCL_MEGATRACE_SENSTIME": "stall_ms",
}
_LAUNCHER_JOB_VARS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


@dataclasses.dataclass
class TraceSettings:
    """What the tracer does in this process."""

    enable: bool = False
    dir: str = DEFAULT_TRACE_DIR
    job: str = ""
    stall_ms: Annotated[int, Field(ge=1)] = DEFAULT_STALL_MS
    capacity: Annotated[int, Field(ge=16, le=1 << 26)] = DEFAULT_CAPACITY
    # Capture at the process-group layer (native) where it loads; False: the Python wrappers only.
    native: bool = True
    # How often the watchdog samples the rank's process and cgroup into the ring header; 0: never.
    host_sample_ms: Annotated[int, Field(ge=0)] = DEFAULT_HOST_SAMPLE_MS
    # Garbage collections lasting at least this long are written as span records (all are counted).
    gc_span_ms: Annotated[int, Field(ge=0)] = DEFAULT_GC_SPAN_MS
    # Keep faulthandler's timer armed for stacks of a rank stuck holding the GIL (`stack_fallback`).
    stacks_fallback: bool = True


@dataclasses.dataclass
class FaultSettings:
    """Injected faults: rank `hang_rank` hangs before its `hang_at_call`-th collective (1-based) or
    before its first collective once `hang_at_step` steps are done; rank `slow_rank` runs `slow_pct`%
    slower."""

    hang_rank: int = -1
    hang_at_call: Annotated[int, Field(ge=0)] = 0
    hang_at_step: Annotated[int, Field(ge=-1)] = -1
    slow_rank: int = -1
    slow_pct: Annotated[float, Field(ge=0, le=10000)] = 0.0


def _prefixed(environ: Mapping[str, str], prefix: str) -> dict[str, str]:
    return {name[len(prefix) :].lower(): value for name, value in environ.items() if name.startswith(prefix)}


def safe_job_name(raw: str) -> str:
    """A job id usable as one folder name (anything outside [A-Za-z0-9._-] becomes '_')."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", raw.strip())
    return name.strip(".") or "local"


def default_job(environ: Mapping[str, str]) -> str:
    """The job id the usual launchers set: torchrun/elastic run id, else Slurm job id, else 'local'."""
    for name in _LAUNCHER_JOB_VARS:
        value = environ.get(name, "").strip()
        if value and value.lower() != "none":
            return value
    return "local"


def trace_settings(environ: Mapping[str, str] | None = None) -> TraceSettings:
    """Tracer settings from the environment (Megatrace names win over the NCCL_MEGATRACE ones)."""
    environ = os.environ if environ is None else environ
    data = {key: environ[name] for name, key in NCCL_NAMES.items() if environ.get(name, "") != ""}
    data.update(_prefixed(environ, TRACE_PREFIX))
    settings = validate(TraceSettings, data, f"environment {TRACE_PREFIX}* / NCCL_MEGATRACE_*")
    settings.job = safe_job_name(settings.job or default_job(environ))
    return settings


def fault_settings(environ: Mapping[str, str] | None = None) -> FaultSettings:
    """Fault-injection settings from ``MEGATRACE_FAULT_*``."""
    environ = os.environ if environ is None else environ
    return validate(FaultSettings, _prefixed(environ, FAULT_PREFIX), f"environment {FAULT_PREFIX}*")


def enabled_in(environ: Mapping[str, str]) -> bool:
    """Cheap check (no validation) whether the environment switches the tracer on."""
    raw = environ.get(f"{TRACE_PREFIX}ENABLE", environ.get("NCCL_MEGATRACE_ENABLE", ""))
    return raw.strip().lower() in ("1", "true", "yes", "on")


def job_trace_dir(configured: str, job: str) -> tuple[Path | None, str]:
    """The job's trace folder: `configured`/`job` if it is (or can be made) a writable folder, else
    ``<temp dir>/megatrace/<job>``; None when neither can be (the caller then does not trace). The
    second item says why `configured`/`job` was not used ("" when it was)."""
    why = ""
    for base in (lambda: Path(configured), lambda: Path(tempfile.gettempdir()) / "megatrace"):
        try:
            path = base() / job
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # read-only, no permission, `job` exists there as a file, no temp dir at all
            why = why or _refusal(exc)
            continue
        if os.access(path, os.W_OK | os.X_OK) and _can_create_in(path):
            return path, why
        why = why or "cannot create files in it"
    return None, why


def _refusal(exc: OSError) -> str:
    if isinstance(exc, FileExistsError):
        return "something other than a folder is in its place"
    return exc.strerror or str(exc)


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be created in `folder` (a read-only mount refuses even root)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


__all__ = [
    "ConfigError",
    "FaultSettings",
    "TraceSettings",
    "default_job",
    "enabled_in",
    "fault_settings",
    "job_trace_dir",
    "safe_job_name",
    "trace_settings",
]
