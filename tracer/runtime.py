"""The tracer inside a training process: install/uninstall, ring opening, steps, Work tracking.

`install()`, when tracing is enabled (and nothing otherwise), captures ops at the process-group layer
through the native backend wrapper (`megatrace.tracer.native`), or, where that cannot load, through
Python wrappers of torch.distributed (one log line says so). The ring file opens once the default
process group exists, and the watchdog starts with it.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatrace.config import ConfigError
from megatrace.tracer import native, wrappers
from megatrace.tracer.faults import FaultPlan
from megatrace.tracer.gc_spans import GcSpans
from megatrace.tracer.host_signals import HostSampler
from megatrace.tracer.pause_hooks import PauseHooks
from megatrace.tracer.pauses import Pauses
from megatrace.tracer.recorder import NativeRecorder, Recorder
from megatrace.tracer.ringfile import W_FINISHED, RankIdentity, RingWriter, comm_id, ring_path
from megatrace.tracer.settings import (
    FaultSettings,
    TraceSettings,
    fault_settings,
    job_trace_dir,
    trace_settings,
)
from megatrace.tracer.watchdog import Watchdog

log = logging.getLogger("megatrace.tracer")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")


def _local_rank() -> int:
    for name in _LOCAL_RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return -1


def _cuda_device() -> tuple[int, str]:
    """(index, UUID) of this process's current CUDA device; (-1, "") without one."""
    try:
        if not torch.cuda.is_available():
            return -1, ""
        index = torch.cuda.current_device()
        return index, str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    except Exception:  # a broken CUDA setup must not stop tracing
        return -1, ""


class Tracer:
    """Tracing state of this process: settings, the open ring, communicator ids, faults, watchdog."""

    def __init__(self, settings: TraceSettings, faults: FaultSettings) -> None:
        self.settings = settings
        self.fault_settings = faults
        self.recorder: Recorder | NativeRecorder | None = None
        self.native: Any = None
        self.native_comms: dict[tuple[int, ...], int] = {}
        self._unhook: Callable[[], None] | None = None
        self.faults: FaultPlan | None = None
        self.watchdog: Watchdog | None = None
        self.comms: dict[Any, tuple[int, tuple[int, ...]] | None] = {}
        self.futureless: set[int] = set()
        self.explicit_steps = False
        self.originals: dict[str, Callable] = {}
        job_dir, why = job_trace_dir(settings.dir, settings.job)
        if job_dir is None:
            raise OSError(
                f"neither {settings.dir}/{settings.job} nor a temp-dir fallback can be written ({why})"
            )
        if why:
            print(
                f"megatrace tracer: WARNING: {settings.dir}/{settings.job} cannot be used ({why}); tracing "
                f"into {job_dir} instead, where the node agent does not look",
                file=sys.stderr,
                flush=True,
            )
        self.job_dir = job_dir
        self.disabled = False  # set when the ring cannot be opened: the rank then runs untraced
        self._open_lock = threading.Lock()
        self._step_hook: Any = None
        self.pauses = Pauses(lambda: self.recorder)
        self.pause_hooks: PauseHooks | None = None
        self.gc_spans = GcSpans(lambda: self.recorder, settings.gc_span_ms * 1_000_000)

    @property
    def capture(self) -> str:
        """ "native" or "python": how this process captures ops."""
        return "native" if self.native is not None else "python"

    def start_native(self, module: Any) -> None:
        """Capture at the process-group layer through the native module from now on."""
        self.native = module
        self._unhook = native.hook_process_groups(module, self.native_comm)

    def native_comm(self, ranks: tuple[int, ...]) -> int:
        """Communicator id of a group of global ranks; its members go to the ring's table."""
        cid = comm_id(ranks)
        if ranks not in self.native_comms:
            self.native_comms[ranks] = cid
            if self.recorder is not None:
                self._store_members(cid, ranks)
        return cid

    def _store_members(self, cid: int, ranks: tuple[int, ...]) -> None:
        assert self.recorder is not None
        if not self.recorder.writer.add_communicator(cid, ranks):
            log.warning("megatrace tracer: communicator table full; members of %x not stored", cid)

    def open_ring(self) -> Recorder | NativeRecorder | None:
        """Open this rank's ring file once the default process group exists; the recorder or None.
        A ring that cannot be created (full or read-only filesystem) leaves the rank untraced, said
        once on stderr: tracing never stops training."""
        if self.recorder is not None or self.disabled or not dist.is_initialized():
            return self.recorder
        try:
            return self._open_ring()
        except OSError as exc:
            self.disabled = True
            where = exc.filename or self.job_dir
            print(
                f"megatrace tracer: not tracing this rank: cannot create its ring file in {where}: "
                f"{exc.strerror or exc}",
                file=sys.stderr,
                flush=True,
            )
            return None

    def _open_ring(self) -> Recorder | NativeRecorder | None:
        with self._open_lock:
            if self.recorder is not None:
                return self.recorder
            rank = dist.get_rank()
            identity = RankIdentity(
                job=self.settings.job,
                rank=rank,
                local_rank=_local_rank(),
                world_size=dist.get_world_size(),
                host=socket.gethostname(),
                pid=os.getpid(),
                start_time_ns=time.time_ns(),
            )
            stall_ns = self.settings.stall_ms * 1_000_000
            writer = RingWriter(
                ring_path(self.job_dir, rank), identity, self.settings.capacity, stall_threshold_ns=stall_ns
            )
            if self.native is not None:
                try:
                    self.native.attach(str(writer.path))
                except Exception as exc:  # not seen with a build that passed the layout check
                    native.load_error = f"cannot record into the ring: {exc}"
                    self._fall_back_to_python()
            writer.set_capture(self.capture)
            writer.set_device(*_cuda_device())
            recorder: Recorder | NativeRecorder
            recorder = NativeRecorder(writer, rank, self.native) if self.native else Recorder(writer, rank)
            plan = FaultPlan(self.fault_settings, rank)
            self.faults = plan if plan.active else None
            sample_ns = self.settings.host_sample_ms * 1_000_000
            sampler = HostSampler(writer, sample_ns) if sample_ns else None
            self.watchdog = Watchdog(
                recorder, self.job_dir, rank, stall_ns, sampler, self.settings.stacks_fallback
            )
            self.watchdog.start_thread()
            self._register_step_hook()
            self.recorder = recorder
            self.gc_spans.install()
            for ranks, cid in self.native_comms.items():
                self._store_members(cid, ranks)
            if self.native is None:
                log.warning(
                    "megatrace tracer: rank %d: native capture unavailable (%s); tracing the Python "
                    "functions of torch.distributed instead",
                    rank,
                    native.load_error,
                )
            log.info("megatrace tracer: rank %d records to %s (%s capture)", rank, writer.path, self.capture)
        return self.recorder

    def lookup_comm(self, group: Any) -> tuple[int, tuple[int, ...]] | None:
        """(comm id, member global ranks) of `group`, cached; None where this rank is not a member."""
        try:
            if group is None or group is dist.GroupMember.WORLD:
                ranks = tuple(range(dist.get_world_size()))
            elif group is dist.GroupMember.NON_GROUP_MEMBER:
                ranks = ()
            else:
                ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        except (RuntimeError, ValueError):
            ranks = ()
        if not ranks or self.recorder is None:
            entry = None
        else:
            cid = comm_id(ranks)
            entry = (cid, ranks)
            if not self.recorder.writer.add_communicator(cid, ranks):
                log.warning("megatrace tracer: communicator table full; members of %x not stored", cid)
        self.comms[group] = entry
        return entry

    def track_work(self, work: Any, serial: int, op: int) -> Any:
        """Arrange for the completion of an async op's Work to be recorded; returns what to hand back."""
        recorder = self.recorder
        if work is None or recorder is None:
            if recorder is not None:
                recorder.end(serial)
            return work
        if op not in self.futureless:
            try:
                future = work.get_future()
            except RuntimeError:
                self.futureless.add(op)
            else:
                future.add_done_callback(lambda _done: recorder.end(serial))
                return work
        return wrappers.TracedWork(work, recorder, serial)

    def mark_step(self, explicit: bool) -> None:
        """A training step ended; explicit marks switch automatic detection off."""
        if explicit:
            self.explicit_steps = True
        elif self.explicit_steps:
            return
        if self.recorder is not None:
            self.recorder.mark_step()
        if self.pause_hooks is not None:
            self.pause_hooks.end_eval()

    def _register_step_hook(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._step_hook = register_optimizer_step_post_hook(lambda *_: self.mark_step(explicit=False))

    def forget_comms(self) -> None:
        self.comms.clear()

    def at_exit(self) -> None:
        """Flag a clean exit (no uncaught exception), stop counting garbage collections, write the exit
        dump, stop the watchdog, and stop the native capture before the interpreter is torn down: a Work
        its completion thread released during finalization would take the GIL from a dying interpreter,
        which aborts the process."""
        self.gc_spans.uninstall()  # the interpreter's teardown collections are no training time
        recorder = self.recorder
        if recorder is not None:
            if getattr(sys, "last_value", None) is None:
                recorder.header[W_FINISHED] = 1
            if self.watchdog is not None:
                self.watchdog.stop()
                self.watchdog.dump("exit")
        self.stop_native()

    def _fall_back_to_python(self) -> None:
        self.stop_native()
        fault_hooks = {
            name: self.originals.pop(name) for name in list(self.originals) if name in wrappers.OP_SPECS
        }
        wrappers.unpatch(fault_hooks)
        self.originals.update(wrappers.patch(self))

    def stop_native(self) -> None:
        """Give every process group its own backends back and stop the native recording."""
        if self._unhook is not None:
            self._unhook()
            self._unhook = None
        if self.native is not None:
            self.native.detach()
            self.native = None

    def close(self) -> None:
        """Stop the watchdog, drop the step and GC hooks and unmap the ring (tests and benchmarks)."""
        self.gc_spans.uninstall()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self._step_hook is not None:
            self._step_hook.remove()
        self.stop_native()
        if self.recorder is not None:
            self.recorder.publish()
            self.recorder.writer.close()
        self.recorder = None


_tracer: Tracer | None = None
_install_lock = threading.Lock()


def _wrap_lifecycle(tracer: Tracer) -> None:
    init, destroy = c10d.init_process_group, c10d.destroy_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = init(*args, **kwargs)
        tracer.forget_comms()
        tracer.open_ring()
        return result

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        tracer.forget_comms()
        return destroy(*args, **kwargs)

    for name, wrapper, original in (
        ("init_process_group", init_process_group, init),
        ("destroy_process_group", destroy_process_group, destroy),
    ):
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__doc__ = original.__doc__
        wrapper.__megatrace__ = True  # type: ignore[attr-defined]
        tracer.originals[name] = original
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)


def install(settings: TraceSettings | None = None, faults: FaultSettings | None = None) -> bool:
    """Start tracing this process if enabled (settings from the environment by default).

    Returns whether the tracer is installed. Disabled means nothing is patched. Bad settings are
    reported on stderr and leave the process untraced: tracing never stops a training job.
    """
    global _tracer
    with _install_lock:
        if _tracer is not None:
            return True
        try:
            settings = trace_settings() if settings is None else settings
            faults = fault_settings() if faults is None else faults
        except ConfigError as exc:
            print(f"megatrace tracer: not tracing, bad configuration: {exc}", file=sys.stderr, flush=True)
            return False
        if not settings.enable or not dist.is_available():
            return False
        try:
            tracer = Tracer(settings, faults)
        except OSError as exc:
            print(f"megatrace tracer: not tracing: {exc}", file=sys.stderr, flush=True)
            return False
        module = native.load(settings.native)
        if module is not None:
            tracer.start_native(module)
            if faults.hang_rank >= 0 or faults.slow_rank >= 0:
                tracer.originals.update(wrappers.patch_fault_hooks(tracer))
        else:
            tracer.originals.update(wrappers.patch(tracer))
        _wrap_lifecycle(tracer)
        tracer.pause_hooks = PauseHooks(tracer.pauses)
        atexit.register(tracer.at_exit)
        _tracer = tracer
        tracer.open_ring()
        return True


def uninstall() -> None:
    """Restore torch.distributed and close the ring (the ring file stays on disk)."""
    global _tracer
    with _install_lock:
        tracer, _tracer = _tracer, None
        if tracer is None:
            return
        atexit.unregister(tracer.at_exit)
        if tracer.pause_hooks is not None:
            tracer.pause_hooks.uninstall()
        wrappers.unpatch(tracer.originals)
        tracer.close()


def mark_step() -> None:
    """Mark the end of a training step (switches automatic optimizer-step detection off)."""
    if _tracer is not None:
        _tracer.mark_step(explicit=True)


def current() -> Tracer | None:
    """The installed tracer, if any."""
    return _tracer
