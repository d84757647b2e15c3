"""Collective tracer: records every collective a rank issues into a memory-mapped ring buffer.

``install()``, ``uninstall()`` and ``mark_step()`` are the in-process API (they import torch on first
use); `megatrace.tracer.ringfile` and `megatrace.tracer.dumpfile` read the files without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_RUNTIME_API = ("install", "uninstall", "mark_step")


def __getattr__(name: str) -> Any:
    if name in _RUNTIME_API:
        return getattr(importlib.import_module("megatrace.tracer.runtime"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_RUNTIME_API)
