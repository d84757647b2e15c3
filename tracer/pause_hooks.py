"""Where the tracer marks known pauses without any change to the training script.

- checkpoint: calls of `torch.save` and of `torch.distributed.checkpoint`'s `save`, `save_state_dict`,
  `load`, `load_state_dict` and `async_save` (its synchronous part). The checkpoint package is patched
  when it is imported (importing it at install would cost every process about a second);
- eval: from an outermost `Module.train(False)` (what `.eval()` calls; `train` recurses into the
  children, which do not count) that switches a module out of training mode, to the next outermost
  `train(True)` on that module, or to the end of the next training step, whichever comes first (a
  frozen model put in eval mode once, e.g. a reference or teacher model, must not keep the rank "in a
  pause" for the whole run). Grad mode (`no_grad`) is not looked at;
- dataloader: while the main thread waits in `next()` on a `torch.utils.data.DataLoader` iterator.

`install(pauses)` patches and returns the function that puts everything back.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.utils.data.dataloader as dataloader

from megatrace.tracer.pauses import Pauses

CHECKPOINT_PACKAGE = "torch.distributed.checkpoint"
CHECKPOINT_FUNCTIONS = ("save", "save_state_dict", "load", "load_state_dict", "async_save")


class _Patches:
    """Attributes replaced so far, to put back in reverse order."""

    def __init__(self) -> None:
        self.replaced: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, name: str, value: Any) -> None:
        self.replaced.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self.replaced:
            owner, name, original = self.replaced.pop()
            setattr(owner, name, original)


def _in_pause(pauses: Pauses, kind: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def paused(*args: Any, **kwargs: Any) -> Any:
        token = pauses.begin(kind)
        try:
            return original(*args, **kwargs)
        finally:
            pauses.end(token)

    paused.__megatrace__ = True  # type: ignore[attr-defined]
    return paused


def _patch_checkpoint_package(pauses: Pauses, patches: _Patches, package: ModuleType) -> None:
    """Wrap the package's save/load functions where the package and their defining modules hold them."""
    for name in CHECKPOINT_FUNCTIONS:
        original = getattr(package, name, None)
        if original is None or getattr(original, "__megatrace__", False):
            continue
        wrapped = _in_pause(pauses, "checkpoint", original)
        patches.replace(package, name, wrapped)
        home = sys.modules.get(getattr(original, "__module__", "") or "")
        if home is not None and home is not package and getattr(home, name, None) is original:
            patches.replace(home, name, wrapped)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; runs `then(module)` once `name` has been imported."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None):  # type: ignore[override]
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            self.then(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _patch_train(pauses: Pauses, patches: _Patches) -> Callable[[], None]:
    """Patch `Module.train`; returns the function that ends every eval pause (at a step's end)."""
    original = torch.nn.Module.train
    local = threading.local()
    in_eval: dict[int, int | None] = {}  # id of a module switched to eval -> its pause token
    lock = threading.Lock()

    @functools.wraps(original)
    def train(self: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
        depth = getattr(local, "depth", 0)
        if depth == 0:
            key = id(self)
            with lock:
                if not mode and self.training and key not in in_eval:
                    in_eval[key] = pauses.begin("eval")
                elif mode and key in in_eval:
                    pauses.end(in_eval.pop(key))
        local.depth = depth + 1
        try:
            return original(self, mode)
        finally:
            local.depth = depth

    def end_all() -> None:
        with lock:
            for token in in_eval.values():
                pauses.end(token)
            in_eval.clear()

    patches.replace(torch.nn.Module, "train", train)
    return end_all


def _patch_dataloader(pauses: Pauses, patches: _Patches) -> None:
    iterator = dataloader._BaseDataLoaderIter
    original = iterator.__next__
    main = threading.main_thread().ident

    @functools.wraps(original)
    def __next__(self: Any) -> Any:
        if threading.get_ident() != main:
            return original(self)
        token = pauses.begin("dataloader")
        try:
            return original(self)
        finally:
            pauses.end(token)

    patches.replace(iterator, "__next__", __next__)


class PauseHooks:
    """The installed hooks: `end_eval` ends the eval pauses (a training step ended), `uninstall` undoes."""

    def __init__(self, pauses: Pauses) -> None:
        self.pauses = pauses
        self._patches = _Patches()
        self._finder: _AfterImport | None = None
        for owner in (torch, torch.serialization):
            if getattr(owner, "save", None) is not None and not getattr(owner.save, "__megatrace__", False):
                self._patches.replace(owner, "save", _in_pause(pauses, "checkpoint", owner.save))
        self.end_eval = _patch_train(pauses, self._patches)
        _patch_dataloader(pauses, self._patches)
        package = sys.modules.get(CHECKPOINT_PACKAGE)
        if package is not None:
            _patch_checkpoint_package(pauses, self._patches, package)
        else:
            self._finder = _AfterImport(CHECKPOINT_PACKAGE, self._checkpoint_imported)
            sys.meta_path.insert(0, self._finder)

    def _checkpoint_imported(self, package: ModuleType) -> None:
        self._finder = None
        _patch_checkpoint_package(self.pauses, self._patches, package)

    def uninstall(self) -> None:
        """Put every patched function back."""
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None
        self._patches.undo()
