"""Trees or chains: a tree proposer's rounds run in the mode that achieved more."""
from __future__ import annotations

from specflow.policies.goodput.modes import ModeChooser


def _plain(B: int) -> float:
    return 0.010 + 0.001 * B              # a plain round: 10 ms + 1 ms per row


def test_each_mode_is_tried_first_taking_turns():
    modes = ModeChooser(memory=0.05)
    seen = []
    for _ in range(2 * ModeChooser.MODE_FIRST):
        mode = modes.choose(_plain)
        seen.append(mode)
        modes.record(mode, 1, 2.0, 0.010)
    assert seen == ["tree", "chain"] * ModeChooser.MODE_FIRST


def test_goodput_compares_trees_and_chains_against_plain_decoding_at_their_batch():
    """A mode measured while the batch was larger commits more tokens per second for that
    alone: each mode is scored against what plain decoding commits in its seconds at its batch."""
    # trees at batch 1: 2 tokens in 10 ms (200 / s, 2.2x plain's 91 / s at batch 1);
    # chains at batch 4: 4 tokens in 15 ms (267 / s, but 0.93x plain's 286 / s at batch 4)
    modes = ModeChooser(memory=0.05)
    for _ in range(20):
        modes.record("tree", 1, 2.0, 0.010)
        modes.record("chain", 4, 4.0, 0.015)
    assert modes.speedup("tree", _plain) > 2 > 1 > modes.speedup("chain", _plain)
    assert modes.choose(_plain) == "tree"
    modes = ModeChooser(memory=0.05)          # the same trees, but at batch 4: 0.7x
    for _ in range(20):
        modes.record("tree", 4, 2.0, 0.010)
        modes.record("chain", 4, 4.0, 0.015)
    assert modes.choose(_plain) == "chain"


def test_the_slower_mode_is_explored_less_the_further_behind_it_measured():
    def explored(tree_seconds: float) -> int:
        modes = ModeChooser(memory=0.05)
        for _ in range(ModeChooser.MODE_SURE):
            modes.record("tree", 1, 2.0, tree_seconds)
            modes.record("chain", 1, 2.0, 0.010)
        return [modes.choose(_plain) for _ in range(1000)].count("tree")
    assert explored(0.0104) == 1000 // ModeChooser.MODE_EXPLORE      # within the noise
    assert explored(0.0125) == 1000 // 40                           # 20% behind: 1 in 40
    assert explored(0.030) == 1000 // 100                           # at most 10x fewer
