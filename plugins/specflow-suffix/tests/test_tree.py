"""SuffixTree against brute-force references: counts, matches, speculation, removal, eviction."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from specflow_suffix.tree import SuffixTree


def brute_counts(seqs, depth):
    """Occurrences of every token string of length 1..depth in the sequences."""
    counts = Counter()
    for seq in seqs:
        for s in range(len(seq)):
            for n in range(1, min(depth, len(seq) - s) + 1):
                counts[tuple(seq[s:s + n])] += 1
    return counts


def snapshot(node):
    """The tree as nested {token: (count, {...})}: equal snapshots = equal trees."""
    return {t: (c.count, snapshot(c)) for t, c in sorted(node.children.items())}


def paths(node, prefix=()):
    for t, child in node.children.items():
        yield prefix + (t,), child.count
        yield from paths(child, prefix + (t,))


def brute_speculate(counts, depth, context, max_tokens, min_prob, factor, vocab):
    """speculate() restated on the brute-force counts (same rules and tie-breaks)."""
    context = list(context)[-depth:]
    best = ([], 0.0)
    for m in range(len(context), 0, -1):
        path = tuple(context[len(context) - m:])
        if counts[path] == 0:
            continue
        limit = min(max_tokens, math.ceil(factor * m - 1e-9))
        tokens, prob, score = [], 1.0, 0.0
        while len(tokens) < limit and len(path) < depth:
            options = [(counts[path + (t,)], t) for t in vocab if counts[path + (t,)] > 0]
            if not options:
                break
            c, t = max(options, key=lambda x: (x[0], -x[1]))   # most frequent, then smallest id
            p = prob * c / counts[path]
            if p < min_prob:
                break
            tokens.append(t)
            score += p
            prob, path = p, path + (t,)
        if score > best[1] + 1e-9:
            best = (tokens, score)
    return best


def random_seqs(rng, n, vocab=3, lo=1, hi=30):
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("depth", [1, 2, 4, 7])
def test_counts_and_nodes_match_brute_force_with_interleaved_appends(depth):
    rng = random.Random(depth)
    seqs = random_seqs(rng, 5)
    tree = SuffixTree(depth)
    # interleave the sequences token by token, as running requests would
    pos = [0] * len(seqs)
    while any(p < len(s) for p, s in zip(pos, seqs)):
        i = rng.choice([i for i, s in enumerate(seqs) if pos[i] < len(s)])
        tree.append(i, seqs[i][pos[i]])
        pos[i] += 1
    expected = brute_counts(seqs, depth)
    assert dict(paths(tree.root)) == dict(expected)       # every node and every count
    assert tree.num_nodes == len(expected)
    assert tree.root.count == sum(map(len, seqs)) == tree.num_tokens
    built = SuffixTree(depth)
    for i, s in enumerate(seqs):
        built.add_sequence(i, s)
    assert snapshot(built.root) == snapshot(tree.root)


def test_match_is_the_longest_suffix_present():
    rng = random.Random(1)
    depth = 5
    seqs = random_seqs(rng, 4, vocab=4)
    tree = SuffixTree(depth)
    for i, s in enumerate(seqs):
        tree.add_sequence(i, s)
    counts = brute_counts(seqs, depth)
    for _ in range(300):
        ctx = [rng.randrange(5) for _ in range(rng.randint(0, 9))]    # token 4 never occurs
        want = next((m for m in range(min(depth, len(ctx)), 0, -1)
                     if counts[tuple(ctx[len(ctx) - m:])] > 0), 0)
        node, m = tree.match(ctx)
        assert m == want
        assert node is (tree.root if m == 0 else tree.find(ctx[len(ctx) - m:]))


def test_speculate_on_a_hand_made_case():
    tree = SuffixTree(8)
    tree.add_sequence(0, [1, 2, 3, 1, 2, 4, 1, 2, 3])
    # "1 2" occurs 3 times: followed by 3 twice, by 4 once
    assert tree.count([1, 2]) == 3 and tree.count([1, 2, 3]) == 2 and tree.count([1, 2, 4]) == 1
    # match "1 2" (m = 2, so at most 2 tokens): 3 (p 2/3), then "1 2 3" -> 1 (p 2/3 * 1/2)
    tokens, score = tree.speculate([1, 2], max_tokens=8, min_prob=0.1)
    assert tokens == [3, 1] and score == pytest.approx(2 / 3 + 1 / 3)
    # a higher bar stops after the first token
    assert tree.speculate([1, 2], max_tokens=8, min_prob=0.5) == ([3], pytest.approx(2 / 3))
    # "4 1 2" occurs once and was followed by 3 (p 1), then the sequence ends; the shorter match
    # "1 2" scores the same 1.0 with two tokens, and ties keep the longer match
    assert tree.speculate([4, 1, 2], max_tokens=8, min_prob=0.1) == ([3], pytest.approx(1.0))
    # a longer factor lets the "1 2" match draft further: 3, 1, 2, 4 at 2/3, 1/3, 1/3, 1/3
    tokens, score = tree.speculate([1, 2], max_tokens=4, min_prob=0.1, max_spec_factor=2.0)
    assert tokens == [3, 1, 2, 4] and score == pytest.approx(2 / 3 + 3 * (1 / 3))
    # ties between children: the smallest token id
    tie = SuffixTree(4)
    tie.add_sequence(0, [5, 9, 5, 7])
    assert tie.speculate([5], max_tokens=1, min_prob=0.0) == ([7], pytest.approx(0.5))
    # nothing matches, or nothing asked
    assert tree.speculate([42], 4) == ([], 0.0) and tree.speculate([1, 2], 0) == ([], 0.0)


@pytest.mark.parametrize("seed", range(4))
def test_speculate_matches_brute_force(seed):
    rng = random.Random(100 + seed)
    depth, vocab = 6, [0, 1, 2, 3]
    seqs = random_seqs(rng, 4, vocab=3, hi=40)
    tree = SuffixTree(depth)
    for i, s in enumerate(seqs):
        tree.add_sequence(i, s)
    counts = brute_counts(seqs, depth)
    for _ in range(150):
        ctx = [rng.randrange(4) for _ in range(rng.randint(1, 10))]
        max_tokens = rng.randint(1, 8)
        min_prob = rng.choice([0.0, 0.1, 0.3, 0.6])
        factor = rng.choice([0.5, 1.0, 2.5])
        got = tree.speculate(ctx[-depth:], max_tokens, min_prob, factor)
        want = brute_speculate(counts, depth, ctx, max_tokens, min_prob, factor, vocab)
        assert got[0] == want[0] and got[1] == pytest.approx(want[1]), (ctx, max_tokens,
                                                                         min_prob, factor)


@pytest.mark.parametrize("seed", range(3))
def test_remove_sequence_restores_the_tree_built_without_it(seed):
    rng = random.Random(200 + seed)
    depth = 5
    seqs = random_seqs(rng, 6, vocab=3)
    full = SuffixTree(depth)
    for i, s in enumerate(seqs):
        full.add_sequence(i, s)
    gone = rng.sample(range(len(seqs)), 3)
    for i in gone:
        full.remove_sequence(i)
    rest = SuffixTree(depth)
    for i, s in enumerate(seqs):
        if i not in gone:
            rest.add_sequence(i, s)
    assert snapshot(full.root) == snapshot(rest.root)
    assert full.num_nodes == rest.num_nodes and full.root.count == rest.root.count
    assert sorted(full.seq_ids()) == sorted(rest.seq_ids())
    for i in [i for i in range(len(seqs)) if i not in gone]:
        full.remove_sequence(i)
    assert full.root.children == {} and full.num_nodes == 0 and full.root.count == 0


def test_fifo_eviction_keeps_at_most_n_sequences_and_bounded_nodes():
    rng = random.Random(7)
    depth, keep = 4, 3
    seqs = random_seqs(rng, 10, vocab=5, lo=5, hi=25)
    tree = SuffixTree(depth, max_sequences=keep)
    evicted = []
    for i, s in enumerate(seqs):
        evicted += tree.add_sequence(i, s)
        assert len(tree) <= keep
        assert tree.num_nodes <= sum(len(seqs[j]) for j in tree.seq_ids()) * depth
    assert evicted == list(range(len(seqs) - keep)) and tree.seq_ids() == [7, 8, 9]
    newest = SuffixTree(depth)
    for i in (7, 8, 9):
        newest.add_sequence(i, seqs[i])
    assert snapshot(tree.root) == snapshot(newest.root)
    assert list(tree.sequences()) == [seqs[7], seqs[8], seqs[9]]
    assert tree.estimate_memory() > 0
    assert SuffixTree(depth, max_sequences=0).add_sequence(0, [1, 2]) == []


def test_bad_arguments():
    with pytest.raises(ValueError):
        SuffixTree(0)
    tree = SuffixTree(3)
    tree.add_sequence(0, [1])
    with pytest.raises(ValueError, match="already"):
        tree.add_sequence(0, [2])
