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
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specflow.models.base import TreeAttention
from specflow.stages.tree import node_budgets
from specflow.state import PAD


@dataclass
class _Node:
    token: int
    parent: int           # index in the row's node list, -1 = the root
    q: float              # the draft's shaped probability of this token after its parent
    rank: int             # its place among the children its parent offered (0 = likeliest)
    score: float          # cumulative log of the calibrated acceptance from the root
    path: list[int]       # tokens from the root to this node (inclusive)
    entry: int = -1       # this round's draft-cache entry (from the row's base), -1 = not fed
    main: bool = False    # on the draft's own chain (the likeliest child of a node on it)

    @property
    def depth(self) -> int:
        return len(self.path)


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
        """q [R, t] of each row's children by rank -> log P(accepted) [R, t]."""
        return torch.tensor(self.log_rates(q.tolist()), dtype=q.dtype).view(q.shape)

    def _cell(self, x: float) -> int:
        return min(max(int(x * self.bins), 0), self.bins - 1)

    def log_rates(self, q: list[list[float]]) -> list[list[float]]:
        """log_rate on host lists: [R][t] q -> [R][t] log P(accepted)."""
        acc_rank, tried_rank = [sum(a) for a in self.accepted], [sum(t) for t in self.tried]
        prior, last = self.prior, self.ranks - 1
        out = []
        for row in q:
            rates = []
            for r, x in enumerate(row):
                r, cell = min(r, last), self._cell(x)
                pooled = (acc_rank[r] + prior * x) / (tried_rank[r] + prior)
                rate = (self.accepted[r][cell] + prior * pooled) / (self.tried[r][cell] + prior)
                rates.append(math.log(max(rate, 1e-12)))
            out.append(rates)
        return out

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


def _top_children(shaped: torch.Tensor, topk: int, calibration: Calibration
                  ) -> tuple[list[list[float]], list[list[float]], list[list[int]]]:
    """Each row's topk likeliest tokens with q > 0: ([R][<=topk] q, log calibrated rate,
    tokens). A row whose likeliest token is no likelier than the rest (a uniform row: shape()'s
    stand-in of zeros for a row nothing survived, e.g. a grammar that allows no token a draft
    head can name) offers no child."""
    top, idx = shaped.topk(min(topk, shaped.shape[-1]), -1)                          # [R, t]
    norm = shaped.logsumexp(-1, keepdim=True)                                        # [R, 1]
    vals = (top - norm).exp()                                                        # [R, t] q
    vals = vals * (vals[:, :1] * shaped.shape[-1] > 1 + 1e-4)       # a uniform row: q = 0
    q_rows = vals.tolist()
    rates = calibration.log_rates(q_rows)
    qs, scores, tokens = [], [], []
    for v, r, i in zip(q_rows, rates, idx.tolist()):
        keep = [(a, c, b) for a, c, b in zip(v, r, i) if a > 0]
        qs.append([a for a, _, _ in keep])
        scores.append([c for _, c, _ in keep])
        tokens.append([b for _, _, b in keep])
    return qs, scores, tokens


def build_trees(model, batch, ks: list[int], budgets: list[int], topk: int, first_logits,
                align, calibration: Calibration | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, list[DraftTree]]:
    """Trees for the rows of `batch` (every row drafts: ks[b] >= 1).

    first_logits [B, V]: the draft's logits after each row's committed tokens (its cache holds
    them all). align(logits) maps draft logits onto the target's vocabulary.
    -> (tokens [B, N] long, parents [B, N] long, PAD after each row's nodes; per row its DraftTree)
    """
    B = batch.size
    calibration = calibration or Calibration(topk)
    # per row, the least log chance of acceptance a node must have (-inf: no price)
    floor = [-math.inf] * B if batch.node_price is None else \
        [math.log(p) if p > 0 else -math.inf for p in batch.node_price]
    empty = torch.zeros(B, 0, dtype=torch.long)
    shaped = batch.shape(first_logits[:, None], empty, 0, "draft")[:, 0]               # [B, V]
    rows: list[list[_Node]] = [[] for _ in range(B)]
    frontier = _offer(rows, [[-1]] * B, shaped, topk, calibration, floor)  # depth 1: every child
    fed = [0] * B                                             # entries written per row
    base = [model.cache_length(s) for s in batch.slots.tolist()]
    for d in range(2, max(ks, default=0) + 1):
        live = [b for b in range(B) if ks[b] >= d and frontier[b]]
        if not live:
            break
        sub = batch.select(live)
        logits = _feed(model, sub, [rows[b] for b in live], [frontier[b] for b in live],
                       [fed[b] for b in live], [base[b] for b in live])                 # [L, T, V]
        # each frontier node's children, shaped with its own root path as the prefix
        pick = [(i, t) for i, b in enumerate(live) for t in range(len(frontier[b]))]
        paths = torch.tensor([rows[live[i]][frontier[live[i]][t]].path for i, t in pick])  # [F, d-1]
        flat = align(logits[[i for i, _ in pick], [t for _, t in pick]])                   # [F, V]
        shaped = sub.select([i for i, _ in pick]).shape(flat[:, None], paths, d - 1,
                                                        "draft")[:, 0]                     # [F, V]
        offered = _offer([rows[b] for b in live], [frontier[b] for b in live], shaped, topk,
                         calibration, [floor[b] for b in live])
        for b, nxt in zip(live, offered):
            fed[b] += len(frontier[b])
            frontier[b] = nxt
    return _select(rows, budgets, base)


def draft_trees(model, batch, ks: list[int], cfg, first_logits, align, calibration: Calibration,
                target_length: int | None) -> tuple[torch.Tensor, torch.Tensor, list[DraftTree]]:
    """build_trees with the node budgets of proposer settings (cfg.k, cfg.topk, cfg.nodes): the
    configured budget scaled with each row's k, or only a cap when a policy prices nodes (the
    price then decides), never past the target's context."""
    room = [None if target_length is None else target_length - len(ids) for ids in batch.token_ids]
    scaled_from = cfg.k if batch.node_price is None else 0
    return build_trees(model, batch, ks, node_budgets(ks, scaled_from, cfg.nodes, room), cfg.topk,
                       first_logits, align, calibration)


def _feed(model, batch, rows: list[list[_Node]], frontier: list[list[int]], fed: list[int],
          base: list[int]) -> torch.Tensor:
    """The draft's forward over each row's frontier nodes with tree attention: each sees the
    committed prefix, its fed ancestors and itself, at position root + depth; the nodes are
    written after the row's `fed` earlier entries (each query's parent entry goes along, for a
    draft head that feeds a node its parent's state). -> logits [L, T, V_draft].

    When every row feeds one node whose row holds only its ancestors (a priced tree that is a
    chain so far), that is a plain causal step: no tree mask is built."""
    L, T = len(rows), max(len(f) for f in frontier)
    if T == 1 and all(len(f) == 1 and nodes[f[0]].depth - 1 == n_fed
                      for nodes, f, n_fed in zip(rows, frontier, fed)):
        for nodes, f, n_fed in zip(rows, frontier, fed):
            nodes[f[0]].entry = n_fed
        ids = torch.tensor([[nodes[f[0]].token] for nodes, f in zip(rows, frontier)])  # [L, 1]
        return model.forward(batch.slots, ids, torch.ones(L, dtype=torch.long))
    ids = torch.full((L, T), PAD, dtype=torch.long)
    pos = torch.zeros(L, T, dtype=torch.long)
    parent = torch.full((L, T), -1, dtype=torch.long)
    see = torch.zeros(L, T, max(fed) + T, dtype=torch.bool)
    for i, (nodes, front) in enumerate(zip(rows, frontier)):
        for t, n in enumerate(front):
            ids[i, t] = nodes[n].token
            pos[i, t] = base[i] - 1 + nodes[n].depth          # the root token sits at base - 1
            nodes[n].entry = fed[i] + t
            if nodes[n].parent != -1:
                parent[i, t] = nodes[nodes[n].parent].entry
            anc = n
            while anc != -1:                                  # itself and its fed ancestors
                see[i, t, nodes[anc].entry] = True
                anc = nodes[anc].parent
    lens = torch.tensor([len(f) for f in frontier])
    return model.forward(batch.slots, ids, lens, tree=TreeAttention(pos, list(base), see, parent))


def _offer(rows: list[list[_Node]], frontier: list[list[int]], shaped: torch.Tensor, topk: int,
           calibration: Calibration, floor: list[float]) -> list[list[int]]:
    """Each frontier node (-1 = the root) offers its topk likeliest children (shaped [F, V], one
    row per frontier node in order); the children worth the row's floor (log price) join its
    candidates, and the draft's own chain always (the policy's k priced its depth, and its
    verdicts keep the calibration learning), and the topk with the highest value form the row's
    next frontier (returned as node indices)."""
    child_q, child_scores, child_tokens = _top_children(shaped, topk, calibration)
    f, out = 0, []
    for nodes, front, low in zip(rows, frontier, floor):
        candidates = []
        for n in front:
            score, path, main = (nodes[n].score, nodes[n].path, nodes[n].main) if n != -1 \
                else (0.0, [], True)
            for r, (q, s, t) in enumerate(zip(child_q[f], child_scores[f], child_tokens[f])):
                if score + s >= low or (main and r == 0):
                    candidates.append(_Node(t, n, q, r, score + s, path + [t], main=main and r == 0))
            f += 1
        candidates.sort(key=lambda c: -c.score)
        start = len(nodes)
        nodes.extend(candidates)
        out.append(list(range(start, start + min(topk, len(candidates)))))
    return out


def _select(rows: list[list[_Node]], budgets: list[int], base: list[int]):
    """Each row's `budget` likeliest nodes, parents first, as tensors; the kept nodes' entries."""
    picked_rows = []
    for nodes, budget in zip(rows, budgets):
        order = sorted(range(len(nodes)), key=lambda n: (-nodes[n].score, nodes[n].depth))
        keep: set[int] = set()
        for n in order:
            if len(keep) >= budget:
                break
            if nodes[n].parent == -1 or nodes[n].parent in keep:
                keep.add(n)
        picked_rows.append(sorted(keep, key=lambda n: (nodes[n].depth, -nodes[n].score)))
    N = max((len(p) for p in picked_rows), default=0)
    B = len(rows)
    tokens = torch.full((B, N), PAD, dtype=torch.long)
    parents = torch.full((B, N), PAD, dtype=torch.long)
    trees = []
    for b, picked in enumerate(picked_rows):
        where = {n: i for i, n in enumerate(picked)}
        nodes = rows[b]
        for i, n in enumerate(picked):
            tokens[b, i] = nodes[n].token
            parents[b, i] = where[nodes[n].parent] if nodes[n].parent != -1 else -1
        trees.append(DraftTree(base[b], [nodes[n].entry for n in picked],
                               parents[b, :len(picked)].tolist(), [nodes[n].q for n in picked],
                               [nodes[n].rank for n in picked],
                               [math.exp(nodes[n].score) for n in picked]))
    return tokens, parents, trees


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
