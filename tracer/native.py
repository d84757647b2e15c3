"""Native capture: builds and loads the C++ backend wrapper (``tracer/csrc/capture.cpp``) and hooks it
into every process group torch creates.

``python -m megatrace.tracer.native`` builds the extension against the installed torch (``make`` does)
into a cache folder keyed by the source, the ring layout, torch and Python versions; the build first
writes the layout header (``ring_format.h``) generated from `megatrace.tracer.format` into that folder.
`load` never builds and never raises: it returns the module, or None with the reason in `load_error`,
and the tracer falls back to its Python wrappers. `hook_process_groups` wraps each backend as torch
registers it with a process group, so every collective and point-to-point op reaching the group
passes through the wrapper.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d

from megatrace.tracer import format as ring_format

log = logging.getLogger("megatrace.tracer")
SOURCE = Path(__file__).with_name("csrc") / "capture.cpp"
MODULE_NAME = "megatrace_capture"
HEADER_NAME = "ring_format.h"
# Backends whose Work completes on the host when wait() returns; others (nccl, xccl) complete when
# their device work does, which only Work.is_completed() tells.
HOST_COMPLETION_BACKENDS = frozenset({"gloo", "mpi", "ucc", "fake", "held"})

load_error = ""
_module: ModuleType | None = None
_loaded = False


def build_dir() -> Path:
    """Where the extension for this source, ring layout, torch and Python is built (MEGATRACE_NATIVE_DIR
    overrides)."""
    key = hashlib.sha256(SOURCE.read_bytes() + ring_format.cpp_header().encode()).hexdigest()[:12]
    tag = f"{key}-torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
    root = (
        os.environ.get("MEGATRACE_NATIVE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatrace" / "native"
    )
    return Path(root) / tag.replace("+", "_")


def library_path() -> Path:
    return build_dir() / f"{MODULE_NAME}.so"


def build(verbose: bool = False) -> Path:
    """Compile the extension (g++ and ninja through torch.utils.cpp_extension); returns the library."""
    from torch.utils.cpp_extension import load as load_extension

    target = build_dir()
    target.mkdir(parents=True, exist_ok=True)
    (target / HEADER_NAME).write_text(ring_format.cpp_header())
    load_extension(
        name=MODULE_NAME,
        sources=[str(SOURCE)],
        build_directory=str(target),
        extra_include_paths=[str(target)],
        extra_cflags=["-O2", "-fvisibility=hidden"],
        verbose=verbose,
    )
    return library_path()


def layout_differences(module: ModuleType) -> list[str]:
    """The names whose value in the library's ``layout()`` differs from `megatrace.tracer.format`'s
    (every constant, op and dtype code, and the compiled record's field offsets), or that only one has."""
    native = module.layout()
    expected = ring_format.native_layout()
    return sorted(name for name in native.keys() | expected.keys() if native.get(name) != expected.get(name))


def _layout_matches(module: ModuleType) -> str:
    """'' when the library writes the ring layout this Python reads, else what differs."""
    wrong = layout_differences(module)
    return f"ring layout differs in {', '.join(wrong)}" if wrong else ""


def load(wanted: bool = True, build_missing: bool = False) -> ModuleType | None:
    """The native module, or None (reason in `load_error`); `wanted` False (MEGATRACE_TRACE_NATIVE=0)
    turns it off. With `build_missing` (tests, the bench) a missing library is built first."""
    global _module, _loaded, load_error
    if not wanted:
        load_error = "turned off by MEGATRACE_TRACE_NATIVE=0"
        return None
    if _loaded and (_module is not None or not build_missing):
        return _module
    _loaded = True
    try:
        path = library_path()
        if build_missing and not path.exists():
            build()
        if not path.exists():
            load_error = f"not built for this torch ({path} missing; run `make native`)"
            return None
        loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
        if spec is None:
            load_error = f"cannot load {path}"
            return None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        load_error = _layout_matches(module)
        if load_error:
            return None
    except Exception as exc:  # a broken library must never stop the training job
        load_error = f"{type(exc).__name__}: {exc}"
        return None
    _module = module
    return module


def capture_description(wanted: bool = True) -> str:
    """One line saying which capture this process would use."""
    if load(wanted) is not None:
        return "native (every op reaching a process group, recorded by a c10d backend wrapper)"
    return f"python (wrappers of torch.distributed functions; native capture unavailable: {load_error})"


def _group_ranks(pg: Any) -> tuple[int, ...]:
    """Sorted global ranks of a process group torch knows."""
    return tuple(sorted(c10d._world.pg_group_ranks.get(pg, {}).keys()))


def hook_process_groups(module: ModuleType, on_group: Callable[[tuple[int, ...]], int]) -> Callable[[], None]:
    """Wrap the backends of every process group, those that exist now and those created from now on
    (split groups are wrapped by the wrapper itself); `on_group(ranks)` gives a group's communicator
    id and stores its members. Returns the function that gives every group its own backends back."""
    helper = c10d._new_process_group_helper
    host = sorted(HOST_COMPLETION_BACKENDS)

    def wrap(pg: Any, ranks: tuple[int, ...]) -> None:
        if not ranks or not isinstance(pg, torch._C._distributed_c10d.ProcessGroup):
            return
        try:
            module.wrap_group(pg, on_group(ranks), list(ranks), host)
        except Exception as exc:  # leave the group untraced rather than break it
            log.warning("megatrace tracer: process group of ranks %s not traced: %s", ranks, exc)

    def new_process_group_helper(group_size: int, group_rank: int, global_ranks_in_group: Any, *args: Any,
                                 **kwargs: Any) -> Any:  # fmt: skip
        result = helper(group_size, group_rank, global_ranks_in_group, *args, **kwargs)
        pg = result[0] if isinstance(result, tuple) else result
        wrap(pg, tuple(sorted(global_ranks_in_group or range(group_size))))
        return result

    new_process_group_helper.__wrapped__ = helper  # type: ignore[attr-defined]
    new_process_group_helper.__megatrace__ = True  # type: ignore[attr-defined]
    c10d._new_process_group_helper = new_process_group_helper
    module.set_comm_id_function(lambda ranks: on_group(tuple(sorted(ranks))))
    for pg in list(c10d._world.pg_map):
        wrap(pg, _group_ranks(pg))

    def unhook() -> None:
        if c10d._new_process_group_helper is new_process_group_helper:
            c10d._new_process_group_helper = helper
        module.set_comm_id_function(None)
        for pg in list(c10d._world.pg_map):
            if isinstance(pg, torch._C._distributed_c10d.ProcessGroup):
                module.unwrap_group(pg)

    return unhook


def main() -> int:
    """Build the extension; exit status 1 (and the reason) when it cannot be built."""
    try:
        path = build(verbose="-v" in sys.argv)
    except Exception as exc:
        print(f"megatrace: native capture not built: {exc}", file=sys.stderr)
        return 1
    print(f"megatrace: native capture built: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
