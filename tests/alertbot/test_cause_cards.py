"""The drill-down's cause class (`why`, docs/analyzer.md) on the card: a "Why" line quoting the
evidence and a "Do first" step for that class, only when it is about the card's culprit and names a
class; and the GPU and network classes the drill-down names from the nodes' counters in Prometheus
when the analyzer could name no host cause."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from megatrace.alertbot.incident import CAUSE_NAMES, CAUSE_STEPS
from megatrace.alertbot.node_findings import Finding, cause_from_nodes
from megatrace.analyzer.cause import CLASSES, SIGNALS
from tests.alertbot.test_incident import VERDICT, text, verdict_delivered

WHY = {
    "cpu_quota": (
        "CPU quota throttling 63 % of scheduler periods on rank 5, 0 % median on its 7 peer(s)",
        "Do first**: Raise or remove the CPU limit of rank 5's container",
    ),
    "memory_pressure": (
        "cgroup memory limit hits 812.0/s on rank 5, 0.0/s median on its 7 peer(s)",
        "Do first**: Raise the memory limit of rank 5's container",
    ),
    "dataloader": (
        "DataLoader waits 71 % of wall on rank 5, 3 % of wall median on its 7 peer(s)",
        "Do first**: Speed up rank 5's data loading",
    ),
    "cpu_contention": (
        "run-queue delay 41 % of its runnable time on rank 5, 4 % of its runnable time median",
        "Do first**: Find what else runs on the CPUs of rank 5 on node gpu-9",
    ),
}


def card_after_verdict(tmp_path: Path, verdict: dict) -> str:
    bot, runner = verdict_delivered(tmp_path, verdict)
    runner.shutdown()
    return text(bot.console()[-1]["card"])


def with_why(**why: object) -> dict:
    verdict = copy.deepcopy(VERDICT)
    verdict["why"] = {"rank": 5, **why}
    return verdict


@pytest.mark.parametrize("cls", sorted(WHY))
def test_the_card_says_why_and_what_to_do_for_the_class(tmp_path: Path, cls: str) -> None:
    evidence, step = WHY[cls]
    card = card_after_verdict(tmp_path, with_why(**{"class": cls, "evidence": evidence}))
    assert f"**Why**: {CAUSE_NAMES[cls]}: {evidence}" in card
    assert step in card


def test_a_rank_stuck_in_python_is_shown_where(tmp_path: Path) -> None:
    where = "in `save_checkpoint` → `save` (train.py:88) for 212 s"
    why = with_why(**{"class": "python", "evidence": "…", "where": where, "frame": {"function": "save"}})
    card = card_after_verdict(tmp_path, why)
    shown = where.replace("`", "&#96;")  # the card's markdown escapes backticks as entities
    assert f"**Why**: stuck in Python: rank 5 is {shown}" in card
    assert f"Do first**: Look at what rank 5 is doing {shown}" in card


@pytest.mark.parametrize(
    "why",
    [
        {"rank": 3, "class": "cpu_quota", "evidence": "about another rank"},
        {"rank": 5, "class": "unknown", "evidence": "nothing stands out"},
        {"rank": 5, "class": "no-such-class", "evidence": "?"},
    ],
)
def test_no_why_line_unless_the_class_is_about_the_culprit(tmp_path: Path, why: dict) -> None:
    verdict = copy.deepcopy(VERDICT) | {"why": why}
    card = card_after_verdict(tmp_path, verdict)
    assert "**Why**" not in card
    assert "Do first**: Drain node gpu-9, then restart job llm-7" in card


GPU3 = Finding("gpu-1", "gpu", "3", "GPU 3: 4 XID 79 error(s) in the last 15 min")
LINK = Finding("gpu-1", "network", "", "mlx5_1 port 1: link_downed_total +2 in the last 15 min")


def test_a_fault_on_the_culprits_gpu_alone_names_gpu() -> None:
    peers = [{"host": "gpu-1", "gpu": 2}, {"host": "gpu-2", "gpu": 3}]
    named = cause_from_nodes({"host": "gpu-1", "gpu": 3}, peers, [GPU3])
    assert named == {
        "class": "gpu",
        "evidence": "GPU 3: 4 XID 79 error(s) in the last 15 min on node gpu-1; none on the 2 other GPU(s) "
        "of its peers",
    }


def test_a_fault_shared_with_a_peer_or_on_another_gpu_names_nothing() -> None:
    shared = [GPU3, Finding("gpu-2", "gpu", "3", "GPU 3: 1 XID 79 error(s) in the last 15 min")]
    assert cause_from_nodes({"host": "gpu-1", "gpu": 3}, [{"host": "gpu-2", "gpu": 3}], shared) is None
    assert cause_from_nodes({"host": "gpu-1", "gpu": 2}, [{"host": "gpu-2", "gpu": 3}], [GPU3]) is None


def test_link_errors_name_network_only_when_the_peers_are_on_other_nodes() -> None:
    named = cause_from_nodes({"host": "gpu-1", "gpu": 0}, [{"host": "gpu-2", "gpu": 0}], [LINK])
    assert named is not None and named["class"] == "network"
    # every peer on the same node: its links are theirs too
    assert cause_from_nodes({"host": "gpu-1", "gpu": 0}, [{"host": "gpu-1", "gpu": 1}], [LINK]) is None


def test_every_class_the_analyzer_or_the_drill_down_names_has_its_words_and_first_step() -> None:
    assert set(CAUSE_STEPS) == set(CAUSE_NAMES) == set(CLASSES) - {"unknown"}
    assert {signal.cls for signal in SIGNALS} | {"python", "gpu", "network"} == set(CLASSES) - {"unknown"}
