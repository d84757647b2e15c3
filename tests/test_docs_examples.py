"""The docs' examples run as written: the fault-injection example of docs/tracer.md, pasted into a
shell against a machine with only the defaults, brings the promised P0 alert to the bot (the stack's
rule durations compressed so that the test takes seconds, not minutes)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.services import free_port

DOCS = Path(__file__).resolve().parents[1] / "docs"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "sysfs"
PARTS = ("prometheus", "alertmanager", "node_exporter", "exporter", "alertbot")


def shell_block_after(doc: Path, heading: str) -> str:
    """The first ```sh block after `heading` in `doc`."""
    text = doc.read_text()
    section = text[text.index(heading) :]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match, f"no sh block after {heading!r} in {doc}"
    return match.group(1)


@pytest.mark.timeout(420)
def test_fault_injection_example_brings_the_promised_alert(tmp_path: Path) -> None:
    block = shell_block_after(DOCS / "tracer.md", "## Fault injection")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRACE_", "NCCL_MEGATRACE_"))}
    env |= {
        "HOME": str(tmp_path),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "MEGATRACE_STACK_TIME_COMPRESSION": "30",
        "MEGATRACE_STACK_SCRAPE_INTERVAL": "1s",
        "MEGATRACE_STACK_SYSFS_ROOT": str(FIXTURES / "infiniband"),
        **{f"MEGATRACE_STACK_PORTS__{name.upper()}": str(free_port()) for name in PARTS},
    }
    messages = tmp_path / "state" / "megatrace" / "stack" / "messages.jsonl"
    log_path = tmp_path / "example.log"
    with open(log_path, "wb") as log:
        shell = subprocess.Popen(
            ["bash", "-c", block], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if messages.exists() and "MegatraceJobHang" in messages.read_text(errors="replace"):
                break
            assert shell.poll() is None, log_path.read_text(errors="replace")[-4000:]
            time.sleep(0.5)
        else:
            pytest.fail("no MegatraceJobHang message:\n" + log_path.read_text(errors="replace")[-4000:])
        assert "megatrace fault injection: hang" in log_path.read_text(errors="replace")
        card = next(line for line in messages.read_text().splitlines() if "MegatraceJobHang" in line)
        assert "rank 3" in card  # the page names the rank that hung
        assert shell.poll() is None  # the ranks still wait: the example's timeout outlasts the alert
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait(timeout=30)
        subprocess.run(
            [sys.executable, "-m", "megatrace.cli", "stack", "down"],
            env=env,
            capture_output=True,
            timeout=120,
        )
