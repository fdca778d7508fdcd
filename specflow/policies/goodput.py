"""`policy=goodput`: per sequence, per round, the k that maximises committed tokens per second.

Two things are learned online, nothing is hand-set:
- acceptance: for each sequence and draft position j, the chance that draft j is accepted once
  drafts 1..j-1 were: discounted counts (accepted / examined at j) shrunk towards the sequence's
  own rate over all positions, which is shrunk towards the running global rate — so positions a
  sequence has not tried yet are estimated from what it has, and a new sequence starts from
  everyone's average;
- cost: the target pass time, with the shaping, verification and cache sync that follow it, as
  a linear function of the positions it computes (rows x (the longest k + 1) for a real forward,
  which pads its rows to one length; the sum over rows of k + 1 for the synthetic pair's clock),
  and the draft time as a linear function of its steps and the tokens it drafts, fitted by
  exponentially weighted least squares on the measured stage times (the synthetic backend's
  simulated clock when there is one). A real target's fit starts from two passes timed when the
  policy is built (one position in one row; k_max+1 in every slot): steady rounds alone cannot
  tell the fixed cost of a pass from its cost per position.

With padded rows (a real target) the round is priced as a whole: for each cap K the round costs
a_t + b_t B (K+1) + a_d K + b_d sum(k), every row drafts the k <= K its own acceptance pays for,
and the cap with the most expected tokens, sum over rows of E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j,
per second of the round wins (choose_k_padded). Under load b_t B (K+1) dominates and K falls to 0
for the whole batch; one row can no longer make every row score K + 1 positions.

With rows priced separately (the synthetic clock) each sequence takes the k that maximises its
own E(k) over a_t/B + b_t (k+1) + k (b_d + a_d/B), the round's fixed costs (a_t for the target
pass, a_d per draft step) shared by the B running sequences (choose_k). With a full queue this
minimises the total cost of the work; under load b_t (k+1) dominates and k falls to 0.
`policy=oracle` is the same rule fed the synthetic pair's true acceptance and costs (the yardstick
of the policy experiment).

Token trees (proposer.topk > 1): k is the depth, and a depth-k tree is priced as 1 + w k
positions, w the nodes per level of the trees recently scored (learned, from 1). Which branches
are scored is priced too: each round the policy publishes a node price (specflow_node_price),
the throughput R of recent rounds (committed tokens / s, measured) times what one more node
costs: b_t to score it (b_t B with padded rows: a branch mostly lengthens one row, and the pass
pads every row to it), plus its share of a wider draft step (timed at build for a draft model).
A node whose chance of acceptance is under that price displaces more tokens than it is expected
to add (adding v tokens for c seconds raises a round's rate only if v / c > R), so a draft-model
tree keeps only branches worth the price: with cheap positions it spreads where the draft is
unsure; under load (R grows with the batch, and for a compute-bound pass R b_t approaches 1) it
shrinks to the draft's own chain, and then k falls to 0.

The price sees what a node costs to score and to draft, not the fixed costs a tree round adds
(ranking children per level, the tree mask, shaping along every path), which depend on the
machine and the model. So a tree proposer's drafting rounds run in one of two modes, trees or
chains (price 1: no branch, and the proposer drafts its own chain by the cheaper chain path),
and the mode is chosen on what each achieved: the committed tokens of its drafting rounds per
the tokens plain decoding would have committed in their seconds at their batch (so rounds of a
full batch and of a lone request compare alike; discounted; a new prompt's prefill left out).
Each is tried first, then the better one runs, and one round in MODE_EXPLORE runs the other so a
change of traffic is seen. Acceptance is counted per mode (a tree's levels are accepted more
often than a chain's tokens), and a tree round whose price reaches 1 is a chain round.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.stages.tree import scored_nodes, tree_width


@dataclass
class GoodputPolicyConfig:
    name: str = "goodput"
    k_max: int = 8
    ewma: float = 0.1              # weight of the newest round in each acceptance estimate
    cost_memory: float = 0.05      # weight of the newest round in the cost fits
    prior_acceptance: float = 0.7  # before anything is measured
    prior_draft_cost: float = 0.1  # draft step / target pass before anything is measured
    explore_every: int = 50        # rounds without drafts (x B with padded rows) before one
                                   # row probes k = 1
    optimism: float = 0.5          # standard errors added to each acceptance estimate (exploration)

    def __post_init__(self) -> None:
        if self.k_max < 0:
            raise ConfigError(f"policy.k_max={self.k_max} must be >= 0")
        for name in ("ewma", "cost_memory"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"policy.{name}={getattr(self, name)} must be in (0, 1]")
        if not 0 <= self.prior_acceptance <= 1:
            raise ConfigError(f"policy.prior_acceptance={self.prior_acceptance} must be in [0, 1]")
        if self.prior_draft_cost < 0:
            raise ConfigError(f"policy.prior_draft_cost={self.prior_draft_cost} must be >= 0")
        if self.explore_every < 1:
            raise ConfigError(f"policy.explore_every={self.explore_every} must be >= 1 (rounds)")
        if self.optimism < 0:
            raise ConfigError(f"policy.optimism={self.optimism} must be >= 0 (standard errors)")


class LinearFit:
    """y = a + b x by exponentially weighted least squares, shrunk towards a prior; a, b >= 0."""

    def __init__(self, memory: float, a: float, b: float = 0.0):
        self.fit = LinearFit2(memory, a, b)

    def add(self, x: float, y: float) -> None:
        self.fit.add(1.0, x, y)

    def coef(self) -> tuple[float, float]:
        return self.fit.coef()


class LinearFit2:
    """y = a x1 + b x2 (no intercept) by exponentially weighted least squares with a weak ridge
    towards the prior, so collinear or missing data fall back to it; a, b >= 0."""

    RIDGE = 1e-3

    def __init__(self, memory: float, a: float, b: float):
        self.memory, self.prior = memory, (a, b)
        # discounted sums of x1 x1, x1 x2, x2 x2, x1 y, x2 y (plain floats: read every round)
        self.s11 = self.s12 = self.s22 = self.s1y = self.s2y = 0.0
        self.n = 0.0

    def add(self, x1: float, x2: float, y: float) -> None:
        d = 1 - self.memory
        self.s11, self.s12, self.s22 = d * self.s11 + x1 * x1, d * self.s12 + x1 * x2, \
            d * self.s22 + x2 * x2
        self.s1y, self.s2y, self.n = d * self.s1y + x1 * y, d * self.s2y + x2 * y, d * self.n + 1

    def coef(self) -> tuple[float, float]:
        if self.n == 0:
            return self.prior
        pa, pb = self.prior
        l1, l2 = self.RIDGE * self.s11 + 1e-12, self.RIDGE * self.s22 + 1e-12   # scale-free ridge
        m11, m22, m12 = self.s11 + l1, self.s22 + l2, self.s12
        r1, r2 = self.s1y + l1 * pa, self.s2y + l2 * pb
        det = m11 * m22 - m12 * m12                   # > 0: the ridge keeps it positive definite
        a, b = (m22 * r1 - m12 * r2) / det, (m11 * r2 - m12 * r1) / det
        return max(a, 0.0), max(b, 0.0)


class LinearFit3:
    """y = w . x for x of three terms, as LinearFit2 (discounted least squares, a weak ridge
    towards the prior, each weight >= 0), solved with numpy.

    Three weights are pinned by three observations, so the first few (a warm-up round that
    builds kernels for new shapes, say 3x the usual seconds) would set them alone; and a fit
    that prices drafting out is not corrected, since rounds that draft nothing add no data.
    So the prior also counts as PRIOR_ROUNDS observations at first, fading as observations
    arrive (half after FADE of them): early rounds are shrunk towards it, later ones are not."""

    RIDGE = LinearFit2.RIDGE
    PRIOR_ROUNDS, FADE = 4.0, 10.0

    def __init__(self, memory: float, prior: tuple[float, float, float]):
        self.memory, self.prior = memory, np.asarray(prior, dtype=np.float64)
        self.sxx, self.sxy, self.n = np.zeros((3, 3)), np.zeros(3), 0.0
        self.seen = 0                                   # observations ever added (no discount)
        self._coef: tuple[float, ...] | None = None     # solved once per observation

    def add(self, x, y: float) -> None:
        x = np.asarray(x, dtype=np.float64)
        d = 1 - self.memory
        self.sxx = d * self.sxx + np.outer(x, x)
        self.sxy, self.n = d * self.sxy + x * y, d * self.n + 1
        self.seen += 1
        self._coef = None

    def coef(self) -> tuple[float, ...]:
        if self._coef is not None:
            return self._coef
        if self.n == 0:
            return tuple(self.prior.tolist())
        mean_sq = np.diag(self.sxx) / self.n                            # a typical x_i^2
        early = self.PRIOR_ROUNDS * self.FADE / (self.FADE + self.seen)  # pseudo-observations
        ridge = (self.RIDGE * self.n + early) * mean_sq + 1e-12          # scale-free
        w = np.linalg.solve(self.sxx + np.diag(ridge), self.sxy + ridge * self.prior)
        self._coef = tuple(np.maximum(w, 0.0).tolist())
        return self._coef


def expected_tokens(acceptance) -> np.ndarray:
    """acceptance [B, K] (per position) -> E(k) [B, K+1] for k = 0..K."""
    gain = np.cumprod(np.clip(np.asarray(acceptance, dtype=np.float64), 0, 1), 1)  # [B, K]
    return np.concatenate([np.ones((len(gain), 1)), 1 + np.cumsum(gain, 1)], 1)


def choose_k(acceptance, a_t: float, b_t: float, a_d: float, b_d: float,
             rounds: int = 3, positions=None, first: float = 0.0) -> list[int]:
    """acceptance [B, K] -> per row, the k in 0..K maximising E(k) / its cost share, for a
    target whose pass costs the sum of its rows' positions (rows are not padded).

    A row's share of a round: a_t / B of the target pass's fixed cost, b_t per position it adds,
    b_d per draft step it takes, and a_d / n_i for its i-th draft step, which the n_i rows
    drafting at least i tokens share (the first step also `first`, the fixed cost of drafting
    at all in a round). n depends on everyone's k: a few fixed-point passes.
    """
    E = expected_tokens(acceptance)                                              # [B, K+1]
    B, K = E.shape[0], E.shape[1] - 1
    if B == 0:
        return []
    k = np.arange(K + 1)                                                         # [K+1]
    scored = k + 1 if positions is None else np.asarray(positions[:K + 1])      # [K+1]
    choice = np.full(B, K)
    for _ in range(rounds):
        sharing = (choice[:, None] >= k[None, 1:]).sum(0)                        # [K] n_i
        step_share = a_d / np.maximum(sharing, 1)                                # [K]
        step_share[:1] += first / max(int(sharing[0]) if K else 1, 1)
        cost = a_t / B + b_t * scored + b_d * k + np.concatenate(
            [[0.0], np.cumsum(step_share)])                                      # [K+1]
        new = (E / np.maximum(cost, 1e-12)).argmax(1)                            # [B]
        if np.array_equal(new, choice):
            break
        choice = new
    return choice.tolist()


def choose_k_padded(acceptance, a_t: float, b_t: float, a_d: float, b_d: float,
                    rounds: int = 4, positions=None, first: float = 0.0,
                    plain: float | None = None, row_first=None) -> list[int]:
    """acceptance [B, K] -> per row k, for a target whose pass pads every row to the longest
    (a transformer forward over [B, max k + 1]): the round costs a_t + b_t B (K + 1) for its
    largest K whatever the other rows draft, plus a_d per draft step and b_d per drafting row
    (and `first` once when any row drafts).
    So the choice is the batch's: for each cap K, every row takes the k <= K that is worth its
    own draft steps, and the cap with the most expected tokens per second of the round wins
    (per-row shares would let one keen row make all B rows score K + 1 positions).

    For a cap the rows' choices and the round's rate depend on each other (Dinkelbach): each row
    maximises E(k) - rate * b_d * k at the current rate, a few passes. `plain`: the measured
    seconds of a round without drafts at this batch, in place of the fit's a_t + b_t B;
    `row_first` [B] (or a function returning it): seconds a row adds to the round if it drafts
    at all (its draft's catch-up)."""
    E = expected_tokens(acceptance)                                              # [B, K+1]
    B, K = E.shape[0], E.shape[1] - 1
    if B == 0:
        return []
    j = np.arange(K + 1)                                                         # [J]
    cap = np.arange(K + 1)                                                       # [C] = K+1 caps
    # positions a row scores with depth k: k + 1 for a chain, the tree's nodes + 1 for a tree
    scored = cap + 1 if positions is None else np.asarray(positions[:K + 1])    # [C]
    target = a_t + b_t * B * scored                                              # [C]
    if plain is not None:
        target[0] = plain
    # under load no longest draft K can beat plain decoding even if every row drafted K and all
    # were accepted at its estimated rates (the round then costs at least target + (a_d + b_d) K):
    # the common answer, found without the search
    best_case = E.sum(0)[1:] / (target[1:] + (a_d + b_d) * cap[1:] + first)     # [K]
    if K == 0 or best_case.max() <= B / max(target[0], 1e-12):
        return [0] * B
    over = j[None, :] > cap[:, None]                                             # [C, J]
    ks = np.repeat(cap[:, None], B, 1)                                           # [C, B]
    rows = np.arange(B)[None, :]

    if callable(row_first):         # computed only past the common answer above
        row_first = row_first()
    extra = np.zeros(B) if row_first is None else np.asarray(row_first, dtype=np.float64)  # [B]
    # what drafting k costs a row beyond its share of the pass: b_d per token, its catch-up once
    own = b_d * j[None, :] + extra[:, None] * (j[None, :] > 0)                   # [B, J]

    def rate(ks):
        tokens = E[rows, ks].sum(1)                                              # [C]
        longest = ks.max(1)
        return tokens / np.maximum(target + a_d * longest + first * (longest > 0)
                                   + own[rows, ks].sum(1), 1e-12)

    for _ in range(rounds):
        score = E[None] - rate(ks)[:, None, None] * own[None]                    # [C, B, J]
        score[np.broadcast_to(over[:, None, :], score.shape)] = -np.inf
        new = score.argmax(-1)                                                   # [C, B]
        if np.array_equal(new, ks):
            break
        ks = new
    return ks[int(rate(ks).argmax())].tolist()


def proposer_cfg(ctx):
    """The pipeline's proposer config node, or None (a policy built without a pipeline)."""
    return ctx.cfg.get("proposer") if getattr(ctx, "cfg", None) is not None else None


def builds_trees(ctx) -> bool:
    """The configured proposer builds token trees (proposer.topk > 1)."""
    return tree_width(proposer_cfg(ctx)) > 1


def measured_target_cost(target, positions: int, rows: int) -> tuple[float, float] | None:
    """(a_t, b_t) seconds from two timed passes of a real target (one position in one row, and
    `positions` in each of `rows` rows), or None for a simulated one (its clock is the truth).

    The online fit alone cannot find b_t when every round scores about the same number of
    tokens (a full batch at a steady k): the data then only say a_t + b_t x at that x, and a
    prior of b_t = 0 made extra positions look free, so k never fell under load."""
    from specflow.models.threads import pass_seconds

    if getattr(target, "clock", None) is not None or not hasattr(target, "truncate") \
            or rows * positions <= 1:
        return None
    one = pass_seconds(target, 5)
    full = pass_seconds(target, 5, positions, rows)
    b = max(0.0, (full - one) / (rows * positions - 1))
    return max(one - b, 0.0), b


def timed_draft_model(ctx):
    """The draft model a `proposer=draft` pipeline steps, when its passes can be timed (a real
    model, not the synthetic clock); None otherwise, without loading one for other proposers."""
    proposer = proposer_cfg(ctx)
    if proposer is None or proposer.get("name") != "draft":
        return None
    draft = ctx.draft                                     # (loads the model on first use)
    if draft is None or getattr(draft, "clock", None) is not None or not hasattr(draft, "truncate"):
        return None
    return draft


def measured_branch_cost(ctx) -> float:
    """Seconds one more frontier node adds to a tree step of a draft model or head (a forward
    over topk positions against one), timed when the policy is built; 0 for chains, simulated
    or no draft models. A tree's extra nodes cost this on top of their scored positions."""
    from specflow.models.threads import pass_seconds

    if not builds_trees(ctx):
        return 0.0
    width = tree_width(proposer_cfg(ctx))
    step = getattr(ctx, "draft_step_seconds", None)      # a draft head (proposer=eagle)
    if step is not None:
        return max(0.0, (step(1, positions=width) - step(1)) / (width - 1))
    draft = timed_draft_model(ctx)
    if draft is None:
        return 0.0
    return max(0.0, (pass_seconds(draft, 5, width) - pass_seconds(draft, 5)) / (width - 1))


def measured_draft_cost(ctx) -> tuple[float, float] | None:
    """(a_d, b_d) seconds per draft step and per drafting row, from one-position passes of the
    draft model (or steps of a draft head) in one row and in every slot; None for proposers
    without either (n-gram)."""
    from specflow.models.threads import pass_seconds

    proposer = proposer_cfg(ctx)
    rows = int(getattr(ctx, "slots", 1))
    step = getattr(ctx, "draft_step_seconds", None)      # a draft head (proposer=eagle)
    if proposer is None or rows <= 1 or (proposer.get("name") != "draft" and step is None):
        return None
    if step is not None:
        one, full = step(1), step(rows)
    else:
        draft = ctx.draft
        one, full = pass_seconds(draft, 5), pass_seconds(draft, 5, 1, rows)
    b = max(0.0, (full - one) / (rows - 1))
    return max(one - b, 0.0), b


def measured_catch_up_cost(ctx) -> float:
    """Seconds per token of a draft model's catch-up (a prefill of tokens it has not fed), from
    two timed passes when the policy is built (64 positions and one); 0 for other proposers and
    simulated models (then it is learned from the rounds' catch-up seconds, if any)."""
    from specflow.models.threads import pass_seconds

    draft = timed_draft_model(ctx)
    if draft is None:
        return 0.0
    return max(0.0, (pass_seconds(draft, 3, 64) - pass_seconds(draft, 3)) / 63)


class GoodputPolicy:
    def __init__(self, cfg: GoodputPolicyConfig, ctx=None):
        self.cfg = cfg
        self.global_rate = cfg.prior_acceptance
        # per sequence: discounted accepted / examined counts per position, [2, K], kept apart
        # for trees and chains (a tree's levels are accepted more often than a chain's tokens)
        self._counts: dict[str, dict[int, np.ndarray]] = {m: {} for m in self.MODES}
        target = getattr(ctx, "target", None)
        # how the target's pass is priced: padded rows (a real forward) or each row's own tokens
        self.padded = bool(getattr(target, "pads_rows", False))
        prior = measured_target_cost(target, cfg.k_max + 1, int(getattr(ctx, "slots", 1))) \
            if target is not None else None
        self.target_prior = prior or (1.0, 0.0)
        self.target_fit = LinearFit(cfg.cost_memory, *self.target_prior)   # a_t + b_t tokens
        # a_d steps + b_d row-steps: timed on a draft model like the target (when every row
        # drafts the same k, steps and row-steps are collinear and the fit keeps the prior's
        # split); else relative to one plain pass
        draft = measured_draft_cost(ctx) if prior is not None else None
        self.draft_prior = draft or (cfg.prior_draft_cost * sum(self.target_prior), 0.0)
        # + a fixed cost per round that drafts at all (the first step's shaping, a tree's
        # selection): without it that cost is spread over the steps and deep drafts look dear
        # per mode: a tree's steps feed its frontier and rank children, dearer than a chain's,
        # and one shared fit drew a tree proposer's chains shallower than a chain proposer's
        self.draft_fits = {m: LinearFit3(cfg.cost_memory, (0.0, *self.draft_prior))
                           for m in self.MODES}
        self.rounds = 0
        self.idle_rounds = 0           # rounds in a row in which no row drafted
        # a tree proposer scores `width` nodes per level of depth on average (learned: a priced
        # tree is about a chain where the draft is sure and spreads where it is not); chains 1
        self.tree = ctx is not None and builds_trees(ctx)
        self.width = 1.0
        if self.tree:                   # a tree never scores more than its node budget
            self.max_nodes = scored_nodes(proposer_cfg(ctx))
        self.price = 0.0               # this round's node price (trees): see specflow_node_price
        self.branch_cost = measured_branch_cost(ctx) if self.tree and prior is not None else 0.0
        self.rate: float | None = None  # measured tokens / s of recent rounds (discounted)
        self._done = (0.0, 0.0)         # discounted committed tokens, round seconds
        # a tree proposer's drafting rounds run as trees or as chains (node price 1): what each
        # achieves is measured, and the better one is run (see _mode)
        self.mode = "tree" if self.tree else "chain"
        # per mode, per batch size: discounted committed tokens and seconds of drafting rounds
        self._mode_done: dict[str, dict[int, np.ndarray]] = {m: {} for m in self.MODES}
        self._since_explore = 0        # drafting rounds since one ran in the slower mode
        self._mode_count: dict[str, int] = {}    # drafting rounds run in each mode
        # a real target's rounds without drafts, measured per batch size (the last PLAIN_KEPT):
        # the fit's line is solved on the positions rounds compute, and while every round
        # drafts it only sees 2B.. positions, so its a_t + b_t B for plain decoding is an
        # extrapolation (too dear, so drafting looked worth it: docs/decisions.md, "Plain
        # decoding is measured, not extrapolated")
        self._plain: dict[int, deque[float]] = {}
        self._since_plain: dict[int, int] = {}   # drafting rounds per batch size since its last
                                                 # round without drafts (kept by observe)
        self._drafted: dict[int, int] = {}       # drafting rounds per batch size (kept by observe)
        # a draft model catches a row up on the tokens it has not fed before the row drafts (a
        # new prompt; tokens committed while the row was at k = 0): seconds = c x tokens, c
        # timed at build and fitted on the rounds' catch-up seconds
        self.catch_up = LinearFit(cfg.cost_memory, 0.0, measured_catch_up_cost(ctx)
                                  if prior is not None else 0.0)
        self._seen: dict[int, int] = {}    # request id -> tokens its draft holds (after drafting)
        self._fed: dict[int, tuple[int, int]] = {}   # this round's drafting rows: (length, lag)

    # --- what the decision reads (the oracle overrides these) ---------------------------------

    PRIOR = 2.0        # pseudo-observations behind each shrinkage
    MODES = ("tree", "chain")
    MODE_EXPLORE = 10  # drafting rounds per round run in the mode measured slower, when the
    MODE_NOISE = 0.05  # two are within this (relative); further apart, proportionally fewer
    MODE_FIRST, MODE_SURE = 4, 12   # rounds each mode runs first; rounds before a gap counts

    def acceptance(self, batch) -> np.ndarray:
        """Per row and draft position, the estimated chance of acceptance: [B, K]."""
        K = self.cfg.k_max
        fresh = np.zeros((2, K))
        c = np.stack([self.counts.get(rid, fresh) for rid in batch.request_ids]) \
            if batch.request_ids else np.zeros((0, 2, K))                       # [B, 2, K]
        acc, seen = c[:, 0], c[:, 1]                                             # [B, K]
        rate = (acc.sum(1, keepdims=True) + self.PRIOR * self.global_rate) \
            / (seen.sum(1, keepdims=True) + self.PRIOR)                          # [B, 1]
        mean = (acc + self.PRIOR * rate) / (seen + self.PRIOR)                   # [B, K]
        # optimism where little is known, so a sequence that could draft deeper finds out
        bonus = self.cfg.optimism * np.sqrt(mean * (1 - mean) / (seen + self.PRIOR))
        return np.minimum(mean + bonus, 1.0)

    @property
    def draft_fit(self) -> LinearFit3:
        """The current mode's draft cost fit."""
        return self.draft_fits[self.mode]

    def costs(self) -> tuple[float, float, float, float]:
        """(a_t, b_t, a_d, b_d): the pass's fixed cost and per position, the draft's per step
        and per drafted token."""
        return (*self.target_fit.coef(), *self.draft_fit.coef()[1:])

    def draft_overhead(self) -> float:
        """Seconds a round spends on drafting at all, beyond its steps and tokens."""
        return self.draft_fit.coef()[0]

    PLAIN_KEPT, PLAIN_FIRST = 5, 3   # rounds without drafts kept per batch size; measured first
    MIN_DRAFTED = 4                  # drafting rounds at a batch size before plain is measured

    def plain_seconds(self, batch_size: int) -> float | None:
        """Seconds of a round without drafts at this batch size as measured (a real target):
        the median of the last PLAIN_KEPT, so one slow round does not set it; None before any."""
        times = self._plain.get(batch_size)
        return statistics.median(times) if times else None     # (numpy's: 30x the time)

    def _check_plain(self, k: list[int], size: int) -> list[int]:
        """The k = 0 choice is priced by measured rounds without drafts at this batch size, not
        by the cost fit's extrapolation (the fit sees the positions drafting rounds compute, 2B
        and more, and a few percent off decides near the break-even). So at a batch size that
        has drafted MIN_DRAFTED rounds (past the first rounds' warm-up), the next PLAIN_FIRST
        rounds run without drafts, and then one after every explore_every drafting rounds."""
        if not (self.padded and size and any(k)):
            return k
        first = self._drafted.get(size, 0) >= self.MIN_DRAFTED \
            and len(self._plain.get(size, ())) < self.PLAIN_FIRST
        if first or self._since_plain.get(size, 0) >= self.cfg.explore_every:
            return [0] * size
        return k

    LAG_FREE = 2       # tokens a row's draft may lag and catch up in its first step, for nothing

    def catch_up_costs(self, batch, acceptance: np.ndarray) -> np.ndarray:
        """Per row, seconds of the draft's catch-up charged to a round in which it drafts: the
        tokens its draft has not fed (a new prompt, tokens committed while it idled) at the
        measured seconds per token, spread over the drafting rounds the row has left (its
        remaining tokens over the most a round can commit), since catching up once lets every
        later round draft. [B]"""
        c = self.catch_up.coef()[1]
        if c <= 0:
            return np.zeros(batch.size)
        lag = np.array([max(0, len(ids) - self._seen.get(rid, 0) - self.LAG_FREE)
                        for rid, ids in zip(batch.request_ids, batch.token_ids)], dtype=float)
        left = np.array([max(1, cap - batch.num_generated(b))
                         for b, cap in enumerate(batch.max_new_tokens)], dtype=float)
        rounds = np.maximum(1.0, left / expected_tokens(acceptance)[:, -1])
        return c * lag / rounds

    @property
    def counts(self) -> dict[int, np.ndarray]:
        """The current mode's acceptance counts by request id."""
        return self._counts[self.mode]

    def _mode(self) -> str:
        """Trees or chains this round, for a tree proposer. The pricing of branches cannot see
        every cost a tree adds (ranking children per level, the tree mask, shaping along each
        path), and those differ by machine and model, so the two are compared on what their
        drafting rounds achieve (committed tokens against plain decoding's in the same seconds,
        discounted): each runs MODE_FIRST rounds first, then the better one runs, and one round
        in MODE_EXPLORE runs the other, so a change of traffic is noticed (once the other has
        MODE_SURE rounds, one in MODE_EXPLORE x gap / MODE_NOISE when it measured further
        behind, at most 10x fewer: exploring a mode 20% slower one round in 10 cost 2%). Under
        load neither matters: k falls to 0."""
        counts = {m: self._mode_count.get(m, 0) for m in self.MODES}
        untried = [m for m in self.MODES if counts[m] < self.MODE_FIRST]
        if untried:                          # each tried a few rounds first, taking turns
            return min(untried, key=counts.__getitem__)
        a, b = self.target_fit.coef()

        def speedup(by_batch: dict[int, np.ndarray]) -> float:
            # tokens over what plain decoding commits in the same seconds at each batch (one
            # pass, a + b B, commits B), with today's fit for both modes
            tokens = sum(done[0] for done in by_batch.values())
            plain = sum(done[1] * B / max(self.plain_seconds(B) or a + b * B, 1e-12)
                        for B, done in by_batch.items())
            return tokens / max(plain, 1e-12)
        score = {m: speedup(self._mode_done[m]) for m in self.MODES}
        best = max(self.MODES, key=score.__getitem__)
        other = next(m for m in self.MODES if m != best)
        gap = 1 - score[other] / max(score[best], 1e-12)
        # a gap measured on few rounds is noise: the slower mode keeps its one round in
        # MODE_EXPLORE until it has MODE_SURE of them
        sure = counts[other] >= self.MODE_SURE
        every = self.MODE_EXPLORE * (min(max(1.0, gap / self.MODE_NOISE), 10.0) if sure else 1.0)
        self._since_explore += 1
        if self._since_explore >= every:
            self._since_explore = 0
            return other
        return best

    @property
    def positions(self) -> np.ndarray | None:
        """Positions a row scores per depth k = 0..k_max: k + 1 for a chain (None), 1 + k x
        the tree's learned width for a tree, at most its node budget + 1."""
        if self.mode != "tree":
            return None
        return 1 + np.minimum(self.width * np.arange(self.cfg.k_max + 1), self.max_nodes)

    # --- hooks ------------------------------------------------------------------------------------

    @hookimpl
    def specflow_draft_length(self, batch):
        if self.tree and batch.size:     # first: the mode's own acceptance sets k
            self.mode = self._mode()
        acceptance = self.acceptance(batch)                                      # [B, K]
        a_t, b_t, a_d, b_d = self.costs()
        # a depth-k tree drafts about w k nodes: b_d per drafted node
        b_node = b_d * (self.width if self.mode == "tree" else 1.0)
        if self.padded:
            k = self._check_plain(choose_k_padded(
                acceptance, a_t, b_t, a_d, b_node, positions=self.positions,
                first=self.draft_overhead(), plain=self.plain_seconds(batch.size),
                row_first=lambda: self.catch_up_costs(batch, acceptance)), batch.size)
        else:
            k = choose_k(acceptance, a_t, b_t, a_d, b_node, positions=self.positions,
                         first=self.draft_overhead())
        if self.mode == "chain":
            self.price = 1.0           # no branch is worth a position: the draft's own chain
        elif batch.size:
            # a node is worth scoring when its chance of acceptance beats the tokens it
            # displaces: the round's rate (tokens / s) x what one more node costs, scored
            # and drafted beside its siblings (Dinkelbach: maximise tokens - rate x seconds);
            # until a round is measured, plain decoding's rate at this batch
            rate = self.rate if self.rate is not None else \
                batch.size / max(a_t + b_t * batch.size, 1e-12)
            # with padded rows a branch mostly lengthens one row, which widens every row's
            # pass: B positions for one node's gain
            scored = b_t * (batch.size if self.padded else 1)
            self.price = min(1.0, rate * (scored + self.branch_cost))
            if self.price >= 1.0:       # no branch can pay: drafted (and counted) as a chain
                self.mode = "chain"
        self.rounds += 1
        self.idle_rounds = self.idle_rounds + 1 if batch.size and not any(k) else 0
        # keep measuring what drafting costs and gains: after a stretch of rounds without drafts,
        # the likeliest row probes k = 1. With padded rows the probe makes every row score one
        # more position, so it comes B times less often (the same share of the time at any load)
        if self.idle_rounds >= self.cfg.explore_every * (batch.size if self.padded else 1):
            k[int(acceptance[:, 0].argmax())] = 1
            self.idle_rounds = 0
        # the rows that draft: what their drafts are caught up on (observe learns its seconds)
        self._fed = {rid: (len(ids), max(0, len(ids) - self._seen.get(rid, 0) - self.LAG_FREE))
                     for rid, ids, kb in zip(batch.request_ids, batch.token_ids, k) if kb}
        return torch.tensor(k, dtype=torch.long)

    @hookimpl
    def specflow_node_price(self, batch, k):
        if not self.tree:
            return None
        return torch.full((batch.size,), self.price, dtype=torch.float64)

    @hookimpl
    def specflow_observe(self, result):
        K, keep = self.cfg.k_max, 1 - self.cfg.ewma
        g = self.cfg.ewma / 10                          # the global rate moves slower
        levels = result.num_examined or [None] * len(result.request_ids)
        for rid, k, acc, seen in zip(result.request_ids, result.num_drafts, result.num_accepted,
                                     levels):
            if k == 0:
                # what a sequence not drafting knows fades, so it is probed again later rather
                # than written off after one unlucky stretch
                if rid in self.counts:
                    self.counts[rid] *= keep
                continue
            examined = min(acc + 1, k) if seen is None else seen     # a tree: levels tried
            if examined == 0:
                continue
            self.global_rate = (1 - g) * self.global_rate + g * acc / examined
            counts = self.counts.setdefault(rid, np.zeros((2, K)))
            counts *= keep
            n = min(examined, K)
            counts[0, :min(acc, n)] += 1.0               # accepted at positions 1..acc
            counts[1, :n] += 1.0                          # examined at positions 1..n
        times = result.sim_time or result.seconds
        # the throughput a tree node must beat (specflow_node_price): what rounds achieve
        spent = sum(times.values())
        if spent > 0:
            keep = 1 - self.cfg.cost_memory
            tokens, seconds = self._done
            self._done = (keep * tokens + sum(len(c) for c in result.committed),
                          keep * seconds + spent)
            self.rate = self._done[0] / self._done[1]
        # the pass and what follows it per scored position (shaping, verification, commits, cache
        # sync: measured together, so a position is priced at all it costs); a simulated clock
        # charges the pass alone
        target = times.get("target", 0.0) + (0.0 if result.sim_time else sum(
            times.get(stage, 0.0) for stage in ("verify", "trim", "sync")))
        draft = times.get("draft", times.get("propose", 0.0))
        longest = max(result.num_drafts, default=0)
        # the positions the pass computed (a tree's nodes): every row padded to the longest, or
        # each its own
        tokens = (longest + 1) * len(result.num_drafts) if self.padded \
            else sum(k + 1 for k in result.num_drafts)
        if target > 0:
            self.target_fit.add(tokens, target)
        levels = result.draft_lengths()             # draft steps: a tree's depth
        if longest and draft > 0:                   # steps, and tokens drafted (a tree's nodes)
            self.draft_fit.add((1.0, max(levels), sum(result.num_drafts)), draft)
        # the draft's catch-up: seconds per token fed, and what each drafting row's draft holds
        # now (everything committed but the last token, which the next round feeds)
        # (a row the length cap or the draft's own context held at k = 0 was not fed)
        fed = [(rid, c) for rid, k, c in zip(result.request_ids, result.num_drafts,
                                             result.committed) if k and rid in self._fed]
        lagged = sum(self._fed[rid][1] for rid, _ in fed)
        if lagged:
            self.catch_up.add(lagged, times.get("prefill", 0.0))
        for rid, committed in fed:
            self._seen[rid] = self._fed[rid][0] + len(committed) - 1
        self._fed = {}
        # the round's own work: a new prompt's catch-up is not the mode's, the policy's time
        # is every round's
        work = spent - times.get("prefill", 0.0) - times.get("policy", 0.0)
        size = len(result.num_drafts)
        if self.padded and not longest and work > 0:   # plain decoding at this batch, measured
            self._plain.setdefault(size, deque(maxlen=self.PLAIN_KEPT)).append(work)
            self._since_plain[size] = 0
        elif longest:
            self._since_plain[size] = self._since_plain.get(size, 0) + 1
            self._drafted[size] = self._drafted.get(size, 0) + 1
        if longest and work > 0:                    # what this round's mode achieved, by batch
            by_batch = self._mode_done[self.mode]
            for done in by_batch.values():
                done *= 1 - self.cfg.cost_memory
            by_batch.setdefault(size, np.zeros(2))[:] += \
                [sum(len(c) for c in result.committed), work]
            self._mode_count[self.mode] = self._mode_count.get(self.mode, 0) + 1
        if self.mode == "tree" and sum(levels):    # nodes per level of the trees just scored
            w = sum(result.num_drafts) / sum(levels)
            self.width = (1 - self.cfg.ewma) * self.width + self.cfg.ewma * w

    @hookimpl
    def specflow_run_start(self, pipeline, requests):
        # a new run's throughput is its own (a batch of 16 before must not price a batch of 1)
        self.rate, self._done = None, (0.0, 0.0)

    def _forget(self, request_id: int) -> None:
        for counts in self._counts.values():
            counts.pop(request_id, None)
        self._seen.pop(request_id, None)

    @hookimpl
    def specflow_request_start(self, slot, request):
        self._forget(request.request_id)              # a fresh request never inherits state

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self._forget(request.request_id)


@dataclass
class OraclePolicyConfig(GoodputPolicyConfig):
    name: str = "oracle"


class OraclePolicy(GoodputPolicy):
    """The goodput rule with the synthetic pair's true acceptance and costs (experiments only)."""

    def __init__(self, cfg: OraclePolicyConfig, ctx):
        from specflow.models.synthetic import SyntheticBackend, acceptance_for_noise

        super().__init__(cfg, ctx)
        target, draft = ctx.target, ctx.draft
        if not isinstance(target, SyntheticBackend) or not isinstance(draft, SyntheticBackend):
            raise ConfigError("policy=oracle knows the truth only for model=synthetic "
                              "draft=synthetic; use policy=goodput for other models")
        self.draft = draft
        self._acc = lambda noise: acceptance_for_noise(draft.base, noise)
        self.true_costs = (target.cfg.step_cost, target.cfg.token_cost, draft.cfg.step_cost,
                           draft.cfg.token_cost)

    def acceptance(self, batch) -> np.ndarray:
        values = [self._acc(self.draft.noise_of(s)) for s in batch.slots.tolist()]
        return np.repeat(np.asarray(values, dtype=np.float64)[:, None], self.cfg.k_max, 1)

    def costs(self):
        return self.true_costs

    def draft_overhead(self) -> float:
        return 0.0
