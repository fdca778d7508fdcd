"""A depth-limited suffix trie with occurrence counts, and greedy speculation from it.

This is the data structure of suffix decoding (SuffixDecoding, Oliaro et al.; ArcticInference's
``arctic_inference/suffix_decoding``), written as a plain, uncompressed trie in pure Python:

- Every sequence inserted contributes, for each start position ``s``, the path
  ``seq[s : s + max_depth]`` (shorter at the end of the sequence). A node's ``count`` is the number
  of (sequence, start) pairs whose path passes through or ends at it, i.e. the number of
  occurrences of the node's token string (length <= max_depth) in the inserted sequences. The
  root's count is the number of tokens inserted.
- ``append`` is incremental: each sequence keeps the nodes of its last ``max_depth`` suffix starts
  (its *active* nodes), and a new token moves every one of them one step down (O(max_depth)).
- ``speculate`` matches the end of a context against the trie for every suffix length and follows
  the most frequent child from each matched node while the estimated probability of the whole
  draft prefix, prod(child.count / node.count), stays >= ``min_prob``; the draft with the highest
  score (expected number of accepted tokens = the sum of those cumulative probabilities) wins.

Deterministic tie-breaking (documented because drafts must be reproducible):
- between children with the same count: the smallest token id;
- between match lengths with the same score: the longest match.

Memory: one node per distinct token string of length <= max_depth, so a tree over N tokens holds
at most N * max_depth nodes (``num_nodes`` is the exact count, ``estimate_memory()`` a byte estimate).
"""
from __future__ import annotations

import math
import sys
from typing import Iterable, Iterator, Sequence

__all__ = ["Node", "SuffixTree"]

_EPS = 1e-9


class Node:
    """One trie node: how often its token string occurs, and its children by next token."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}

    def __repr__(self) -> str:
        return f"Node(count={self.count}, children={len(self.children)})"


def _node_bytes() -> int:
    """Typical bytes per node: the object and a one-entry children dict (most nodes of a deep
    trie lie on unbranched chains); tracemalloc agrees within a few percent (~270 on CPython 3.11)."""
    node = Node()
    return sys.getsizeof(node) + sys.getsizeof({0: node})


NODE_BYTES = _node_bytes()


class SuffixTree:
    """Suffix trie of depth <= ``max_depth`` over any number of token sequences (by ``seq_id``).

    ``max_sequences`` (None = no limit) bounds how many sequences the tree keeps: adding one more
    evicts the oldest first (FIFO by the time each sequence was first added), so memory stays
    O(max_sequences x tokens per sequence x max_depth).
    """

    def __init__(self, max_depth: int, max_sequences: int | None = None):
        if max_depth < 1:
            raise ValueError(f"max_depth={max_depth} must be >= 1")
        if max_sequences is not None and max_sequences < 0:
            raise ValueError(f"max_sequences={max_sequences} must be >= 0 or None")
        self.max_depth = max_depth
        self.max_sequences = max_sequences
        self.root = Node()
        self.num_nodes = 0                           # nodes below the root (exact)
        self._seqs: dict[int, list[int]] = {}        # insertion order = eviction order
        self._active: dict[int, list[Node]] = {}     # last max_depth - 1 suffix starts' nodes

    # --- sequences ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[int]:
        """Sequence ids, oldest first."""
        return list(self._seqs)

    def tokens(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id])

    def sequences(self) -> Iterator[list[int]]:
        """Every sequence's tokens, oldest first (what a cache file stores)."""
        for seq in self._seqs.values():
            yield list(seq)

    @property
    def num_tokens(self) -> int:
        return self.root.count

    def estimate_memory(self) -> int:
        """Approximate bytes held by the nodes and the stored sequences."""
        return (self.num_nodes + 1) * NODE_BYTES + 8 * self.root.count + 64 * len(self._seqs)

    # --- insertion ------------------------------------------------------------------------------

    def append(self, seq_id: int, token: int) -> None:
        """Append one token to sequence ``seq_id`` (created if new): O(max_depth)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            self._new_sequence(seq_id)
            seq = self._seqs[seq_id]
        self._append(seq_id, seq, int(token))

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append several tokens to sequence ``seq_id`` (created if new)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            self._new_sequence(seq_id)
            seq = self._seqs[seq_id]
        for token in tokens:
            self._append(seq_id, seq, int(token))

    def add_sequence(self, seq_id: int, tokens: Iterable[int]) -> list[int]:
        """Insert a whole new sequence; returns the ids evicted to respect ``max_sequences``.

        With ``max_sequences=0`` nothing is kept (the sequence is not inserted).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the tree; remove it first "
                             f"or extend it")
        if self.max_sequences == 0:
            return []
        self.extend(seq_id, tokens)
        evicted = []
        while self.max_sequences is not None and len(self._seqs) > self.max_sequences:
            oldest = next(iter(self._seqs))
            self.remove_sequence(oldest)
            evicted.append(oldest)
        return evicted

    def _new_sequence(self, seq_id: int) -> None:
        self._seqs[seq_id] = []
        self._active[seq_id] = []

    def _append(self, seq_id: int, seq: list[int], token: int) -> None:
        # active: the nodes of seq[s:] for the last max_depth - 1 starts s (paths that can grow)
        active = self._active[seq_id]
        root = self.root
        root.count += 1                  # the empty path occurs once more
        seq.append(token)
        moved = []
        for node in (*active, root):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
                self.num_nodes += 1
            child.count += 1
            moved.append(child)
        d = self.max_depth
        if len(moved) >= d:              # the oldest path reached max_depth: it stops growing
            moved = moved[len(moved) - d + 1:]
        self._active[seq_id] = moved

    # --- removal ------------------------------------------------------------------------------

    def remove_sequence(self, seq_id: int) -> None:
        """Undo every path the sequence inserted: decrement counts, delete zero-count nodes."""
        seq = self._seqs.pop(seq_id)
        del self._active[seq_id]
        d = self.max_depth
        self.root.count -= len(seq)
        for start in range(len(seq)):
            node = self.root
            for token in seq[start:start + d]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    # every descendant occurs only within this occurrence: the subtree goes too
                    del node.children[token]
                    self.num_nodes -= _subtree_size(child)
                    break
                node = child

    # --- lookup ---------------------------------------------------------------------------------

    def _walk(self, tokens: Sequence[int], start: int, end: int) -> Node | None:
        node = self.root
        for i in range(start, end):
            node = node.children.get(tokens[i])
            if node is None:
                return None
        return node

    def find(self, tokens: Sequence[int]) -> Node | None:
        """The node of this exact token string, or None when it does not occur."""
        return self._walk(tokens, 0, len(tokens))

    def count(self, tokens: Sequence[int]) -> int:
        """Occurrences of the token string (0 when absent or longer than max_depth)."""
        node = self.find(tokens)
        return 0 if node is None else node.count

    def match(self, context: Sequence[int]) -> tuple[Node, int]:
        """The longest suffix of ``context`` (at most max_depth tokens) present in the tree:
        its node and its length; (root, 0) when not even the last token occurs."""
        L = len(context)
        for start in range(max(0, L - self.max_depth), L):
            node = self._walk(context, start, L)
            if node is not None:
                return node, L - start
        return self.root, 0

    # --- speculation ------------------------------------------------------------------------------

    def follow(self, node: Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """From ``node``, take the most frequent child (ties: smallest token id) while the
        cumulative probability prod(child.count / node.count) stays >= min_prob."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < max_tokens and node.children and node.count > 0:
            best_token, best = -1, None
            for token, child in node.children.items():
                if best is None or child.count > best.count or (
                        child.count == best.count and token < best_token):
                    best_token, best = token, child
            p = prob * best.count / node.count
            if p < min_prob:
                break
            tokens.append(best_token)
            score += p
            prob, node = p, best
        return tokens, score

    def speculate(self, context: Sequence[int], max_tokens: int, min_prob: float = 0.1,
                  max_spec_factor: float = 1.0) -> tuple[list[int], float]:
        """The best draft continuing ``context``: (tokens, score).

        Every suffix of the context that occurs in the tree (length m <= max_depth, longest first)
        proposes ``follow(node, min(max_tokens, ceil(max_spec_factor * m)), min_prob)``; the
        highest score wins (ties: the longer match). score = expected accepted tokens under the
        counts = the sum of the drafted tokens' cumulative probabilities. ([], 0.0) when nothing
        matches or max_tokens <= 0.
        """
        best: tuple[list[int], float] = ([], 0.0)
        if max_tokens <= 0 or not context:
            return best
        _, longest = self.match(context)
        L = len(context)
        for m in range(longest, 0, -1):
            limit = min(max_tokens, math.ceil(max_spec_factor * m - _EPS))
            if limit <= best[1] + _EPS:
                break             # a draft is never worth more than its length; limits shrink
            node = self._walk(context, L - m, L)   # present: every suffix of a match occurs
            tokens, score = self.follow(node, limit, min_prob)
            if score > best[1] + _EPS:
                best = (tokens, score)
        return best


def _subtree_size(node: Node) -> int:
    size, stack = 0, [node]
    while stack:
        n = stack.pop()
        size += 1
        stack.extend(n.children.values())
    return size
