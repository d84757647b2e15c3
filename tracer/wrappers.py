"""Wrappers around the `torch.distributed` collective and point-to-point functions.

Each wrapper reads the group, buffer, root/peer and ``async_op`` from the call's arguments, records
the op, calls the original and records its completion: on return for synchronous calls, from the
Work's future for asynchronous ones (or from ``wait()`` on Works without a future, such as gloo's
point-to-point Works). Functions that only delegate to another wrapped function are left alone, so
every op is recorded once.
"""

from __future__ import annotations

import dataclasses
import dis
import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatrace.tracer.ringfile import DTYPE_CODES, FLAG_ASYNC, OP_CODES

if TYPE_CHECKING:
    from megatrace.tracer.recorder import Recorder
    from megatrace.tracer.runtime import Tracer

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """How to read one torch.distributed function's call: what op it is and where its arguments are."""

    op: str
    size_arg: str | None
    size_is_list: bool = False
    peer_args: tuple[str, str] | None = None
    asynchronous: bool | None = None  # None: from the async_op argument


_P2P_SEND = ("dst", "group_dst")
_P2P_RECV = ("src", "group_src")
OP_SPECS: dict[str, OpSpec] = {
    "all_reduce": OpSpec("all_reduce", "tensor"),
    "all_reduce_coalesced": OpSpec("all_reduce", "tensors", size_is_list=True),
    "broadcast": OpSpec("broadcast", "tensor", peer_args=_P2P_RECV),
    "reduce": OpSpec("reduce", "tensor", peer_args=_P2P_SEND),
    "all_gather": OpSpec("all_gather", "tensor"),
    "all_gather_single": OpSpec("all_gather", "input_tensor"),
    "all_gather_into_tensor": OpSpec("all_gather", "input_tensor"),
    "_all_gather_base": OpSpec("all_gather", "input_tensor"),
    "all_gather_coalesced": OpSpec("all_gather", "input_tensor_list", size_is_list=True),
    "gather": OpSpec("gather", "tensor", peer_args=_P2P_SEND),
    "scatter": OpSpec("scatter", "tensor", peer_args=_P2P_RECV),
    "reduce_scatter": OpSpec("reduce_scatter", "output"),
    "reduce_scatter_single": OpSpec("reduce_scatter", "output"),
    "reduce_scatter_tensor": OpSpec("reduce_scatter", "output"),
    "_reduce_scatter_base": OpSpec("reduce_scatter", "output"),
    "all_to_all": OpSpec("all_to_all", "input_tensor_list", size_is_list=True),
    "all_to_all_single": OpSpec("all_to_all", "input"),
    "barrier": OpSpec("barrier", None),
    "send": OpSpec("send", "tensor", peer_args=_P2P_SEND, asynchronous=False),
    "recv": OpSpec("recv", "tensor", peer_args=_P2P_RECV, asynchronous=False),
    "isend": OpSpec("send", "tensor", peer_args=_P2P_SEND, asynchronous=True),
    "irecv": OpSpec("recv", "tensor", peer_args=_P2P_RECV, asynchronous=True),
}

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
    "float8_e5m2": getattr(torch, "float8_e5m2", None),
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
DTYPE_OF: dict[torch.dtype, int] = {
    dt: DTYPE_CODES[name] for name, dt in _TORCH_DTYPES.items() if dt is not None
}
OTHER_DTYPE = DTYPE_CODES["other"]


class TracedWork(dist.Work):
    """A Work without a future (gloo point-to-point): records completion when waited on or seen done."""

    def __init__(self, inner: dist.Work, recorder: Recorder, serial: int) -> None:
        super().__init__()
        self._inner = inner
        self._recorder = recorder
        self._serial = serial

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        ok = self._inner.wait(timeout)
        self._recorder.end(self._serial)
        return ok

    def is_completed(self) -> bool:
        done = self._inner.is_completed()
        if done:
            self._recorder.end(self._serial)
        return done

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def _source_rank(self) -> int:
        return self._inner._source_rank()

    def result(self) -> list[torch.Tensor]:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def get_future(self) -> torch.futures.Future:
        return self._inner.get_future()


def _measure(value: Any, is_list: bool) -> tuple[int, int]:
    if value is None:
        return 0, 0
    if is_list:
        total = 0
        dtype = 0
        for tensor in value:
            if isinstance(tensor, torch.Tensor):
                total += tensor.nbytes
                dtype = DTYPE_OF.get(tensor.dtype, OTHER_DTYPE)
        return total, dtype
    return value.nbytes, DTYPE_OF.get(value.dtype, OTHER_DTYPE)


def _position(params: list[inspect.Parameter], name: str | None) -> tuple[int, Any]:
    for index, param in enumerate(params):
        if param.name == name:
            default = None if param.default is inspect.Parameter.empty else param.default
            return index, default
    return 1 << 30, None


def _peer(ranks: tuple[int, ...], global_peer: Any, group_peer: Any) -> int:
    if isinstance(global_peer, int):
        return global_peer
    if isinstance(group_peer, int) and 0 <= group_peer < len(ranks):
        return ranks[group_peer]
    return -1


def make_wrapper(tracer: Tracer, original: Callable, spec: OpSpec) -> Callable:
    """A function with `original`'s signature that records each call through `tracer`."""
    params = list(inspect.signature(inspect.unwrap(original)).parameters.values())
    group_at, group_default = _position(params, "group")
    size_at, _ = _position(params, spec.size_arg)
    size_name = spec.size_arg
    async_at, _ = _position(params, "async_op")
    peer_name, group_peer_name = spec.peer_args or (None, None)
    peer_at, _ = _position(params, peer_name)
    group_peer_at, _ = _position(params, group_peer_name)
    op = OP_CODES[spec.op]
    is_list = spec.size_is_list
    fixed_async = spec.asynchronous
    has_peer = spec.peer_args is not None
    is_recv = spec.op == "recv"
    comms = tracer.comms

    def traced(*args: Any, **kwargs: Any) -> Any:
        recorder = tracer.recorder
        if recorder is None:
            recorder = tracer.open_ring()
            if recorder is None:
                return original(*args, **kwargs)
        n = len(args)
        group = args[group_at] if n > group_at else kwargs.get("group", group_default)
        comm = comms.get(group, _MISSING)
        if comm is _MISSING:
            comm = tracer.lookup_comm(group)
        if comm is None:
            return original(*args, **kwargs)
        size = args[size_at] if n > size_at else kwargs.get(size_name)
        nbytes, dtype = _measure(size, is_list) if size_name is not None else (0, 0)
        if fixed_async is None:
            is_async = bool(args[async_at] if n > async_at else kwargs.get("async_op", False))
        else:
            is_async = fixed_async
        peer = -1
        if has_peer:
            peer = _peer(
                comm[1],
                args[peer_at] if n > peer_at else kwargs.get(peer_name),
                args[group_peer_at] if n > group_peer_at else kwargs.get(group_peer_name),
            )
        if tracer.faults is not None:
            tracer.faults.before_call(recorder.calls + 1, recorder.step)
        serial = recorder.begin(comm[0], op, nbytes, dtype, peer, FLAG_ASYNC if is_async else 0)
        try:
            result = original(*args, **kwargs)
        except BaseException:
            recorder.end(serial)
            raise
        if is_async:
            return tracer.track_work(result, serial, op)
        if is_recv and peer < 0 and isinstance(result, int):
            recorder.writer.set_peer(serial, result)
        recorder.end(serial)
        return result

    traced.__wrapped__ = original  # type: ignore[attr-defined]
    traced.__name__ = original.__name__
    traced.__qualname__ = getattr(original, "__qualname__", original.__name__)
    traced.__doc__ = original.__doc__
    traced.__megatrace__ = True  # type: ignore[attr-defined]
    return traced


def functions_to_wrap() -> dict[str, Callable]:
    """The c10d functions to wrap in this torch version, minus those that only delegate to another."""
    present = {name: getattr(c10d, name) for name in OP_SPECS if callable(getattr(c10d, name, None))}
    return {
        name: function
        for name, function in present.items()
        if not (_globals_used(function) & (present.keys() - {name}))
    }


def _globals_used(function: Callable) -> set[str]:
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        return set()
    return {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}


def patch(tracer: Tracer) -> dict[str, Callable]:
    """Replace the functions in torch.distributed and its c10d module; returns the originals."""
    originals = functions_to_wrap()
    for name, original in originals.items():
        wrapper = make_wrapper(tracer, original, OP_SPECS[name])
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)
    return originals


def unpatch(originals: dict[str, Callable]) -> None:
    """Put the original functions back."""
    for name, original in originals.items():
        if getattr(getattr(c10d, name, None), "__megatrace__", False):
            setattr(c10d, name, original)
        if getattr(getattr(dist, name, None), "__megatrace__", False):
            setattr(dist, name, original)
