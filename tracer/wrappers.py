"""Wrappers around the `torch.distributed` collective and point-to-point functions.

Each wrapper is generated at install time with the original's own parameter list, reads the group,
buffer, root/peer and ``async_op`` from its parameters, records the op, calls the original and
records its completion: on return for synchronous calls, from the
Work's future for asynchronous ones (or from ``wait()`` on Works without a future, such as gloo's
point-to-point Works). Functions that only delegate to another wrapped function are left alone, so
every op is recorded once. This is the fallback capture, used where the native one cannot load;
with the native capture, `patch_fault_hooks` puts only the fault injection on these functions.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import logging
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

log = logging.getLogger("megatrace.tracer")
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


def _measure_list(tensors: Any) -> tuple[int, int]:
    """Total bytes and the (last) dtype code of a list of tensors; (0, 0) for None."""
    total = 0
    dtype = 0
    for tensor in tensors or ():
        if isinstance(tensor, torch.Tensor):
            total += tensor.nbytes
            dtype = DTYPE_OF.get(tensor.dtype, OTHER_DTYPE)
    return total, dtype


def _peer(ranks: tuple[int, ...], global_peer: Any, group_peer: Any) -> int:
    if isinstance(global_peer, int):
        return global_peer
    if isinstance(group_peer, int) and 0 <= group_peer < len(ranks):
        return ranks[group_peer]
    return -1


# The body of every wrapper. `make_wrapper` fills in the original's parameter list and, as plain
# names, where the group, the buffer, async_op and the peer are, so a call is bound by the
# interpreter like a call of the original: no *args/**kwargs to search, no per-call inspection.
# Names the body uses start with "mt_"; the original's parameters never do (checked).
_WRAPPER_TEMPLATE = """\
def traced({parameters}):
    mt_recorder = mt_tracer.recorder
    if mt_recorder is None:
        mt_recorder = mt_tracer.open_ring()
        if mt_recorder is None:
            return mt_original({arguments})
    mt_comm = mt_comms.get({group}, mt_missing)
    if mt_comm is mt_missing:
        mt_comm = mt_tracer.lookup_comm({group})
    if mt_comm is None:
        return mt_original({arguments})
    mt_nbytes, mt_dtype = {measure}
    mt_async = {is_async}
    mt_peer = {peer}
    if mt_tracer.faults is not None:
        mt_tracer.faults.before_call(mt_recorder.serial + 1, mt_recorder.step)
    mt_serial = mt_recorder.begin(
        mt_comm[0], mt_op, mt_nbytes, mt_dtype, mt_peer, mt_flag_async if mt_async else 0
    )
    try:
        mt_result = mt_original({arguments})
    except BaseException:
        mt_recorder.end(mt_serial)
        raise
    if mt_async:
        return mt_tracer.track_work(mt_result, mt_serial, mt_op)
    if mt_fill_peer and mt_peer < 0 and isinstance(mt_result, int):
        mt_recorder.writer.set_peer(mt_serial, mt_result)
    mt_recorder.end(mt_serial)
    return mt_result
"""
_PREFIX = "mt_"


class _Name(str):
    """A default value's stand-in that prints as the name it is bound to in the generated code."""

    def __repr__(self) -> str:
        return str(self)


def _parameter_lists(params: list[inspect.Parameter]) -> tuple[str, str, dict[str, Any]]:
    """(parameter list for the def, argument list passing each one on, default values by name)."""
    kind = inspect.Parameter
    declared: list[inspect.Parameter] = []
    passed: list[str] = []
    defaults: dict[str, Any] = {}
    for index, param in enumerate(params):
        if param.name.startswith(_PREFIX):
            raise ValueError(f"parameter {param.name!r} clashes with the wrapper's own names")
        default = param.default
        if default is not kind.empty:
            default = _Name(f"{_PREFIX}default_{index}")
            defaults[str(default)] = param.default
        declared.append(param.replace(default=default, annotation=kind.empty))
        if param.kind is kind.VAR_POSITIONAL:
            passed.append(f"*{param.name}")
        elif param.kind is kind.VAR_KEYWORD:
            passed.append(f"**{param.name}")
        elif param.kind is kind.KEYWORD_ONLY:
            passed.append(f"{param.name}={param.name}")
        else:
            passed.append(param.name)
    return str(inspect.Signature(declared))[1:-1], ", ".join(passed), defaults


def make_wrapper(tracer: Tracer, original: Callable, spec: OpSpec) -> Callable:
    """A function with `original`'s signature that records each call through `tracer`.

    Generated once per function from `_WRAPPER_TEMPLATE`: a synchronous call costs the argument
    binding, one communicator-cache lookup, `Recorder.begin` and `Recorder.end` on top of the original.
    Raises ValueError for a signature the template cannot take.
    """
    params = list(inspect.signature(inspect.unwrap(original)).parameters.values())
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

    def arg(name: str | None) -> str:
        return name if name in named else "None"

    parameters, arguments, namespace = _parameter_lists(params)
    size = arg(spec.size_arg)
    if spec.size_arg is None:
        measure = "0, 0"
    elif spec.size_is_list:
        measure = f"mt_measure_list({size})"
    else:
        measure = f"(0, 0) if {size} is None else ({size}.nbytes, mt_dtype_of({size}.dtype, mt_other))"
    is_async = f"bool({arg('async_op')})" if spec.asynchronous is None else str(spec.asynchronous)
    peer = "-1"
    if spec.peer_args is not None:
        peer = f"mt_peer_of(mt_comm[1], {arg(spec.peer_args[0])}, {arg(spec.peer_args[1])})"
    source = _WRAPPER_TEMPLATE.format(
        parameters=parameters, arguments=arguments, group=arg("group"), measure=measure,
        is_async=is_async, peer=peer,
    )  # fmt: skip
    namespace.update(
        mt_tracer=tracer,
        mt_original=original,
        mt_comms=tracer.comms,
        mt_missing=_MISSING,
        mt_op=OP_CODES[spec.op],
        mt_flag_async=FLAG_ASYNC,
        mt_fill_peer=spec.op == "recv",
        mt_dtype_of=DTYPE_OF.get,
        mt_other=OTHER_DTYPE,
        mt_measure_list=_measure_list,
        mt_peer_of=_peer,
    )
    exec(compile(source, f"<megatrace wrapper of {original.__name__}>", "exec"), namespace)
    traced = namespace["traced"]
    traced.__wrapped__ = original
    traced.__name__ = original.__name__
    traced.__qualname__ = getattr(original, "__qualname__", original.__name__)
    traced.__doc__ = original.__doc__
    traced.__megatrace__ = True
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
    originals = {}
    for name, original in functions_to_wrap().items():
        try:
            wrapper = make_wrapper(tracer, original, OP_SPECS[name])
        except ValueError as exc:
            log.warning("megatrace tracer: %s not traced: %s", name, exc)
            continue
        originals[name] = original
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)
    return originals


def _fault_hook(tracer: Tracer, original: Callable) -> Callable:
    @functools.wraps(original)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        recorder = tracer.recorder
        if tracer.faults is not None and recorder is not None:
            tracer.faults.before_call(recorder.serial + 1, recorder.step)
        return original(*args, **kwargs)

    hooked.__megatrace__ = True  # type: ignore[attr-defined]
    return hooked


def patch_fault_hooks(tracer: Tracer) -> dict[str, Callable]:
    """With the native capture recording: hooks on the same functions that only apply the injected
    faults (a hang, a slow rank) before each op; returns the originals."""
    originals = {}
    for name, original in functions_to_wrap().items():
        originals[name] = original
        hooked = _fault_hook(tracer, original)
        setattr(c10d, name, hooked)
        if getattr(dist, name, None) is original:
            setattr(dist, name, hooked)
    return originals


def unpatch(originals: dict[str, Callable]) -> None:
    """Put the original functions back."""
    for name, original in originals.items():
        if getattr(getattr(c10d, name, None), "__megatrace__", False):
            setattr(c10d, name, original)
        if getattr(getattr(dist, name, None), "__megatrace__", False):
            setattr(dist, name, original)
