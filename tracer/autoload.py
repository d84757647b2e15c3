"""Automatic activation: imported from the ``sitecustomize.py`` that `megatrace trace` puts on PYTHONPATH.

Runs the next ``sitecustomize`` on the path (so a site's own one still works), and, when tracing is
enabled, installs the tracer as soon as ``torch`` has been imported, before the script's own
``from torch.distributed import ...`` lines run. Costs nothing in processes that never import torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

SITECUSTOMIZE = (
    '"""Written by `megatrace trace`: turns the collective tracer on in every Python process."""\n'
    + (
        "try:\n    import megatrace.tracer.autoload\nexcept ImportError as exc:\n"
        "    import sys\n    print(f'megatrace trace: tracer not available here: {exc}', file=sys.stderr)\n"
    )
)


def _run_next_sitecustomize() -> None:
    mine = sys.modules.pop("sitecustomize", None)
    our_dir = Path(getattr(mine, "__file__", None) or ".").resolve().parent if mine else None
    saved = list(sys.path)
    try:
        sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != our_dir]
        if importlib.util.find_spec("sitecustomize") is not None:
            importlib.import_module("sitecustomize")
    except Exception as exc:  # a broken site hook must not stop the program, as in Python's own site.py
        print(f"megatrace trace: error in the next sitecustomize: {exc!r}", file=sys.stderr)
    finally:
        sys.path[:] = saved
        if mine is not None:
            sys.modules["sitecustomize"] = mine


class _InstallAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when ``torch`` is imported, runs the tracer install after it loads."""

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None):  # type: ignore[override]
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            from megatrace.tracer.runtime import install

            install()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def activate() -> None:
    """Hook the tracer install onto the import of torch (or install now if torch is already loaded)."""
    from megatrace.tracer.settings import enabled_in

    if not enabled_in(os.environ):
        return
    if "torch" in sys.modules:
        from megatrace.tracer.runtime import install

        install()
    else:
        sys.meta_path.insert(0, _InstallAfterTorch())


_run_next_sitecustomize()
activate()
