"""The hang-versus-pause behaviour of the whole pipeline, at compressed time (the real-speed timing is
bench/bench_time_to_page.py's): real gloo jobs under `megatrace trace` on the local stack. A hang
(inside the optimizer step, or right after a checkpoint) is paged naming the hung rank; a checkpoint,
an evaluation pass and a slow data load, each long enough to page a fixed-threshold rule, are not."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrace.config import load_config
from megatrace.demo import Scenario, bot_diagnostics
from megatrace.stack import down, up
from megatrace.stack_config import StackConfig
from tests.support.page_runs import run_job
from tests.support.services import free_port

COMPRESSION = 10  # pause thresholds of 300-900 s become 30-90 s, the learned floor of 10 s 1 s
# A pause long enough that any rule without pauses pages for it (the fixed 3 s stall threshold and
# MegatraceJobHang's 2 min `for:` of before make 15 s here), shorter than every pause's own threshold.
PAUSE_S = 20.0
WATCH_S = 90.0  # a job starts, reaches its step, and pages well within this (the budget is 60 s / 10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> StackConfig:
    state = tmp_path_factory.mktemp("ttp")
    ports = {
        name: free_port() for name in ("prometheus", "alertmanager", "node_exporter", "exporter", "alertbot")
    }
    sysfs = Path(__file__).parents[1] / "fixtures" / "sysfs" / "infiniband"
    overrides = {
        "state_dir": str(state),
        "ports": ports,
        "scrape_interval": "1s",
        "time_compression": COMPRESSION,
        "sysfs_root": str(sysfs),
    }
    config = load_config(StackConfig, environ={}, overrides=overrides)
    up(config, say=lambda line: None)
    yield config
    down(config)


def explain(stack: StackConfig) -> str:
    return "\n".join(bot_diagnostics(Path(stack.state_dir)))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.xdist_group("time-to-page")
@pytest.mark.parametrize(
    ("name", "args", "env"),
    [
        ("optimizer", ["--hang-in-optimizer=1:8"], {}),
        (
            "after-checkpoint",
            [f"--pause=checkpoint:0:6:{PAUSE_S:g}"],
            {"MEGATRACE_FAULT_HANG_RANK": "3", "MEGATRACE_FAULT_HANG_AT_STEP": "7"},
        ),
    ],
)
def test_a_hang_is_paged_naming_the_hung_rank(
    stack: StackConfig, name: str, args: list[str], env: dict[str, str]
) -> None:
    hung = 1 if name == "optimizer" else 3
    run = run_job(stack, f"ttp-{name}", Scenario(nprocs=4, tp=2), env, args, WATCH_S + PAUSE_S)
    assert run.fault_at is not None, "the fault never struck"
    assert run.page is not None, f"no page for the hang\n{explain(stack)}"
    assert run.names(hung), f"the page does not name rank {hung}: {run.page}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.xdist_group("time-to-page")
@pytest.mark.parametrize("kind", ["checkpoint", "eval", "dataloader"])
def test_a_pause_of_a_healthy_job_is_not_paged(stack: StackConfig, kind: str) -> None:
    args = [f"--pause={kind}:0:6:{PAUSE_S:g}"]
    run = run_job(
        stack, f"ttp-{kind}", Scenario(nprocs=4, tp=2), {}, args, 30.0 + PAUSE_S, stop_at_page=False
    )
    assert run.pages == 0, f"a {PAUSE_S:g}s {kind} was paged: {run.page}\n{explain(stack)}"
