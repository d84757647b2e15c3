"""The scripted end-to-end scenario behind `make demo` (`megatrace stack demo`).

It starts the local stack, runs a real multi-process CPU training job under the tracer, makes one
rank (chosen at random) hang, and follows the alert from Prometheus through Alertmanager to the
bot's one P0 card, whose headline names that rank; stops the job and waits for the card to resolve;
then does the same for a slow rank (P1); writes the weekly report workbook; stops the stack. Every
expected step that does not happen in time, and a second card for one incident, make it fail with a
non-zero exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import requests

from megatrace.stack import StackError, down, is_ours, read_state, up
from megatrace.stack_config import StackConfig

DEMO_SETTINGS = {"scrape_interval": "1s", "time_compression": 20, "state_dir": str(Path("out") / "demo")}
MARKER = ".megatrace-demo"
LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d")
HEADLINE = re.compile(r"^\[P\d\] \w+: rank (?P<rank>\d+) ")
HANG_ALERTS = ("MegatraceJobHang",)  # the one P0 of a hung job, naming its culprit


class DemoFailed(RuntimeError):
    """An expected step of the scenario did not happen; the message says which."""


@dataclasses.dataclass
class Scenario:
    """Knobs of one demo run (the end-to-end test uses a shorter one)."""

    nprocs: int = 4
    tp: int = 2
    hang_after_step: int = 5
    slow_pct: float = 100.0
    step_timeout: float = 150.0
    seed: int | None = None
    report: bool = True


@dataclasses.dataclass
class Outcome:
    """What the run showed, for the summary and for tests."""

    hung_rank: int = -1
    hang_message: dict[str, Any] = dataclasses.field(default_factory=dict)
    hang_resolved: dict[str, Any] = dataclasses.field(default_factory=dict)
    hang_cards: int = 0
    slow_rank: int = -1
    slow_message: dict[str, Any] = dataclasses.field(default_factory=dict)
    slow_resolved: dict[str, Any] = dataclasses.field(default_factory=dict)
    slow_cards: int = 0
    report_path: str = ""
    artefacts: dict[str, str] = dataclasses.field(default_factory=dict)


def prepare_state_dir(config: StackConfig) -> None:
    """Start every demo from an empty state dir; only a dir an earlier demo made is ever emptied."""
    state = Path(config.state_dir)
    if state.exists() and any(state.iterdir()):
        if not (state / MARKER).exists():
            raise DemoFailed(f"{state} is not empty and was not made by the demo; choose another --state-dir")
        if any(is_ours(item) for item in read_state(state)):
            raise DemoFailed(f"a stack is running in {state}; stop it with `megatrace stack down` first")
        shutil.rmtree(state)
    state.mkdir(parents=True)
    (state / MARKER).touch()


def card_text(message: dict[str, Any]) -> str:
    """Every piece of text of a delivered card, header first, one per line, as Feishu shows it (the
    entities that escape lark_md's markup decoded)."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("content"), str):
                found.append(html.unescape(node["content"]))
            for key, value in node.items():
                if key != "content":
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    card = message.get("card", {})
    walk(card.get("header", {}))
    walk(card.get("elements", []))
    return "\n".join(found)


def read_messages(path: Path) -> list[dict[str, Any]]:
    """The messages the bot's console channel has written so far."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def wait_for(what: str, probe: Callable[[], Any], timeout: float, interval: float = 1.0) -> Any:
    """Poll `probe` until it returns something truthy; raise DemoFailed naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = probe()
        if result:
            return result
        time.sleep(interval)
    raise DemoFailed(f"timed out after {timeout:.0f}s waiting for {what}")


def firing_alerts(prometheus: str, alertnames: tuple[str, ...], job: str) -> list[dict[str, Any]]:
    """Alerts named one of `alertnames` for training job `job` that Prometheus has firing now."""
    try:
        alerts = requests.get(f"{prometheus}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    except (requests.RequestException, ValueError, KeyError):
        return []
    return [
        alert
        for alert in alerts
        if alert["state"] == "firing"
        and alert["labels"].get("alertname") in alertnames
        and alert["labels"].get("job") == job
    ]


def find_message(messages: list[dict[str, Any]], kind: str, level: str, needle: str) -> dict[str, Any] | None:
    """The first delivered message of `kind` and `level` whose text contains `needle`."""
    for message in messages:
        if message.get("kind") == kind and message.get("level") == level and needle in card_text(message):
            return message
    return None


def headline_rank(message: dict[str, Any]) -> int | None:
    """The rank a card's headline names as the culprit."""
    title = message.get("card", {}).get("header", {}).get("title", {}).get("content", "")
    match = HEADLINE.match(title)
    return int(match.group("rank")) if match else None


def count_cards(messages: list[dict[str, Any]], level: str, job: str) -> int:
    """How many cards (pages, not updates of one) of `level` were sent for job `job`."""
    return sum(
        1 for m in messages if m.get("kind") == "firing" and m.get("level") == level and job in card_text(m)
    )


def bot_diagnostics(state: Path, now: float | None = None, log_lines: int = 12) -> list[str]:
    """What the alert bot of the stack in `state` was doing: every drill-down and its state, every
    message not delivered, and the last warnings and errors of its log. Printed when a step fails."""
    from megatrace.alertbot.store import StoreError, sqlite_store

    now = time.time() if now is None else now
    lines = []
    try:
        store = sqlite_store(state / "alertbot.sqlite3", read_only=True)
    except StoreError as exc:
        lines.append(f"alert bot database: {exc}")
    else:
        try:
            for row in store.db.query("SELECT * FROM drilldowns ORDER BY id"):
                result = json.loads(row["result"] or "{}")
                outcome = result.get("error") or result.get("verdict") or ""
                lines.append(
                    f"drill-down {row['id']} of job {row['job']} ({row['alertname']}): {row['state']}, "
                    f"requested {now - row['requested_at']:.0f}s ago" + (f"; {outcome}" if outcome else "")
                )
            for row in store.db.query("SELECT * FROM outbox WHERE state != 'sent' ORDER BY id"):
                lines.append(
                    f"message {row['id']} ({row['kind']} {row['level']}): {row['state']} after "
                    f"{row['attempts']} attempt(s)" + (f"; {row['last_error']}" if row["last_error"] else "")
                )
        finally:
            store.close()
    log = state / "logs" / "alertbot.log"
    if log.is_file():
        notable, keep = [], False
        for line in log.read_text(errors="replace").splitlines():
            if LOG_RECORD.match(line):  # a continuation line (traceback) belongs to the record above
                keep = " WARNING " in line or " ERROR " in line
            if keep:
                notable.append(line.rstrip())
        lines += [f"alertbot.log: {line}" for line in notable[-log_lines:]]
    return lines


@contextlib.contextmanager
def training_job(
    config: StackConfig,
    job: str,
    scenario: Scenario,
    env: dict[str, str],
    log: Path,
    extra_args: Sequence[str] = (),
) -> Iterator[None]:
    """Run the example training job under `megatrace trace` for the duration of the block;
    `extra_args` go to `megatrace.tracer.example_train` (pauses, a hang in the optimizer step)."""
    argv = [
        sys.executable, "-m", "megatrace.cli", "trace", "--trace-dir", config.trace_dir, "--job", job, "--",
        sys.executable, "-m", "megatrace.tracer.example_train",
        f"--nprocs={scenario.nprocs}", f"--tp={scenario.tp}", "--steps=1000000", "--timeout=600", *extra_args,
    ]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRACE_", "NCCL_MEGATRACE_"))}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            env={**clean, "OMP_NUM_THREADS": "1", "MEGATRACE_TRACE_STALL_MS": "3000", **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _follow_fault(
    config: StackConfig,
    scenario: Scenario,
    job: str,
    alertnames: tuple[str, ...],
    level: str,
    env: dict[str, str],
    say: Callable[[str], None],
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Run a faulty job, wait for the alert and its card; stop it and wait for the card to resolve.
    Returns the first card, its resolved state, and how many cards the incident sent."""
    state = Path(config.state_dir)
    messages = state / "messages.jsonl"
    prometheus = f"http://{config.host}:{config.ports.prometheus}"
    timeout = scenario.step_timeout
    with training_job(config, job, scenario, env, state / "logs" / f"{job}.log"):
        alerts = wait_for(
            f"Prometheus to fire {' or '.join(alertnames)} for job {job}",
            lambda: firing_alerts(prometheus, alertnames, job),
            timeout,
        )
        names = sorted({a["labels"]["alertname"] for a in alerts})
        say(f"    Prometheus: {', '.join(names)} firing for job {job}")
        message = wait_for(
            f"the {level} card for job {job}",
            lambda: find_message(read_messages(messages), "firing", level, job),
            timeout,
        )
        say(f"    alert bot delivered the {level} card:")
        say(_indent(card_text(message)))
    say(f"    job {job} stopped; waiting for its card to resolve")
    resolved = wait_for(
        f"the resolved card for job {job}",
        lambda: find_message(read_messages(messages), "resolved", level, job),
        timeout,
    )
    say("    resolved: " + card_text(resolved).splitlines()[0])
    return message, resolved, count_cards(read_messages(messages), level, job)


def _indent(text: str) -> str:
    return "\n".join(f"      | {line}" for line in text.splitlines())


def _weekly_report(config: StackConfig, say: Callable[[str], None]) -> str:
    state = Path(config.state_dir)
    now = datetime.now(UTC)
    output = state / "reports" / f"megatrace-report-{now:%Y%m%d-%H%M%S}.xlsx"
    argv = [
        sys.executable, "-m", "megatrace.cli", "alertbot", "report", "--config", str(state / "alertbot.yaml"),
        "--since", (now - timedelta(days=7)).strftime("%Y-%m-%dT%H:%M"),
        "--until", (now + timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M"),
        "--output", str(output),
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if result.returncode != 0 or not output.exists():
        raise DemoFailed(
            f"the weekly report was not written: {result.stderr.strip() or result.stdout.strip()}"
        )
    say(f"    weekly report workbook: {output}")
    return str(output)


def run(config: StackConfig, scenario: Scenario, say: Callable[[str], None] = print) -> Outcome:
    """Run the whole scenario; raises DemoFailed (or StackError) when an expected step did not happen."""
    rng = random.Random(scenario.seed)
    outcome = Outcome()
    state = Path(config.state_dir)
    say(f"[1/5] starting the local stack in {state}")
    up(config, say=say)
    try:
        outcome.hung_rank = rng.randrange(scenario.nprocs)
        say(f"[2/5] training job demo-hang: {scenario.nprocs} ranks (gloo, CPU); rank {outcome.hung_rank} "
            f"will hang after step {scenario.hang_after_step}")  # fmt: skip
        hang_env = {
            "MEGATRACE_FAULT_HANG_RANK": str(outcome.hung_rank),
            "MEGATRACE_FAULT_HANG_AT_STEP": str(scenario.hang_after_step),
        }
        outcome.hang_message, outcome.hang_resolved, outcome.hang_cards = _follow_fault(
            config, scenario, "demo-hang", HANG_ALERTS, "P0", hang_env, say
        )
        if headline_rank(outcome.hang_message) != outcome.hung_rank:
            raise DemoFailed(
                f"the first P0 card does not name the hung rank {outcome.hung_rank} in its headline"
            )
        if outcome.hang_cards != 1:
            raise DemoFailed(f"the hang sent {outcome.hang_cards} P0 cards; one incident is one card")
        say(f"    ✓ the one P0 card names rank {outcome.hung_rank}, the rank that hung, in its headline")

        outcome.slow_rank = rng.randrange(scenario.nprocs)
        say(f"[3/5] training job demo-slow: rank {outcome.slow_rank} runs {scenario.slow_pct:.0f}% slower")
        slow_env = {
            "MEGATRACE_FAULT_SLOW_RANK": str(outcome.slow_rank),
            "MEGATRACE_FAULT_SLOW_PCT": str(scenario.slow_pct),
        }
        outcome.slow_message, outcome.slow_resolved, outcome.slow_cards = _follow_fault(
            config, scenario, "demo-slow", ("MegatraceSlowRank",), "P1", slow_env, say
        )
        if headline_rank(outcome.slow_message) != outcome.slow_rank:
            raise DemoFailed(f"the P1 card does not name the slow rank {outcome.slow_rank} in its headline")
        if outcome.slow_cards != 1:
            raise DemoFailed(f"the slow rank sent {outcome.slow_cards} P1 cards; one incident is one card")
        say(f"    ✓ the one P1 card names rank {outcome.slow_rank}, the slow rank, in its headline")

        if scenario.report:
            say("[4/5] weekly report for the alerts of this run")
            outcome.report_path = _weekly_report(config, say)
    finally:
        say("[5/5] stopping the stack")
        down(config)
    outcome.artefacts = {
        "messages as delivered (one JSON card per line)": str(state / "messages.jsonl"),
        "weekly report": outcome.report_path,
        "trace files and stall dumps": config.trace_dir,
        "alert bot database": str(state / "alertbot.sqlite3"),
        "logs of every part and job": str(state / "logs"),
        "generated configuration": str(state),
    }
    return outcome


def _stop_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so the job and the stack are stopped on the way out."""
    raise KeyboardInterrupt


def main(config: StackConfig, scenario: Scenario) -> int:
    """Run the demo, print where everything is, and return the exit code."""
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        outcome = run(config, scenario)
    except (DemoFailed, StackError) as exc:
        state = Path(config.state_dir)
        print(f"\nDEMO FAILED: {exc}", file=sys.stderr)
        for line in bot_diagnostics(state):
            print(f"  {line}", file=sys.stderr)
        print(f"logs: {state / 'logs'}", file=sys.stderr)
        return 1
    print(f"\ndemo finished in {time.monotonic() - started:.0f}s; artefacts:")
    for what, where in outcome.artefacts.items():
        if where:
            print(f"  {what}: {where}")
    return 0
