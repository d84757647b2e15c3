"""Cost of the tracer: ns added per traced call vs the same bare gloo collective, and its parts.

``python bench/bench_tracer.py [--calls N] [--rounds R] [--no-callgrind]`` runs a world-size-2 gloo
job on the CPU with tiny tensors. Each round times N bare ``all_reduce`` calls, then N traced by the
native capture, then N traced by the Python fallback (tracer installed in the same processes),
alternating so drift hits all; the figure is the median over rounds of (traced - bare) / N. Because
a gloo call's own jitter can dwarf the tracer, each capture is also measured alone: the native one
in a C++ loop of all-reduces on a backend that completes at once, bare and wrapped; the Python one as
its wrapper around a no-op with all_reduce's signature and its record path (begin + end, no torch).
The new spans and samples are measured alone too: the `gc.callbacks` hook per collection (counted only,
and counted plus a GC span record, through the Python recorder and the native one), and one host sample
(reading the rank's /proc and cgroup files and writing the header slot; the watchdog thread's cost).
Then valgrind's callgrind counts instructions: per op on the issuing thread (inclusive cost of the
bare and the wrapped C++ loop, same run), and on the completion thread. Wall and CPU (thread) time are
both given: on a shared machine wall time includes time spent preempted. Prints figures; not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatrace.tracer import native, runtime, wrappers
from megatrace.tracer.gc_spans import GcSpans
from megatrace.tracer.host_signals import HostSampler
from megatrace.tracer.recorder import NativeRecorder, Recorder
from megatrace.tracer.ringfile import DTYPE_CODES, OP_CODES, RankIdentity, RingWriter, comm_id
from megatrace.tracer.settings import FaultSettings, TraceSettings


def _per_call(calls: int, run) -> tuple[float, float]:
    """(wall, CPU) ns per call of `run()` doing `calls` calls; CPU time is this thread's, so time the
    thread spends preempted on a loaded machine does not count."""
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    run()
    return (time.perf_counter_ns() - wall) / calls, (time.thread_time_ns() - cpu) / calls


def _summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    walls, cpus = [s[0] for s in samples], [s[1] for s in samples]
    return {"wall": statistics.median(walls), "cpu": statistics.median(cpus), "cpu_min": min(cpus)}


def record_path_ns(calls: int, trace_dir: Path) -> dict[str, float]:
    """ns of one begin+end pair on a ring file (what a traced call adds besides argument reading)."""
    identity = RankIdentity("bench", 0, 0, 1, "localhost", os.getpid(), time.time_ns())
    writer = RingWriter(trace_dir / "record-path.trace", identity, capacity=65536)
    recorder = Recorder(writer, rank=0)
    cid = comm_id([0, 1])
    op, dtype = OP_CODES["all_reduce"], DTYPE_CODES["float32"]

    def run() -> None:
        for _ in range(calls):
            recorder.end(recorder.begin(cid, op, 16, dtype, -1, 0))

    samples = [_per_call(calls, run) for _ in range(9)]
    writer.close()
    return _summary(samples)


def _noop_all_reduce(tensor, op=None, group=None, async_op=False):
    return None


def wrapper_path_ns(calls: int, tensor: torch.Tensor) -> dict[str, float]:
    """ns added per call by the wrapper around a no-op with all_reduce's signature: the whole
    traced-call overhead (argument binding, communicator lookup, record, completion) without network
    noise. Bare and traced batches alternate; the figures are traced minus bare."""
    tracer = runtime.current()
    assert tracer is not None
    traced = wrappers.make_wrapper(tracer, _noop_all_reduce, wrappers.OP_SPECS["all_reduce"])

    def bare_run() -> None:
        for _ in range(calls):
            _noop_all_reduce(tensor)

    def traced_run() -> None:
        for _ in range(calls):
            traced(tensor)

    added = []
    for _ in range(9):
        bare = _per_call(calls, bare_run)
        added.append(tuple(t - b for t, b in zip(_per_call(calls, traced_run), bare, strict=True)))
    return _summary(added)


def _timed(calls: int, tensor: torch.Tensor) -> int:
    dist.barrier()
    start = time.perf_counter_ns()
    for _ in range(calls):
        dist.all_reduce(tensor)
    return time.perf_counter_ns() - start


def _worker(rank: int, port: int, calls: int, rounds: int, trace_dir: str, results: dict) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    tensor = torch.ones(4)
    settings = {
        capture: TraceSettings(
            enable=True,
            dir=trace_dir,
            job="bench",
            stall_ms=600_000,
            capacity=65536,
            native=capture == "native",
        )
        for capture in ("native", "python")
    }
    _timed(calls // 10 + 1, tensor)
    times: dict[str, list[float]] = {"bare": [], "native": [], "python": []}
    for _ in range(rounds):
        times["bare"].append(_timed(calls, tensor) / calls)
        for capture in ("native", "python"):
            runtime.install(settings[capture], FaultSettings())
            tracer = runtime.current()
            assert tracer is not None and tracer.capture == capture, native.load_error
            times[capture].append(_timed(calls, tensor) / calls)
            runtime.uninstall()
    if rank == 0:
        runtime.install(settings["python"], FaultSettings())
        results["noop"] = wrapper_path_ns(calls, tensor)
        runtime.uninstall()
        for key, values in times.items():
            results[key] = statistics.median(values)
        for capture in ("native", "python"):
            pairs = zip(times[capture], times["bare"], strict=True)
            results[f"added_{capture}"] = statistics.median(t - b for t, b in pairs)
    dist.destroy_process_group()


def native_loop_ns(module, calls: int, trace_dir: Path) -> dict[str, float]:
    """CPU ns per all-reduce + wait in a C++ loop, on a backend whose Works complete at once, bare and
    wrapped by the native capture (recording into a real ring); alternating batches, median of 9."""
    identity = RankIdentity("bench", 0, 0, 2, "localhost", os.getpid(), time.time_ns())
    writer = RingWriter(trace_dir / "native-loop.trace", identity, capacity=65536)
    module.attach(str(writer.path))
    backend, release = module.held_backend(0, 2)
    release()
    traced = module.wrap(backend, comm_id([0, 1]), [0, 1], False)
    tensor = torch.ones(4)
    bare, wrapped = [], []
    try:
        for _ in range(9):
            bare.append(module.bench_bare_ops(backend, tensor, calls))
            wrapped.append(module.bench_traced_ops(traced, tensor, calls))
    finally:
        module.detach()
        writer.close()
    return {
        "bare": statistics.median(bare),
        "traced": statistics.median(wrapped),
        "added": statistics.median(t - b for t, b in zip(wrapped, bare, strict=True)),
        "added_min": min(wrapped) - min(bare),
    }


def gc_hook_ns(module, calls: int, trace_dir: Path) -> dict[str, dict[str, float]]:
    """CPU ns the GC hook adds per collection (its start and stop callbacks, as the collector calls
    them): counting only, and counting plus writing a GC span through each recorder. Median of 9."""
    identity = RankIdentity("bench", 0, 0, 1, "localhost", os.getpid(), time.time_ns())
    writer = RingWriter(trace_dir / "gc-hook.trace", identity, capacity=65536)
    module.attach(str(writer.path))
    recorders = {"python": Recorder(writer, rank=0), "native": NativeRecorder(writer, 0, module)}
    info = {"generation": 0, "collected": 12, "uncollectable": 0}
    figures = {}
    try:
        for name, recorder, span_ns in (
            ("counted only", recorders["python"], 1 << 62),
            ("+ span, python recorder", recorders["python"], 0),
            ("+ span, native recorder", recorders["native"], 0),
        ):
            callback = GcSpans(lambda recorder=recorder: recorder, span_ns)._callback

            def run(callback=callback) -> None:
                for _ in range(calls):
                    callback("start", info)
                    callback("stop", info)

            figures[name] = _summary([_per_call(calls, run) for _ in range(9)])
    finally:
        module.detach()
        writer.close()
    return figures


def host_sample_us(samples: int, trace_dir: Path) -> dict[str, float]:
    """Microseconds of one host sample of this process (read + write into the header), median of 9
    batches; and how many signals this host gives (the rest are -1)."""
    identity = RankIdentity("bench", 0, 0, 1, "localhost", os.getpid(), time.time_ns())
    writer = RingWriter(trace_dir / "host-sample.trace", identity, capacity=16)
    sampler = HostSampler(writer, 10**9)
    try:
        figures = _summary(
            [_per_call(samples, lambda: [sampler.sample() for _ in range(samples)]) for _ in range(9)]
        )
        available = sum(1 for value in dataclasses.astuple(sampler.read()) if value >= 0)
    finally:
        writer.close()
    return {**{key: value / 1000 for key, value in figures.items()}, "available": available}


CALLGRIND_RATE = 10_000  # ops/s the loops run at under callgrind


def callgrind_child(calls: int, trace_dir: Path) -> None:
    """Run under callgrind by `instruction_counts`: the two C++ loops once each, paced at
    CALLGRIND_RATE, then let the completion thread drain; prints its passes and the traced loop's rate."""
    module = native.load()
    assert module is not None, native.load_error
    identity = RankIdentity("bench", 0, 0, 2, "localhost", os.getpid(), time.time_ns())
    writer = RingWriter(trace_dir / "callgrind.trace", identity, capacity=65536)
    module.attach(str(writer.path))
    backend, release = module.held_backend(0, 2)
    release()
    traced = module.wrap(backend, comm_id([0, 1]), [0, 1], False)
    tensor = torch.ones(4)
    interval_ns = 1_000_000_000 // CALLGRIND_RATE
    module.bench_bare_ops(backend, tensor, calls, interval_ns)
    start = time.perf_counter()
    module.bench_traced_ops(traced, tensor, calls, interval_ns)
    rate = calls / (time.perf_counter() - start)
    while module.tracked():
        time.sleep(0.01)
    print(f"passes {module.passes()} rate {rate:.0f}", flush=True)
    module.detach()
    writer.close()


def _inclusive(annotated: str, function: str) -> int:
    for line in annotated.splitlines():
        if function in line:
            return int(line.split()[0].replace(",", ""))
    raise ValueError(f"{function} not in callgrind's output")


def instruction_counts(calls: int, trace_dir: Path) -> dict[str, float] | None:
    """Instructions per op from callgrind: added on the issuing thread (wrapped loop minus bare loop,
    inclusive costs, one run), and on the completion thread (its whole run over the ops it saw)."""
    valgrind, annotate = shutil.which("valgrind"), shutil.which("callgrind_annotate")
    if valgrind is None or annotate is None:
        return None
    out = trace_dir / "callgrind"
    out.mkdir()
    child = [
        valgrind, "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}/cg.out",
        sys.executable, __file__, "--callgrind-child", str(calls), "--trace-dir", str(trace_dir),
    ]  # fmt: skip
    done = subprocess.run(child, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        print(done.stderr[-2000:])
        return None
    found = re.search(r"passes (\d+) rate (\d+)", done.stdout)
    assert found is not None, done.stdout
    passes = int(found.group(1))
    figures: dict[str, float] = {"passes": passes, "rate": int(found.group(2))}
    for path in sorted(out.glob("cg.out*")):
        text = subprocess.run(
            [annotate, "--inclusive=yes", "--threshold=100", str(path)], capture_output=True, text=True
        ).stdout
        if "megatrace_bench_traced_ops" in text:
            bare = _inclusive(text, "megatrace_bench_bare_ops")
            traced = _inclusive(text, "megatrace_bench_traced_ops")
            figures["bare"] = bare / calls
            figures["issuing"] = (traced - bare) / calls
        elif "Completions::run" in text:
            total = int(re.search(r"^summary:\s+(\d+)", path.read_text(), re.M).group(1))  # type: ignore[union-attr]
            figures["completion_total"] = total
            figures["completion_per_op"] = total / calls

    return figures


def _line(figures: dict[str, float]) -> str:
    return (
        f"   wall {figures['wall']:6.0f} ns/call   CPU {figures['cpu']:6.0f} ns/call"
        f" (median; min {figures['cpu_min']:.0f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20000, help="calls per timed batch")
    parser.add_argument("--rounds", type=int, default=7, help="alternating bare/traced rounds")
    parser.add_argument("--callgrind-calls", type=int, default=20000, help="ops per loop under callgrind")
    parser.add_argument("--no-callgrind", action="store_true", help="skip the instruction counts")
    parser.add_argument("--host-samples", type=int, default=200, help="host samples per timed batch")
    parser.add_argument("--callgrind-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--trace-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.callgrind_child:
        callgrind_child(args.callgrind_child, Path(args.trace_dir))
        return
    module = native.load(build_missing=True)
    if module is None:
        raise SystemExit(f"native capture unavailable: {native.load_error}")
    with tempfile.TemporaryDirectory() as tmp:
        record = record_path_ns(args.calls, Path(tmp))
        loop = native_loop_ns(module, args.calls, Path(tmp))
        gc_hook = gc_hook_ns(module, args.calls, Path(tmp))
        host = host_sample_us(args.host_samples, Path(tmp))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(port, args.calls, args.rounds, tmp, results), nprocs=2)
        counts = None if args.no_callgrind else instruction_counts(args.callgrind_calls, Path(tmp))
    print(f"load average at the end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    print("1. gloo all_reduce, 4 floats, world size 2 (wall time, median of alternating rounds):")
    print(f"   bare            {results['bare']:10.0f} ns/call")
    print(f"   native capture  {results['native']:10.0f} ns/call   added {results['added_native']:6.0f}")
    print(f"   python fallback {results['python']:10.0f} ns/call   added {results['added_python']:6.0f}")
    print(
        "   (gloo's own jitter is in the added figures: noise at this size; 2. and 3. isolate the captures)"
    )
    print("2. native capture alone: C++ loop of all_reduce + wait on a backend completing at once")
    print(f"   (issuing thread CPU, median of 9 batches of {args.calls}; target <= 500 ns added):")
    print(f"   bare {loop['bare']:6.0f} ns/op   wrapped {loop['traced']:6.0f} ns/op")
    print(f"   added {loop['added']:5.0f} ns/op (difference of the minima: {loop['added_min']:.0f})")
    if counts is not None:
        print(
            f"   callgrind, {args.callgrind_calls} ops per loop"
            " (targets: <= 1,000 issuing, <= 3,000 all threads):"
        )
        print(
            f"   issuing thread: bare {counts['bare']:,.0f} instr/op,"
            f" added by the capture {counts['issuing']:,.0f}"
        )
        per_op = counts["completion_per_op"]
        print(
            f"   completion thread: {counts['completion_total']:,.0f} instr over the whole run"
            f" ({counts['passes']:,.0f} passes) = {per_op:,.0f} per traced op"
        )
        print(
            f"   all threads: {counts['issuing'] + per_op:,.0f} instr/op, with both loops paced at"
            f" {CALLGRIND_RATE:,} ops/s (the traced loop reached {counts['rate']:,.0f} ops/s under callgrind)"
        )
    noop = results["noop"]
    print("3. python fallback: the whole wrapper around a no-op with all_reduce's signature:")
    print(_line(noop))
    print("   its record path alone (Recorder.begin + Recorder.end on a ring file, no torch):")
    print(_line(record))
    print("4. GC hook per collection (gc.callbacks start + stop; runs in the collecting thread):")
    for name, figures in gc_hook.items():
        print(f"   {name:24s}" + _line(figures)[3:].replace("ns/call", "ns/coll"))
    print(
        "5. one host sample (watchdog thread; /proc/self + cgroup files,"
        f" {host['available']:.0f} of 21 fields available here):"
    )
    print(f"   wall {host['wall']:7.1f} us   CPU {host['cpu']:7.1f} us (median; min {host['cpu_min']:.1f})")


if __name__ == "__main__":
    main()
