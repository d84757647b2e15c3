"""Fixtures for the tracer tests."""

from __future__ import annotations

from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def native_module() -> ModuleType:
    """The native capture, built first if this machine has not built it yet (`make native` does)."""
    from megatrace.tracer import native

    module = native.load(build_missing=True)
    assert module is not None, native.load_error
    return module
