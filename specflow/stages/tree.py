"""Token trees: the layout of a round's draft nodes, computed once on the host.

A tree proposal gives each row up to N draft nodes (`Proposal.draft_token_ids` [B, N], PAD after
the row's own n_b) and their parents (`Proposal.parents` [B, N]): -1 for a child of the root,
the row's last committed token, else the index of an earlier node (parents come first). A chain
is the tree whose node i has parent i - 1.

The target scores the root and every node in one pass: position 0 is the root, position i + 1 is
node i, at depth = its distance from the root; each position attends to the committed prefix and
to its own ancestors only. Target distributions follow the same indexing: [B, N+1, V], position
0 = after the committed prefix, position i + 1 = after node i's root path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.state import PAD


@dataclass
class TreeLayout:
    """Host-side structure of a round's trees (no device reads)."""

    parents: torch.Tensor        # [B, N] long, -1 = the root, PAD (-1) past a row's nodes
    num_nodes: list[int]         # [B] nodes per row
    depth: torch.Tensor          # [B, N+1] long: 0 for the root, 1 + the parent's for a node
    children: torch.Tensor       # [B, N+1, M] long: each position's child nodes in order, PAD after
    max_depth: int               # D: the deepest node of any row
    paths: list[list[list[int]]]  # [B][leaves][depth] node indices from the root to each leaf

    @property
    def row_depths(self) -> list[int]:
        """[B] each row's deepest node (0 for a row without nodes)."""
        return self.depth.max(1).values.tolist()

    @property
    def is_chain(self) -> bool:
        """Every row's nodes form one path (no position has two children): scored as a chain."""
        return self.children.shape[-1] <= 1

    # --- what the round asks of a layout (stages/layout.py ChainLayout answers the same) -----

    def check(self, ks: list[int], room: list[int | None]) -> str | None:
        """A row's depth is at most its k, and its nodes fit the context left."""
        return check_tree(self, ks, room)

    def shape(self, shape, logits: torch.Tensor, batch, drafts: torch.Tensor) -> torch.Tensor:
        """[B, N+1, V]: each node shaped on its own root path (a tree of single paths: as the
        chain it is)."""
        if self.is_chain:
            return shape(logits, batch.token_ids, drafts, 0, batch.request_ids, "target",
                         sampling=batch.sampling, greedy=batch.greedy)
        return shape_tree(shape, logits, batch, drafts, self)

    def accepted_paths(self, verified) -> list[list[int]]:
        """Each row's accepted node indices from the root (a chain's: its first nodes)."""
        n_acc = verified.num_accepted.tolist()
        if self.is_chain:
            return [list(range(n)) for n in n_acc]
        return [row[:n] for row, n in zip(verified.accepted_nodes.tolist(), n_acc)]

    def shaped_on_path(self, accepted: list[list[int]]) -> list[list[int]] | None:
        """The accepted paths, where the shaped positions are tree nodes (None when scored as
        a chain: position j = after j drafts)."""
        return None if self.is_chain else accepted

    def round_fields(self, accepted: list[list[int]]) -> dict:
        """RoundResult's tree fields: the accepted paths, the levels examined, the depths."""
        return {"accepted_nodes": accepted, "num_examined": examined_levels(self, accepted),
                "tree_depths": self.row_depths}

    def ancestors(self) -> torch.Tensor:
        """[B, N+1, N+1] bool: position t may attend to position u (u is t or an ancestor)."""
        B, N1 = self.depth.shape
        up = torch.zeros(B, N1, dtype=torch.long)              # each position's parent position
        real = torch.arange(N1 - 1)[None, :] < torch.tensor(self.num_nodes)[:, None]  # [B, N]
        up[:, 1:] = torch.where(real, self.parents + 1, 0)     # the root's children, PAD: root
        see = torch.eye(N1, dtype=torch.bool).expand(B, N1, N1).clone()               # [B, T, T]
        at = torch.arange(N1).expand(B, N1)                                            # [B, T]
        for _ in range(self.max_depth):      # one level up per step: the root within max_depth
            at = up.gather(1, at)
            see.scatter_(2, at[..., None], True)
        return see


def chain_parents(num_nodes: list[int], width: int) -> torch.Tensor:
    """The parents of chains: node i's parent is i - 1 ([B, width], PAD past each row's nodes)."""
    par = torch.arange(-1, width - 1)[None, :].repeat(len(num_nodes), 1)              # [B, N]
    n = torch.tensor(num_nodes)[:, None]
    return torch.where(torch.arange(width)[None, :] < n, par, torch.full_like(par, PAD))


def check_parents(parents: torch.Tensor, num_nodes: list[int]) -> str | None:
    """What is wrong with a proposer's parents [B, N] (host), or None: each node's parent is -1
    (the root) or an earlier node of the same row."""
    N = parents.shape[1]
    idx = torch.arange(N)[None, :]
    real = idx < torch.tensor(num_nodes)[:, None]                                      # [B, N]
    bad = real & ((parents < -1) | (parents >= idx))
    if bad.any():
        b, i = (int(x) for x in bad.nonzero()[0])
        return (f"row {b} node {i} has parent {int(parents[b, i])}; a parent is -1 (the last "
                f"committed token) or an earlier node (0..{i - 1})")
    return None


def tree_layout(parents: torch.Tensor, num_nodes: list[int]) -> TreeLayout:
    """Depths, children and root-to-leaf paths of host parents [B, N] (checked beforehand)."""
    B, N = parents.shape
    par = parents.tolist()
    depth = [[0] * (N + 1) for _ in range(B)]
    kids: list[list[list[int]]] = [[[] for _ in range(N + 1)] for _ in range(B)]
    paths: list[list[list[int]]] = []
    for b in range(B):
        d, k = depth[b], kids[b]
        for i in range(num_nodes[b]):
            d[i + 1] = d[par[b][i] + 1] + 1
            k[par[b][i] + 1].append(i)
        leaves = [i for i in range(num_nodes[b]) if not k[i + 1]]
        row_paths = []
        for leaf in leaves:
            path, node = [], leaf
            while node != -1:
                path.append(node)
                node = par[b][node]
            row_paths.append(path[::-1])
        paths.append(row_paths)
    M = max((len(c) for row in kids for c in row), default=0)
    children = torch.full((B, N + 1, max(M, 1)), PAD, dtype=torch.long)
    for b in range(B):
        for t, c in enumerate(kids[b]):
            if c:
                children[b, t, :len(c)] = torch.tensor(c)
    depth_t = torch.tensor(depth, dtype=torch.long).view(B, N + 1)
    return TreeLayout(parents, list(num_nodes), depth_t, children,
                      int(depth_t.max()) if B else 0, paths)


def path_positions(path: torch.Tensor) -> torch.Tensor:
    """Accepted node indices [B, D] (PAD after) -> target positions along the path [B, D+1]:
    the root (0), then node i at i + 1; PAD stays PAD."""
    return torch.cat([torch.zeros(len(path), 1, dtype=torch.long, device=path.device),
                      torch.where(path >= 0, path + 1, path)], 1)


def check_tree(layout: TreeLayout, ks: list[int], room: list[int | None]) -> str | None:
    """What is wrong with a tree proposal for this round (host), or None: a row's depth is at
    most its k (the tokens it may still commit, less one), and its nodes fit the context left."""
    for d, kb, n, left in zip(layout.row_depths, ks, layout.num_nodes, room):
        if d > kb:
            return f"returned a tree of depth {d} for a row given k={kb}; depth is at most k"
        if left is not None and n > left:
            return (f"returned {n} nodes for a row with room for {left} more tokens in the "
                    f"context; cut the tree to the context left")
    return None


def shape_tree(shape, logits: torch.Tensor, batch, drafts: torch.Tensor,
               layout: TreeLayout) -> torch.Tensor:
    """Shape every position of every row's tree through the pipeline's one shape() call: each
    root-to-leaf path becomes a row whose prefix is the committed tokens plus the path, so
    processors, penalties and grammars see exactly a node's own prefix. logits [B, N+1, V] ->
    shaped [B, N+1, V] (a position shared by several paths is shaped alike in each)."""
    B, N1, V = logits.shape
    rows, paths = [], []
    for b in range(B):
        for path in layout.paths[b] or [[]]:
            rows.append(b)
            paths.append(path)
    R, D = len(rows), max(len(p) for p in paths)
    # each path's nodes, past its leaf repeating it (never read); a row without nodes: the root
    node = torch.tensor([p + p[-1:] * (D - len(p)) if p else [-1] * D for p in paths],
                        dtype=torch.long).view(R, D)                                  # [R, D]
    pos = torch.cat([torch.zeros(R, 1, dtype=torch.long), node + 1], 1)               # [R, D+1]
    lens = torch.tensor([len(p) for p in paths])                                      # [R]
    on_path = torch.arange(D)[None, :] < lens[:, None]                                # [R, D]
    sub = torch.where(on_path, drafts[torch.tensor(rows)[:, None], node.clamp(min=0)],
                      torch.full_like(node, PAD))                                     # [R, D]
    row_t = torch.tensor(rows)                                                        # [R]
    device = logits.device
    shaped_paths = shape(logits[row_t.to(device)[:, None], pos.to(device)],
                         [batch.token_ids[b] for b in rows], sub, 0,
                         [batch.request_ids[b] for b in rows], "target", paths=paths,
                         sampling=None if batch.sampling is None else [batch.sampling[b] for b in rows],
                         greedy=batch.greedy)
    # each path's positions up to its leaf, as flat indices built on the host (a boolean mask
    # on the device would be a read)
    used = (torch.arange(D + 1)[None, :] <= lens[:, None]).flatten().nonzero()[:, 0]   # [U]
    to_row = row_t[:, None].expand(R, D + 1).flatten()[used]                          # [U]
    shaped = shaped_paths.new_zeros(B, N1, V)
    where = torch.stack([to_row, pos.flatten()[used], used]).to(device)               # [3, U]
    shaped[where[0], where[1]] = shaped_paths.flatten(0, 1)[where[2]]
    return shaped


def along_path(shaped: torch.Tensor, accepted_nodes: torch.Tensor) -> torch.Tensor:
    """The tree's shaped distributions [B, N+1, V] read along each row's accepted path: position
    j = after the path's first j nodes (what a chain's position j is), [B, N+1, V]."""
    pos = path_positions(accepted_nodes.to(shaped.device))[:, :shaped.shape[1]]       # [B, N+1]
    # past the path: repeat its end (never read: only committed positions are)
    last = (pos >= 0).sum(-1, keepdim=True) - 1                                       # [B, 1]
    pos = torch.where(pos >= 0, pos, pos.gather(1, last))
    return shaped.gather(1, pos[..., None].expand(*pos.shape, shaped.shape[-1]))


def examined_levels(layout: TreeLayout, accepted: list[list[int]]) -> list[int]:
    """Tree levels the verifier examined per row: the accepted ones, plus the level it rejected
    at unless the accepted path ended at a leaf (nothing left to try)."""
    out = []
    for b, path in enumerate(accepted):
        end = path[-1] + 1 if path else 0
        out.append(len(path) + int(bool(layout.num_nodes[b]) and
                                   int(layout.children[b, end, 0]) != PAD))
    return out


def no_branch_pays(batch) -> bool:
    """Every row's node price is 1: no branch can be worth its position (a calibrated chance of
    acceptance stays under 1), so a priced tree would be the proposer's own chain, which its chain
    path drafts for less (a draft model: one argmax or sample per step instead of ranking
    children), and the round is scored as a chain."""
    return batch.node_price is not None and all(p >= 1 for p in batch.node_price)


def tree_budget(k: int, topk: int, num_draft_tokens: int | None) -> int:
    """The node budget of proposer settings (SGLang's names: k = depth, topk = most children per
    node, num_draft_tokens = nodes per row, default k); ConfigError for settings that cannot
    make a tree."""
    from specflow.errors import ConfigError

    if topk < 1:
        raise ConfigError(f"proposer.topk={topk} must be >= 1 (1 = a chain, more = a tree)")
    nodes = k if num_draft_tokens is None else num_draft_tokens
    if topk == 1 and nodes != k:
        raise ConfigError(f"proposer.num_draft_tokens={nodes} with proposer.topk=1: a chain "
                          f"scores k={k} nodes; set proposer.topk > 1 for a tree, or leave "
                          f"num_draft_tokens out")
    if nodes < k:
        raise ConfigError(f"proposer.num_draft_tokens={nodes} is smaller than the depth "
                          f"proposer.k={k}; a tree needs at least k nodes to reach depth k")
    return nodes


def node_budgets(ks: list[int], k_cfg: int, nodes_cfg: int, room: list[int | None]) -> list[int]:
    """Nodes per row this round: the configured budget at the configured depth, scaled down with
    a smaller k (a policy or the length cap), never under k and never past the context left."""
    out = []
    for kb, left in zip(ks, room):
        n = nodes_cfg if kb >= k_cfg else max(kb, -(-nodes_cfg * kb // max(k_cfg, 1)))
        out.append(n if left is None else max(0, min(n, left)))
    return out
