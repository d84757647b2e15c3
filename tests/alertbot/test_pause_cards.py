"""A hang alert the rules fired during a known pause (a checkpoint, an evaluation pass, a data-loader
wait that outlasted its own threshold) says so on its card: the pause itself is what is stuck."""

from __future__ import annotations

from pathlib import Path

from megatrace.demo import card_text
from tests.alertbot.conftest import Bot, alert, config, webhook


def test_a_hang_during_a_checkpoint_says_the_checkpoint_is_stuck(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path, drilldown={"verdict_wait_s": 0}))
    labels = {"job": "llm", "pause": "checkpoint", "pause_rank": "0"}
    bot.receive(webhook(alert("MegatraceJobHang", culprit_rank="0", **labels)))
    bot.drain()
    [card] = bot.console()
    text = card_text(card)
    assert "During a pause**: a checkpoint on rank 0 has lasted past its own threshold" in text
    assert "Do first**: Check the storage rank 0 writes its checkpoint to" in text
    assert "pause=" not in text and "pause_rank=" not in text  # said in words, not as labels


def test_a_hang_outside_a_pause_says_nothing_of_pauses(tmp_path: Path) -> None:
    bot = Bot(config(tmp_path, drilldown={"verdict_wait_s": 0}))
    bot.receive(webhook(alert("MegatraceJobHang", culprit_rank="3", job="llm")))
    bot.drain()
    [card] = bot.console()
    assert "During a pause" not in card_text(card)
