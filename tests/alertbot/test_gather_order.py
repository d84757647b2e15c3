"""The order in which the drill-down fetches ranks: one of each agent in turn."""

from __future__ import annotations

from megatrace.alertbot.gather import interleave


def test_fetches_take_one_rank_of_each_agent_in_turn() -> None:
    agents = [[("a", 0), ("a", 1), ("a", 2)], [("b", 3)], [], [("c", 4), ("c", 5)]]
    assert interleave(agents) == [("a", 0), ("b", 3), ("c", 4), ("a", 1), ("c", 5), ("a", 2)]
    assert interleave([]) == []
    assert interleave([[None, 0]]) == [None, 0]  # items may be anything, None included
