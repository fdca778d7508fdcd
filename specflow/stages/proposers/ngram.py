"""`proposer=ngram`: prompt lookup over each row's prompt and generated tokens (no model).

Rule (docs/design.md §1): the longest n in [min_n, max_n] whose last-n suffix occurs earlier in
the sequence; take its most recent earlier occurrence; propose up to k tokens that followed it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.stages.tree import no_branch_pays, node_budgets, tree_budget
from specflow.state import PAD, Proposal


@dataclass
class NgramProposerConfig:
    name: str = "ngram"
    k: int = 4          # most tokens proposed per round (the tree's depth)
    min_n: int = 1      # shortest suffix that may match
    max_n: int = 4      # longest suffix tried first
    topk: int = 1       # most continuations branching at one node (1 = a chain)
    num_draft_tokens: int | None = None   # nodes per row (default k)

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ConfigError(f"proposer.k={self.k} must be >= 0 (0 = no drafting)")
        self.nodes = tree_budget(self.k, self.topk, self.num_draft_tokens)
        if not 1 <= self.min_n <= self.max_n:
            raise ConfigError(f"proposer.min_n={self.min_n}, proposer.max_n={self.max_n}: need "
                              f"1 <= min_n <= max_n")


def ngram_draft(token_ids: list[int], min_n: int = 1, max_n: int = 4, k: int = 5) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    L = len(token_ids)
    if k <= 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = token_ids[L - n:]
        # most recent occurrence that ends before the last position: scan start positions backwards
        for start in range(L - n - 1, -1, -1):
            if token_ids[start:start + n] == suffix:
                follow = start + n
                return list(token_ids[follow:follow + k])
    return []


class NgramIndex:
    """Most recent end position of every n-gram (min_n..max_n) of one sequence, kept up to date.

    An n-gram is indexed once a token follows it, so looking up the current suffix finds its most
    recent *earlier* occurrence; each committed token costs max_n - min_n + 1 dict writes, and a
    proposal costs at most that many lookups (no scan of the context).
    """

    def __init__(self, min_n: int, max_n: int, ends_kept: int = 1):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}
        # trees: the `ends_kept` most recent end positions of every n-gram, oldest first
        self.ends_kept = ends_kept
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, new: list[int]) -> None:
        toks = self.tokens
        for t in new:
            end = len(toks) - 1          # the n-grams ending at the current last token get a follower
            if end >= 0:
                for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                    gram = tuple(toks[end - n + 1:end + 1])
                    self.last_end[gram] = end
                    if self.ends_kept > 1:
                        ends = self.ends.setdefault(gram, [])
                        ends.append(end)
                        if len(ends) > self.ends_kept:
                            del ends[0]
            toks.append(t)

    def propose_tree(self, k: int, topk: int, budget: int) -> tuple[list[int], list[int]]:
        """Up to `budget` nodes of depth <= k: the continuations of every earlier occurrence of
        the current suffix, longest suffix and most recent occurrence first, merged into a trie
        with at most `topk` children per node. Its first path is propose(k)'s chain.
        -> (tokens, parents) with parents -1 for the root's children."""
        toks, L = self.tokens, len(self.tokens)
        tokens: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}
        width: dict[int, int] = {}
        if k <= 0 or budget <= 0:
            return tokens, parents
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            for end in reversed(self.ends.get(tuple(toks[L - n:]), ())):
                node = -1
                for t in toks[end + 1:end + 1 + k]:
                    nxt = child.get((node, t))
                    if nxt is None:
                        if len(tokens) >= budget or width.get(node, 0) >= topk:
                            break
                        nxt = child[(node, t)] = len(tokens)
                        tokens.append(t)
                        parents.append(node)
                        width[node] = width.get(node, 0) + 1
                    node = nxt
                if len(tokens) >= budget:
                    return tokens, parents
        return tokens, parents

    def propose(self, k: int) -> list[int]:
        toks = self.tokens
        L = len(toks)
        if k <= 0:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            end = self.last_end.get(tuple(toks[L - n:]))
            if end is not None:
                return toks[end + 1:end + 1 + k]
        return []


class NgramProposer:
    def __init__(self, cfg: NgramProposerConfig, ctx=None):
        self.cfg = cfg
        self.index: dict[int, NgramIndex] = {}          # by slot
        # (inside vLLM the context has no target: vLLM bounds the length itself)
        self.max_length = None if ctx is None or ctx.target is None else ctx.target.max_length

    @hookimpl
    def specflow_request_start(self, slot, request):
        # a tree keeps a few occurrences of each n-gram: enough for topk branches per node
        ends_kept = 1 if self.cfg.topk == 1 else 4 * self.cfg.topk
        self.index[slot] = NgramIndex(self.cfg.min_n, self.cfg.max_n, ends_kept)
        self.index[slot].extend(request.prompt_ids)

    @hookimpl
    def specflow_propose(self, batch, k):
        ks = k.tolist()
        if self.cfg.topk > 1 and not no_branch_pays(batch):      # price 1: no branch can pay
            return self._propose_tree(batch, ks)
        drafts = [self.index[s].propose(kb) for s, kb in zip(batch.slots.tolist(), ks)]
        K = max((len(d) for d in drafts), default=0)
        out = torch.full((batch.size, K), PAD, dtype=torch.long)          # [B, K]
        for b, d in enumerate(drafts):
            if d:
                out[b, :len(d)] = torch.tensor(d)
        return Proposal(out, None)

    def _propose_tree(self, batch, ks: list[int]) -> Proposal:
        room = [None if self.max_length is None else self.max_length - len(ids)
                for ids in batch.token_ids]
        budgets = node_budgets(ks, self.cfg.k, self.cfg.nodes, room)
        trees = [self.index[s].propose_tree(kb, self.cfg.topk, nb)
                 for s, kb, nb in zip(batch.slots.tolist(), ks, budgets)]
        N = max((len(t) for t, _ in trees), default=0)
        ids = torch.full((batch.size, N), PAD, dtype=torch.long)          # [B, N]
        parents = torch.full((batch.size, N), PAD, dtype=torch.long)      # [B, N]
        for b, (tokens, par) in enumerate(trees):
            if tokens:
                ids[b, :len(tokens)] = torch.tensor(tokens)
                parents[b, :len(par)] = torch.tensor(par)
        return Proposal(ids, None, parents=parents)

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        for s, ids in zip(batch.slots.tolist(), batch.token_ids):
            idx = self.index[s]
            idx.extend(ids[len(idx.tokens):])
