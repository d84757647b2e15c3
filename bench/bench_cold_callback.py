"""Cold callbacks: how long the first ``url_verification`` and the first card action take on a bot
process that has just become ready, against Feishu's limits (1 s and 3 s). For comparison, the same
run measures a cold ``import lark_oapi`` in a fresh interpreter: what the first request paid when
the callback code was imported inside it.

    .venv/bin/python bench/bench_cold_callback.py [--runs 5]

Run it on an idle machine: the limits are wall-clock limits.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatrace.alertbot.store import sqlite_store
from tests.support.feishu_callbacks import CallbackSender, alert_with_card
from tests.support.services import free_port, running

VERIFY, KEY, ALICE = "verification-token-for-bench", "encrypt-key-for-bench", "ou_alice"


def prepare(directory: Path, port: int) -> Path:
    """A bot configuration with request-URL callbacks, and a database holding one alert and its card."""
    store = sqlite_store(directory / "bot.db")
    alert_with_card(store, "om_bench", "MegatraceJobHang")
    store.close()
    config = {
        "listen": f"127.0.0.1:{port}",
        "auth": {"bearer_token": "bench"},
        "store": {"path": str(directory / "bot.db")},
        "feishu": {
            "base_url": "http://127.0.0.1:9",
            "app": {"app_id": "cli_bench", "app_secret": "bench-secret"},
            "callback": {"mode": "request_url", "verification_token": VERIFY, "encrypt_key": KEY},
        },
        "oncall": {"roster": [{"name": "alice", "open_id": ALICE}]},
        "report": {"directory": str(directory / "reports")},
    }
    path = directory / "bot.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def one_run() -> tuple[float, float]:
    """(seconds to answer the first url_verification, seconds to answer the first card action)."""
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        config = prepare(Path(tmp), port)
        argv = [sys.executable, "-m", "megatrace.cli", "alertbot", "--config", str(config)]
        with running(argv, f"http://127.0.0.1:{port}/readyz", Path(tmp) / "bot.log"):
            sender = CallbackSender(f"http://127.0.0.1:{port}/feishu/callback", VERIFY, KEY)
            start = time.perf_counter()
            answer = sender.post({"type": "url_verification", "challenge": "c", "token": VERIFY}, sign=False)
            challenge = time.perf_counter() - start
            assert answer.json() == {"challenge": "c"}, answer.text
            start = time.perf_counter()
            answer = sender.click(ALICE, {"episode": 1, "action": "claim"}, "om_bench")
            action = time.perf_counter() - start
            assert answer.json()["toast"]["type"] == "success", answer.text
    return challenge, action


def cold_import() -> float:
    code = "import time; t = time.perf_counter(); import lark_oapi; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    runs = [one_run() for _ in range(args.runs)]
    imports = [cold_import() for _ in range(args.runs)]
    challenges, actions = [r[0] for r in runs], [r[1] for r in runs]
    print(f"runs: {args.runs} fresh bot processes, each asked once it answered /readyz")
    print(
        f"first url_verification: median {statistics.median(challenges) * 1000:.0f} ms, "
        f"max {max(challenges) * 1000:.0f} ms (Feishu allows 1000 ms)"
    )
    print(
        f"first card action (claim): median {statistics.median(actions) * 1000:.0f} ms, "
        f"max {max(actions) * 1000:.0f} ms (Feishu allows 3000 ms)"
    )
    print(
        f"cold `import lark_oapi` (paid inside the first request before): median "
        f"{statistics.median(imports) * 1000:.0f} ms, max {max(imports) * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
