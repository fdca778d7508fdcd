"""A draft model's token tree, EAGLE-2 style (Li et al. 2024, "EAGLE-2: dynamic draft trees").

Depth by depth: the draft scores the current frontier (at most topk nodes per row) in one
forward with tree attention (each node sees the committed prefix and its own ancestors), every
frontier node offers its topk likeliest children, and the topk children with the highest
cumulative draft log-probability (the product of q along the path) form the next frontier. When
the depth is reached, the row's `budget` nodes with the highest cumulative probability become
the tree (a child never scores above its parent, so the set is closed under ancestors).

With a node price (`batch.node_price`, from the policy's specflow_node_price) a branch joins the
frontier and the tree only when its chance of acceptance is at least the price: scoring it must
be worth the throughput its position displaces (OPT-Tree, Wang et al. 2024, sizes trees by the
same expected-length-per-cost trade). Its descendants are worth no more than it, so a branch
under the price is not expanded. The draft's own chain (the likeliest child of the likeliest
child, ...) is exempt: the policy priced its depth when it chose k, and its verdicts keep the
calibration learning (a price on it too would stop proposing whatever the calibration
underrates, and so never learn better). A sure draft then drafts a chain, an unsure one spreads.

"Probability" is the chance a node is accepted given its parent was, not the draft's q itself:
under greedy verification a child is accepted when it is the target's argmax, which a draft
confident at q = 0.6 is far more often than 60% of the time. `Calibration` learns that map
online from the verifier's verdicts (bins of q; each bin starts at q and moves to the observed
frequency), so the tree grows deep where the draft is reliable and wide where it is not.

Each scored position is shaped through the pipeline's shape() with its own root path as the
prefix, so processors, penalties and grammars shape the draft as they will shape the target; a
token the shaping forbids (-inf) is never proposed. Children are fixed tokens (the likeliest), so
the verifier treats each as a one-hot q: exact under sampling too.

All of it runs on the drafts' device with fixed shapes (`_Nodes`): the finished trees are read
to the host once, as the round's layout needs them.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specflow.backends.contract import TreeAttention
from specflow.stages.tree import node_budgets
from specflow.state import PAD


@dataclass
class DraftTree:
    """What the proposer keeps about one row's tree until the round's cache sync."""

    base: int                                  # draft-cache position of the first tree entry
    entries: list[int] = field(default_factory=list)   # per proposed node: its entry or -1
    parents: list[int] = field(default_factory=list)   # per proposed node
    q: list[float] = field(default_factory=list)       # per proposed node
    rank: list[int] = field(default_factory=list)      # per proposed node: q's rank among siblings
    value: list[float] = field(default_factory=list)   # per proposed node: its chance of
                                                       # acceptance when proposed (calibrated)


class Calibration:
    """P(a child is accepted | its parent was) as a function of the draft's q for it and its
    rank among its siblings: `bins` equal bins of q per rank, each with discounted accepted /
    tried counts, shrunk towards its rank's rate over all bins, which is shrunk towards q (`prior`
    pseudo-observations each). So a cell never tried starts from what its rank does elsewhere
    (the likeliest child of a confident draft is accepted far more often than its q says), and
    a new pipeline starts from the draft's own q."""

    def __init__(self, ranks: int, bins: int = 10, prior: float = 2.0, memory: float = 0.98):
        self.ranks, self.bins, self.prior, self.memory = ranks, bins, prior, memory
        # discounted counts per rank and bin, plain floats: read a few times and written once
        # per node every round, a dozen tiny tensor ops would cost more than the arithmetic
        self.accepted = [[0.0] * bins for _ in range(ranks)]
        self.tried = [[0.0] * bins for _ in range(ranks)]

    def log_rate(self, q: torch.Tensor) -> torch.Tensor:
        """q [R, t] of each row's children by rank -> log P(accepted) [R, t], on q's device."""
        return self.on(q.device)(q)

    def on(self, device) -> Callable[[torch.Tensor], torch.Tensor]:
        """log_rate with this round's counts sent to `device` once. A cell's rate is affine in
        q: (accepted + prior x pooled) / (tried + prior), pooled = (rank's accepted + prior x q)
        / (rank's tried + prior); so two [ranks, bins] tables give it for any q on the device."""
        prior, a, b = self.prior, [], []
        for acc, tried in zip(self.accepted, self.tried):
            acc_rank, tried_rank = sum(acc), sum(tried)
            a.append([(x + prior * acc_rank / (tried_rank + prior)) / (n + prior)
                      for x, n in zip(acc, tried)])
            b.append([prior * prior / ((tried_rank + prior) * (n + prior)) for n in tried])
        table = torch.tensor([a, b], dtype=torch.float32, device=device)   # [2, ranks, bins]

        def log_rate(q: torch.Tensor) -> torch.Tensor:                     # [R, t] -> [R, t]
            rank = torch.arange(q.shape[-1], device=q.device).clamp(max=self.ranks - 1)   # [t]
            cell = (q * self.bins).long().clamp(0, self.bins - 1)                          # [R, t]
            rate = table[0, rank, cell] + table[1, rank, cell] * q.float()
            return rate.clamp(1e-12, 1.0).log().to(q.dtype)
        return log_rate

    def _cell(self, x: float) -> int:
        return min(max(int(x * self.bins), 0), self.bins - 1)

    def decay(self) -> None:
        """Once a round: older verdicts weigh less (a window of about 1 / (1 - memory) rounds)."""
        m = self.memory
        self.accepted = [[x * m for x in row] for row in self.accepted]
        self.tried = [[x * m for x in row] for row in self.tried]

    def observe(self, tree: DraftTree, path: list[int], greedy: bool) -> None:
        """The verifier's verdicts on one row's tree: at the root and at each accepted node, its
        children were tried in order until one was accepted; `greedy`: every child was matched
        against one token (greedy verification, or sampling with draws keyed by position)."""
        kids: dict[int, list[int]] = {}
        for n, p in enumerate(tree.parents):
            kids.setdefault(p, []).append(n)
        for i, at in enumerate([-1, *path]):
            nxt = path[i] if i < len(path) else None
            for c in kids.get(at, ()):           # in the order the verifier tried them
                rank = min(tree.rank[c], self.ranks - 1)
                cell = self._cell(tree.q[c])
                self.tried[rank][cell] += 1.0
                if c == nxt:
                    self.accepted[rank][cell] += 1.0
                    if not greedy:
                        break


class _Nodes:
    """Every row's candidate nodes, on the device: the children offered at each depth, that
    depth's block sorted by value (the likeliest first; candidates that are not worth their
    price, or have no chance, sorted last and marked invalid). Node n of row b is column n."""

    def __init__(self, B: int, width: int, depth: int, device):
        self.width, self.device = width, device   # frontier slots per depth = children per slot
        M = width + (depth - 1) * width * width               # the root's, then each depth's
        E = max((depth - 1) * width, 1)                       # draft-cache entries a row feeds
        self.token = torch.zeros(B, M, dtype=torch.long, device=device)
        self.parent = torch.full((B, M), -1, dtype=torch.long, device=device)     # -1: the root
        self.q = torch.zeros(B, M, device=device)
        self.rank = torch.zeros(B, M, dtype=torch.long, device=device)
        self.score = torch.full((B, M), -math.inf, device=device)  # log calibrated chance
        self.valid = torch.zeros(B, M, dtype=torch.bool, device=device)
        self.main = torch.zeros(B, M, dtype=torch.bool, device=device)  # on the draft's chain
        self.depth = torch.zeros(B, M, dtype=torch.long, device=device)
        self.entry = torch.full((B, M), -1, dtype=torch.long, device=device)     # -1: not fed
        self.path = torch.zeros(B, M, depth, dtype=torch.long, device=device)    # root -> node
        self.sees = torch.zeros(B, M, E, dtype=torch.bool, device=device)   # fed ancestors, self
        self.used = 0                                          # columns filled so far

    def offer(self, rows: torch.Tensor, front: torch.Tensor | None, shaped: torch.Tensor,
              depth: int, log_rate, floor: torch.Tensor) -> torch.Tensor:
        """The frontier nodes front [R, F] of rows [R] (None: each row's root) offer their
        likeliest children (shaped [R x F, V], one row per frontier node in order): those worth
        the row's floor (log price, [R]) are valid, and the draft's own chain always (the
        policy's k priced its depth, and its verdicts keep the calibration learning). Stored
        as depth `depth`'s block. -> the next frontier [R, W]: the block's first W columns."""
        R, V = rows.shape[0], shaped.shape[-1]
        t = self.width
        top, token = shaped.topk(t, -1)                                              # [RF, t]
        q = (top - shaped.logsumexp(-1, keepdim=True)).exp()                         # [RF, t]
        # a uniform row (shape()'s stand-in of zeros where nothing survived) offers no child
        q = q * (q[:, :1] * V > 1 + 1e-4)
        s = log_rate(q)                                                              # [RF, t]
        F = q.shape[0] // R
        if front is None:
            p_score = q.new_zeros(R, 1)
            p_main = p_valid = torch.ones(R, 1, dtype=torch.bool, device=q.device)
            p_path = self.path.new_zeros(R, 1, 0)
            p_index = self.parent.new_full((R, 1), -1)
        else:
            at = (rows[:, None], front)
            p_score, p_main, p_valid = self.score[at], self.main[at], self.valid[at]  # [R, F]
            p_path, p_index = self.path[at][..., :depth - 1], front                  # [R, F, d-1]
        rank = torch.arange(t, device=q.device)                                      # [t]
        score = p_score[..., None] + s.view(R, F, t)                                 # [R, F, t]
        main = p_main[..., None] & (rank == 0)
        valid = p_valid[..., None] & (q.view(R, F, t) > 0) & ((score >= floor[:, None, None]) | main)
        C = F * t
        order = torch.where(valid, score, -math.inf).view(R, C).sort(
            dim=-1, descending=True, stable=True).indices                               # [R, C]
        cols = torch.arange(self.used, self.used + C, device=q.device)[None, :]       # [1, C]
        at = (rows[:, None], cols)

        def put(store, values):                   # values [R, F, t, ...] -> block in order
            flat = values.reshape(R, C, *values.shape[3:])
            store[at] = flat.gather(1, order.view(R, C, *[1] * (flat.dim() - 2)).expand_as(flat))

        put(self.token, token.view(R, F, t))
        put(self.parent, p_index[..., None].expand(R, F, t))
        put(self.q, q.view(R, F, t).float())
        put(self.rank, rank.expand(R, F, t))
        put(self.score, score.float())
        put(self.valid, valid)
        put(self.main, main)
        self.depth[at] = depth
        paths = torch.cat([p_path[:, :, None].expand(R, F, t, depth - 1),
                           token.view(R, F, t, 1)], -1)                              # [R, F, t, d]
        put(self.path[..., :depth], paths)
        front = cols[:, :min(self.width, C)].expand(R, -1)                           # [R, W]
        self.used += C
        return front

    def feed(self, model, batch, rows: torch.Tensor, front: torch.Tensor, depth: int,
             base: list[int]) -> torch.Tensor:
        """The draft's forward over the frontier front [R, W] (nodes of depth - 1) of rows [R]
        with tree attention: each sees the committed prefix, its fed ancestors and itself, at
        position root + depth - 1; they are written after the W (depth - 2) entries each row
        fed before (each query's parent entry goes along, for a draft head that feeds a node
        its parent's state). A frontier slot with no valid node is fed too (never seen by a
        valid one): the shapes stay fixed and nothing is read. -> logits [R, W, V_draft]."""
        R, W = front.shape
        fed = (depth - 2) * W
        at = (rows[:, None], front)
        entries = torch.arange(fed, fed + W, device=self.device)                     # [W]
        self.entry[at] = entries.expand(R, W)
        parent = self.parent[at]                                                     # [R, W]
        has_parent = parent >= 0
        up = (rows[:, None], parent.clamp(min=0))
        parent_entry = torch.where(has_parent, self.entry[up], -1)                   # [R, W]
        see = self.sees[up][..., :fed + W] & has_parent[..., None]                   # [R, W, E']
        see |= torch.nn.functional.one_hot(entries, fed + W).bool()[None]
        self.sees[at] = torch.nn.functional.pad(see, (0, self.sees.shape[-1] - fed - W))
        pos = (torch.tensor(base)[:, None] + depth - 2).expand(R, W)                 # [R, W]
        return model.forward(batch.slots, self.token[at], torch.full((R,), W, dtype=torch.long),
                             tree=TreeAttention(pos, list(base), see, parent_entry))

    def select(self, budgets: list[int], base: list[int]):
        """Each row's `budget` likeliest valid nodes, parents first (a child never scores above
        its parent, and ties go to the shallower: the set is closed under ancestors), read to
        the host in one go. -> (tokens [B, N], parents [B, N] long, PAD after each row's nodes;
        per row its DraftTree)."""
        B, M = self.token.shape
        N = min(max(budgets, default=0), M)
        key = torch.where(self.valid, self.score, -math.inf)
        best = key.sort(dim=-1, descending=True, stable=True).indices[:, :N]             # [B, N]
        limit = torch.tensor(budgets, device=self.device)[:, None]                   # [B, 1]
        kept = self.valid.gather(1, best) & (torch.arange(N, device=self.device) < limit)
        # tree order: by depth, the likeliest first within a depth; what is not kept goes last
        by_depth = torch.where(kept, self.depth.gather(1, best), 1 << 30)
        order = by_depth.sort(dim=-1, stable=True).indices
        pick, kept = best.gather(1, order), kept.gather(1, order)                   # [B, N]
        where = torch.full_like(self.token, -1)
        where.scatter_(1, pick, torch.arange(N, device=self.device).expand(B, N))
        parent = self.parent.gather(1, pick)
        parent = torch.where(parent >= 0, where.gather(1, parent.clamp(min=0)), -1)
        # the kept nodes come first in each row: PAD after them
        ints = torch.stack([self.token.gather(1, pick), parent, self.entry.gather(1, pick),
                            self.rank.gather(1, pick)]).masked_fill(~kept, PAD)      # [4, B, N]
        floats = torch.stack([self.q.gather(1, pick), self.score.gather(1, pick).exp()])
        host = torch.cat([ints.double(), floats.double()]).cpu()   # the drafter's one read
        counts = (host[0] != PAD).sum(-1).tolist()
        n = max(counts, default=0)
        tokens, parents = host[:2, :, :n].long()                                     # [B, n] x2
        entry, rank = host[2:4].long().tolist()
        q, value = host[4:].tolist()
        trees = [DraftTree(base[b], entry[b][:c], parents[b, :c].tolist(), q[b][:c],
                           rank[b][:c], value[b][:c]) for b, c in enumerate(counts)]
        return tokens, parents, trees


def build_trees(model, batch, ks: list[int], budgets: list[int], topk: int, first_logits,
                align, calibration: Calibration | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, list[DraftTree]]:
    """Trees for the rows of `batch` (every row drafts: ks[b] >= 1), built on the drafts'
    device with fixed shapes: every row that reaches a depth feeds topk frontier slots and
    each offers topk children, so nothing is read until the finished trees are, once.

    first_logits [B, V]: the draft's logits after each row's committed tokens (its cache holds
    them all). align(logits) maps draft logits onto the target's vocabulary.
    -> (tokens [B, N] long, parents [B, N] long, PAD after each row's nodes; per row its
    DraftTree), on the host.
    """
    B, V = first_logits.shape
    device = first_logits.device
    calibration = calibration or Calibration(topk)
    log_rate = calibration.on(device)
    width = min(topk, V)
    nodes = _Nodes(B, width, max(ks, default=1), device)
    # per row, the least log chance of acceptance a node must have (-inf: no price)
    floor = torch.tensor([-math.inf] * B if batch.node_price is None else
                         [math.log(p) if p > 0 else -math.inf for p in batch.node_price],
                         device=device)                                               # [B]
    empty = torch.zeros(B, 0, dtype=torch.long)
    shaped = batch.shape(first_logits[:, None], empty, 0, "draft")[:, 0]               # [B, V]
    every = torch.arange(B, device=device)
    front = nodes.offer(every, None, shaped, 1, log_rate, floor)      # depth 1: the root's
    base = [model.cache_length(s) for s in batch.slots.tolist()]
    was_live = list(range(B))                                  # the rows of front
    for d in range(2, max(ks, default=0) + 1):
        live = [b for b in range(B) if ks[b] >= d]             # a row stops at its own k
        if not live:
            break
        if live != was_live:
            front = front[torch.tensor([was_live.index(b) for b in live], device=device)]
        rows = every if len(live) == B else torch.tensor(live, device=device)          # [L]
        sub = batch if len(live) == B else batch.select(live)
        was_live = live
        logits = nodes.feed(model, sub, rows, front, d, [base[b] for b in live])     # [L, W, Vd]
        L, W = front.shape
        # each frontier node's children, shaped with its own root path as the prefix
        paths = nodes.path[rows[:, None], front][..., :d - 1].reshape(L * W, d - 1)  # [LW, d-1]
        flat = align(logits.reshape(L * W, -1))                                       # [LW, V]
        shaped = sub.select([i for i in range(L) for _ in range(W)]).shape(
            flat[:, None], paths, d - 1, "draft")[:, 0]                                # [LW, V]
        front = nodes.offer(rows, front, shaped, d, log_rate, floor[rows])
    return nodes.select(budgets, base)


def draft_trees(model, batch, ks: list[int], cfg, first_logits, align, calibration: Calibration,
                target_length: int | None) -> tuple[torch.Tensor, torch.Tensor, list[DraftTree]]:
    """build_trees with the node budgets of proposer settings (cfg.k, cfg.topk, cfg.nodes): the
    configured budget scaled with each row's k, or only a cap when a policy prices nodes (the
    price then decides), never past the target's context."""
    room = [None if target_length is None else target_length - len(ids) for ids in batch.token_ids]
    scaled_from = cfg.k if batch.node_price is None else 0
    return build_trees(model, batch, ks, node_budgets(ks, scaled_from, cfg.nodes, room), cfg.topk,
                       first_logits, align, calibration)


def learn(calibration: Calibration, trees: dict[int, DraftTree], slots: list[int],
          accepted: list[list[int]], greedy: bool) -> None:
    """A round's verdicts on the trees it proposed (by slot) teach the calibration."""
    calibration.decay()
    for slot, path in zip(slots, accepted):
        if slot in trees:
            calibration.observe(trees[slot], path, greedy)


def keep_accepted_path(model, slots: list[int], trees: dict[int, DraftTree],
              accepted: list[list[int]]) -> None:
    """After verification: each tree row's draft cache keeps the accepted path's fed entries (in
    order, up to the first node that was never fed) and drops the rest."""
    keep_slots, bases, picks = [], [], []
    for slot, path in zip(slots, accepted):
        tree = trees.get(slot)
        if tree is None:
            continue
        pick = []
        for node in path:
            entry = tree.entries[node]
            if entry < 0:
                break
            pick.append(entry)
        keep_slots.append(slot)
        bases.append(tree.base)
        picks.append(pick)
    if keep_slots:
        model.keep_cached(keep_slots, bases, picks)
