"""A Megatron-style TP × PP × DP training job on the CPU (gloo) with injected faults, for the analyzer corpus.

``python -m tests.support.megatron_job --world 8 --tp 2 --pp 2 --out DIR [--fault KIND --fault-rank R]``
starts `world` worker processes as torchrun would. Ranks are laid out in Megatron's order (TP
fastest, then DP, then PP). Each pipeline stage holds tensor-parallel MLP layers (all-reduces in
forward and backward over its TP group); stages exchange activations and gradients with a 1F1B
schedule of batched ``isend``/``irecv`` (or, with ``--virtual 2``, an interleaved schedule whose last
stage hands back to the first); gradients are all-reduced over the DP group by DDP's C++ reducer in
buckets, or, with ``--zero``, reduce-scattered and all-gathered as a ZeRO optimizer does. The first
stage carries an embedding's extra work, the last stage the loss: a healthy pipeline is imbalanced.

Compute is fixed work (matrix products of a set size, or with ``--compute timed`` a set time on the
rank's own "accelerator", as each rank of a GPU job has), so an injected slowdown means what it says:
``slow-compute`` multiplies the rank's work by ``1 + factor``; ``slow-comm`` (a bad link) delays each of
its own collectives and transfers by ``factor`` times a microbatch's compute; ``slow-loader`` sleeps that
long before each microbatch; each from the fault step on (``--fault-step``: a real GPU throttles, a
link degrades, storage slows down in the middle of a run). ``hang-compute`` blocks in the forward
pass, ``hang-p2p`` before a pipeline send, ``hang-collective`` freezes the whole process (SIGSTOP)
while it sits inside a TP all-reduce (as a rank stuck in a kernel). Every rank records torch's Flight Recorder
(``TORCH_FR_BUFFER_SIZE``) and dumps it as torch writes it (pickle, and JSON for even ranks) at the end
or, for a hang, when the launcher asks; ``label.json`` says what was injected.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from tests.support.services import free_port

ROOT = Path(__file__).resolve().parents[2]

FAULTS = ("none", "hang-compute", "hang-collective", "hang-p2p", "slow-compute", "slow-comm", "slow-loader")
DUMP_REQUEST = "dump-now"
WIDTH = 64
BURNS_PER_MICROBATCH = 3  # a stage burns its units once per layer forward (two layers) and once backward


def groups_of(world: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """Every TP, DP and PP group of the layout (Megatron order tp-dp-pp), in creation order."""
    dp = world // (tp * pp)
    tp_groups = [list(range(s, s + tp)) for s in range(0, world, tp)]
    dp_groups = [[s * tp * dp + t + k * tp for k in range(dp)] for s in range(pp) for t in range(tp)]
    pp_groups = [[t + d * tp + s * tp * dp for s in range(pp)] for d in range(dp) for t in range(tp)]
    return {"tp": tp_groups, "dp": dp_groups, "pp": pp_groups}


class _Job:
    """One rank's view of the job: its groups, stage, work units and faults."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.args = torch, dist, args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        layout = groups_of(self.world, args.tp, args.pp)
        mine: dict[str, object] = {}
        self.members: dict[str, list[int]] = {}
        for dim in ("tp", "dp", "pp"):
            for ranks in layout[dim]:
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    mine[dim], self.members[dim] = group, ranks
        self.tp_group, self.dp_group, self.pp_group = mine["tp"], mine["dp"], mine["pp"]
        self.stage = self.members["pp"].index(self.rank)
        self.faulty = args.fault != "none" and self.rank == args.fault_rank
        scale = 1.0 + (0.3 if self.stage == 0 else 0.0) + (0.5 if self.stage == args.pp - 1 else 0.0)
        self.base_units = max(1, round(args.work * scale))
        self.slow_units = max(self.base_units + 1, round(self.base_units * (1.0 + args.factor)))
        self.delay_s = 0.0
        self.step = 0
        self.hung = False
        self.peer_delayed = False

    @property
    def units(self) -> int:
        """This stage's work per layer and microbatch, slowed from the fault step on."""
        return self.slow_units if self.fault_now("slow-compute") else self.base_units

    def burn(self, units: int) -> None:
        """Fixed compute: `units` products of two 96×96 matrices (``--compute cpu``), or `units` times
        ``--unit-ms`` of accelerator time (``--compute timed``): each rank of a GPU job has its own
        device, so its compute takes as long whatever the other ranks do, while matrix products of 8
        processes sharing 2 cores take turns, and a rank's extra work slows them all alike."""
        if self.args.compute == "timed":
            time.sleep(units * self.args.unit_ms / 1000)
            return
        a = self.torch.full((96, 96), 0.01)
        for _ in range(units):
            a = (a @ a).clamp_(-1.0, 1.0)

    def calibrate(self) -> None:
        """How long one microbatch's base work takes here (both layers' forward and the backward, each
        `--work` units): the unit of the injected delays."""
        start = time.perf_counter()
        self.burn(BURNS_PER_MICROBATCH * self.args.work)
        if self.faulty and self.args.fault in ("slow-comm", "slow-loader"):
            self.delay_s = self.args.factor * (time.perf_counter() - start)

    def fault_now(self, kind: str) -> bool:
        return self.faulty and self.args.fault == kind and self.step >= self.args.fault_step and not self.hung

    def hang(self, what: str) -> None:
        self.hung = True
        Path(self.args.out, f"hang-{self.rank}").write_text(what)
        print(f"megatron_job: rank {self.rank} hangs {what}", file=sys.stderr, flush=True)
        threading.Event().wait()

    def link(self) -> None:
        """A bad link: this rank's collectives and transfers start late."""
        if self.delay_s and self.fault_now("slow-comm"):
            time.sleep(self.delay_s)

    def tp_all_reduce(self, x):
        return x if self.args.tp == 1 else self.all_reduce(x, self.tp_group, self.members["tp"])

    def all_reduce(self, x, group, members: list[int]):
        """An all-reduce of this rank's own (TP, or the step's loss over the world); where the frozen
        rank's fault is due it stops inside it, and its peers arrive after it so that it is inside."""
        if self.fault_now("hang-collective"):
            self.hung = True
            Path(self.args.out, f"hang-{self.rank}").write_text("inside an all-reduce")
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        elif self._waits_for_frozen_peer(members):
            time.sleep(0.8)
        self.link()
        x = x.contiguous()
        self.dist.all_reduce(x, group=group)
        return x

    def _waits_for_frozen_peer(self, members: list[int]) -> bool:
        """Once, at the fault step: a peer of the rank that will freeze inside this all-reduce."""
        due = (
            self.args.fault == "hang-collective"
            and not self.faulty
            and not self.peer_delayed
            and self.args.fault_rank in members
            and self.step >= self.args.fault_step
        )
        self.peer_delayed = self.peer_delayed or due
        return due


def _model(job: _Job):
    torch = job.torch

    class TPAllReduce(torch.autograd.Function):
        """All-reduce over the TP group forward; and backward, for the gradient of the column split."""

        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return job.tp_all_reduce(x.clone())

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            return job.tp_all_reduce(grad.clone())

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            hidden = 128 // job.args.tp
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(WIDTH, hidden), torch.nn.Linear(hidden, WIDTH))
                for _ in range(2)
            )

        def forward(self, x):
            for layer in self.layers:
                if job.fault_now("hang-compute"):
                    job.hang("in the forward pass")
                job.burn(job.units)
                x = TPAllReduce.apply(torch.tanh(layer(x)))
            return x

    torch.manual_seed(7 + job.stage)
    stage = Stage()
    if job.args.zero or len(job.members["dp"]) == 1:
        return stage, stage
    ddp = torch.nn.parallel.DistributedDataParallel(stage, process_group=job.dp_group, bucket_cap_mb=0.02)
    return ddp, stage


def _p2p(job: _Job, sends: list, recvs: list, wait_sends: bool = True) -> tuple[list, list]:
    """Batched isend/irecv with pipeline neighbours, as Megatron's p2p_communication does.

    Returns the received tensors and the send works left to wait for (none when `wait_sends`).
    """
    if not sends and not recvs:
        return [], []
    if sends and job.fault_now("hang-p2p"):
        job.hang("before a pipeline send")
    job.link()
    dist = job.dist
    ops = [dist.P2POp(dist.irecv, t, peer, job.pp_group) for t, peer in recvs]
    ops += [dist.P2POp(dist.isend, t, peer, job.pp_group) for t, peer in sends]
    works = dist.batch_isend_irecv(ops)
    pending = works[len(recvs) :]
    for work in works[: len(recvs)] + (pending if wait_sends else []):
        work.wait()
    return [t for t, _peer in recvs], ([] if wait_sends else pending)


class _Pipeline:
    """One step's pipeline passes on this rank: forward and backward of (chunk, microbatch) pairs."""

    def __init__(self, job: _Job, stages: list, micro: int) -> None:
        self.job, self.stages, self.micro = job, stages, micro
        pp = job.args.pp
        self.virtual = pp * len(stages)
        ranks = job.members["pp"]
        self.prev, self.next = ranks[(job.stage - 1) % pp], ranks[(job.stage + 1) % pp]
        self.acts: dict[tuple[int, int], tuple] = {}

    def position(self, chunk: int) -> int:
        return chunk * self.job.args.pp + self.job.stage

    def first(self, chunk: int) -> bool:
        return self.position(chunk) == 0

    def last(self, chunk: int) -> bool:
        return self.position(chunk) == self.virtual - 1

    def forward(self, chunk: int, m: int, x):
        """Run the forward of microbatch `m` (its input `x` received, or made on the first stage)."""
        job, torch = self.job, self.job.torch
        if job.delay_s and job.fault_now("slow-loader"):
            time.sleep(job.delay_s)
        if x is None:
            x = torch.full((16, WIDTH), 0.1 * (m + 1))
        x.requires_grad_(True)
        module, plain = self.stages[chunk]
        sync = m == self.micro - 1 and chunk == len(self.stages) - 1
        if module is not plain and not sync:
            with module.no_sync():
                y = module(x)
        else:
            y = module(x)
        if self.last(chunk):
            job.burn(job.units // 2)
            y = y.pow(2).mean()
        self.acts[(chunk, m)] = (x, y)
        return y

    def backward(self, chunk: int, m: int, grad):
        """Run the backward of microbatch `m`; the gradient of its input (None on the first stage)."""
        x, y = self.acts.pop((chunk, m))
        if grad is None:
            y.backward()
        else:
            y.backward(grad)
        self.job.burn(self.job.units)
        return None if self.first(chunk) else x.grad

    def empty(self):
        return self.job.torch.empty(16, WIDTH)


def _one_f_one_b(pipe: _Pipeline) -> None:
    """Megatron's 1F1B: warm-up forwards, then one forward and one backward, then cool-down backwards;
    steady-state transfers are paired (send forward with receive backward and the reverse)."""
    job, micro = pipe.job, pipe.micro
    warm = min(job.args.pp - job.stage - 1, micro)
    steady = micro - warm

    def recv_forward():
        return None if pipe.first(0) else _p2p(job, [], [(pipe.empty(), pipe.prev)])[0][0]

    for m in range(warm):
        y = pipe.forward(0, m, recv_forward())
        _p2p(job, [(y.detach(), pipe.next)], [])
    x = recv_forward() if steady else None
    for i in range(steady):
        y = pipe.forward(0, warm + i, x)
        grad = None
        if not pipe.last(0):
            grad = _p2p(job, [(y.detach(), pipe.next)], [(pipe.empty(), pipe.next)])[0][0]
        x_grad = pipe.backward(0, i, grad)
        sends = [(x_grad, pipe.prev)] if x_grad is not None else []
        recvs = [(pipe.empty(), pipe.prev)] if i < steady - 1 and not pipe.first(0) else []
        got, _ = _p2p(job, sends, recvs)
        x = got[0] if got else None
    for b in range(steady, micro):
        grad = None if pipe.last(0) else _p2p(job, [], [(pipe.empty(), pipe.next)])[0][0]
        x_grad = pipe.backward(0, b, grad)
        if x_grad is not None:
            _p2p(job, [(x_grad, pipe.prev)], [])


def _interleaved(pipe: _Pipeline) -> None:
    """Virtual stages: every chunk's forwards, then every chunk's backwards in reverse; the last stage
    hands each chunk's output to the first stage's next chunk. Sends are waited for at the end."""
    job, chunks = pipe.job, len(pipe.stages)
    pending: list = []
    for chunk in range(chunks):
        for m in range(pipe.micro):
            x = None if pipe.first(chunk) else _p2p(job, [], [(pipe.empty(), pipe.prev)])[0][0]
            y = pipe.forward(chunk, m, x)
            if not pipe.last(chunk):
                pending += _p2p(job, [(y.detach(), pipe.next)], [], wait_sends=False)[1]
    for chunk in reversed(range(chunks)):
        for m in range(pipe.micro):
            grad = None if pipe.last(chunk) else _p2p(job, [], [(pipe.empty(), pipe.next)])[0][0]
            x_grad = pipe.backward(chunk, m, grad)
            if x_grad is not None:
                pending += _p2p(job, [(x_grad, pipe.prev)], [], wait_sends=False)[1]
    for work in pending:
        work.wait()


def train_step(job: _Job, stages: list, micro: int) -> None:
    """One step: the pipeline schedule over `micro` microbatches, then the gradient reduction."""
    pipe = _Pipeline(job, stages, micro)
    (_one_f_one_b if len(stages) == 1 else _interleaved)(pipe)
    if job.args.zero and len(job.members["dp"]) > 1:
        _zero_step(job, [s[1] for s in stages])


def _zero_step(job: _Job, modules: list) -> None:
    """ZeRO-style: reduce-scatter the flat gradient, all-gather the updated parameters, over DP."""
    torch, dist = job.torch, job.dist
    size = len(job.members["dp"])
    params = [p for module in modules for p in module.parameters()]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    pad = (-len(flat)) % size
    flat = torch.cat([flat, flat.new_zeros(pad)])
    shard = flat.new_empty(len(flat) // size)
    job.link()
    dist.reduce_scatter_tensor(shard, flat, group=job.dp_group)
    gathered = flat.new_empty(len(flat))
    dist.all_gather_into_tensor(gathered, shard, group=job.dp_group)


def fr_dumper(job: _Job, stop: threading.Event) -> None:
    """Dump the Flight Recorder when the launcher asks (a hang), from a thread: the main one may be stuck."""
    request = Path(job.args.out, DUMP_REQUEST)
    while not stop.wait(0.1):
        if request.exists():
            dump_flight_recorder(job)
            return


def dump_flight_recorder(job: _Job) -> None:
    """Write this rank's Flight Recorder buffer as torch serializes it (pickle; JSON too on even ranks)."""
    c10d = job.torch._C._distributed_c10d
    folder = Path(job.args.out, "fr")
    folder.mkdir(exist_ok=True)
    raw = c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=False)
    tmp = folder / f".fr_trace_rank_{job.rank}"
    tmp.write_bytes(raw)
    tmp.rename(folder / f"fr_trace_rank_{job.rank}")
    if job.rank % 2 == 0:
        text = c10d._dump_fr_trace_json(includeCollectives=True)
        (folder / f"fr_trace_rank_{job.rank}.json").write_text(
            text if isinstance(text, str) else text.decode()
        )


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints where a rank is stuck
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    job = _Job(args)
    job.calibrate()
    stages = [_model(job) for _ in range(args.virtual)]
    params = [p for _module, stage in stages for p in stage.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.001)
    stop = threading.Event()
    threading.Thread(target=fr_dumper, args=(job, stop), daemon=True).start()
    for step in range(args.steps):
        job.step = step
        optimizer.zero_grad()
        train_step(job, stages, args.micro)
        optimizer.step()
        job.all_reduce(torch.ones(1), None, list(range(job.world)))
    stop.set()
    dump_flight_recorder(job)
    dist.barrier()
    dist.destroy_process_group()


def launch(
    args: argparse.Namespace, worker_argv: list[str], module: str = "tests.support.megatron_job"
) -> int:
    """Start the workers (`module` ``--worker``) as torchrun would; for a hang, ask for the dumps once the
    job is stuck, then kill."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(args.world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(args.world),
            LOCAL_WORLD_SIZE=str(args.world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            TORCH_FR_BUFFER_SIZE=os.environ.get("TORCH_FR_BUFFER_SIZE", "20000"),
        )
        argv = [sys.executable, "-m", module, "--worker", *worker_argv]
        procs.append(subprocess.Popen(argv, env=env))
    deadline = time.monotonic() + args.deadline
    hung_since = None
    code = 0
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed:
            code = failed[0]
            break
        if hung_since is None and list(out.glob("hang-*")):
            hung_since = time.monotonic()
        if hung_since is not None and time.monotonic() - hung_since > args.stall_wait:
            (out / DUMP_REQUEST).touch()
            wait_until = time.monotonic() + 10
            frozen = 1 if args.fault == "hang-collective" else 0
            while len(list((out / "fr").glob("fr_trace_rank_*[0-9]"))) < args.world - frozen:
                if time.monotonic() > wait_until:
                    break
                time.sleep(0.1)
            break
        time.sleep(0.05)
    else:
        if any(p.poll() is None for p in procs):
            code = 124
    # stop every rank before killing any: a rank that saw its peer's socket close would raise inside
    # the collective it waits in, and the traces would no longer show where the job stood
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGSTOP)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    codes = [p.returncode for p in procs]
    if hung_since is None and not code:
        code = next((c for c in codes if c), 0)
    return code


def run_traced(
    folder: Path,
    job: str,
    job_args: list[str],
    capacity: int = 0,
    capture: str = "native",
    module: str = "tests.support.megatron_job",
    cgroup: Path | None = None,
) -> int:
    """Run the job (`module` with `job_args`: its options but ``--out``) under ``megatrace trace``, as a
    user would: ring files and stall dumps in `folder`/trace/`job`; label, hang marks and Flight Recorder
    dumps in `folder`; output in `folder`/job.log. `cgroup`: a cgroup v1 folder the job runs in (its
    processes join it before the tracer starts). Returns the exit code."""
    argv = [
        sys.executable, "-m", "megatrace.cli", "trace", f"--trace-dir={folder / 'trace'}", f"--job={job}",
        "--stall-ms=1500", *([f"--capacity={capacity}"] if capacity else []), "--",
        sys.executable, "-m", module, *job_args, f"--out={folder}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRACE_")}
    env["MEGATRACE_TRACE_NATIVE"] = "1" if capture == "native" else "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    join = None if cgroup is None else functools.partial(_join_cgroup, cgroup)
    with open(folder / "job.log", "wb") as log:
        return subprocess.run(
            argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=join
        ).returncode


def _join_cgroup(cgroup: Path) -> None:
    """In the child before it runs the job: move this process into `cgroup` (its children follow)."""
    (cgroup / "cgroup.procs").write_text(str(os.getpid()))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.support.megatron_job", description=__doc__)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--virtual", type=int, default=1, help="model chunks per stage (2: interleaved)")
    p.add_argument("--zero", action="store_true", help="ZeRO reduce-scatter/all-gather instead of DDP")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro", type=int, default=4, help="microbatches per step")
    p.add_argument("--work", type=int, default=8, help="compute units per layer and microbatch")
    p.add_argument("--compute", choices=("cpu", "timed"), default="cpu", help="what a compute unit is")
    p.add_argument("--unit-ms", type=float, default=2.0, help="a timed compute unit's duration")
    add_run_arguments(p, FAULTS, deadline=270.0)
    return p


def add_run_arguments(p: argparse.ArgumentParser, faults: Sequence[str], deadline: float) -> None:
    """The fault, output and time-limit flags every corpus job takes (this one and pipelining_job)."""
    p.add_argument("--fault", choices=faults, default="none")
    p.add_argument("--fault-rank", type=int, default=-1)
    p.add_argument("--fault-step", type=int, default=2, help="first step of the fault")
    p.add_argument("--factor", type=float, default=0.0, help="slowdown: 0.1 is 10 %% slower")
    p.add_argument("--out", required=True, help="folder for label.json, hang marks and Flight Recorder dumps")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout (s)")
    p.add_argument("--stall-wait", type=float, default=4.0, help="seconds stuck before dumps are taken")
    p.add_argument(
        "--deadline", type=float, default=deadline, help="seconds before the job is stopped (exit 124)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.world % (args.tp * args.pp) or (args.fault != "none" and not 0 <= args.fault_rank < args.world):
        print(
            "megatron_job: tp*pp must divide --world; a fault needs --fault-rank in the world",
            file=sys.stderr,
        )
        return 2
    if args.worker:
        worker(args)
        return 0
    label = {
        "world": args.world, "tp": args.tp, "pp": args.pp, "dp": args.world // (args.tp * args.pp),
        "virtual": args.virtual, "zero": args.zero, "fault": args.fault, "rank": args.fault_rank,
        "factor": args.factor, "step": args.fault_step,
    }  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "label.json").write_text(json.dumps(label))
    worker_argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    return launch(args, worker_argv)


if __name__ == "__main__":
    sys.exit(main())
