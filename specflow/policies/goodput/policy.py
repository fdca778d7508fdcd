"""`policy=goodput`: per sequence, per round, the k that maximises committed tokens per second.

The policy is its parts, wired here: each round it reads the acceptance estimates
(acceptance.py) and the fitted costs (fits.py, seeded by the passes timed once the pipeline is
built: costs.py), chooses k (choose.py), forces the rounds that keep plain decoding and drafting
measured (explore.py), and for a tree proposer picks trees or chains (modes.py) and publishes a
node price (pricing.py). A row whose draft must catch up first is charged for it (catch_up.py).

Costs are fitted by exponentially weighted least squares on the measured stage times (the
synthetic backend's simulated clock when there is one): the target pass, with the shaping,
verification and cache sync that follow it, as a line over the positions it computes (rows x
(the longest k + 1) for a real forward, which pads its rows to one length; the sum over rows of
k + 1 for the synthetic pair's clock), and the drafting as a fixed cost per drafting round plus
a cost per step and per drafted token. A tree proposer's depth-k tree is priced as 1 + w k
positions, w learned (pricing.TreeSize), and its rounds' acceptance and draft costs are kept per
mode (a tree's steps feed a frontier and rank children: dearer than a chain's).

The policy asks the proposer what drafting costs through hooks, never by its name: its timed
draft step (`specflow_draft_step_seconds`, once, in specflow_pipeline_built) and each row's
catch-up tokens (`specflow_catch_up_tokens`, each round it may draft). A proposer that answers
neither (n-gram lookup) has its drafting learned from the rounds alone, from a prior of
prior_draft_cost target passes per step, and owes no catch-up.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.policies.goodput.acceptance import AcceptanceEstimates
from specflow.policies.goodput.catch_up import CatchUpCosts
from specflow.policies.goodput.choose import choose_k, choose_k_padded, expected_tokens
from specflow.policies.goodput.costs import MeasuredCosts, measure
from specflow.policies.goodput.explore import IdleProbes, PlainRounds
from specflow.policies.goodput.fits import DraftCostFit, LineFit
from specflow.policies.goodput.modes import MODES, ModeChooser
from specflow.policies.goodput.pricing import RecentThroughput, TreeSize, node_price
from specflow.stages.layout import scored_nodes, tree_width


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


def proposer_cfg(ctx):
    """The pipeline's proposer config node, or None (a policy built without a pipeline)."""
    return ctx.cfg.get("proposer") if getattr(ctx, "cfg", None) is not None else None


class GoodputPolicy:
    """ctx: the pipeline's BuildContext (its target, slots, proposer config and hook relay), or
    None: then nothing is timed or asked and the priors stand until rounds are observed."""

    def __init__(self, cfg: GoodputPolicyConfig, ctx=None):
        self.cfg = cfg
        self.target = getattr(ctx, "target", None)
        self.slots = int(getattr(ctx, "slots", 1))
        self.hook = getattr(ctx, "hook", None)       # the pipeline's hook relay
        # how the target's pass is priced: padded rows (a real forward) or each row's own tokens
        self.padded = bool(getattr(self.target, "pads_rows", False))
        # a tree proposer (proposer.topk > 1) scores `width` nodes per level of depth on average
        proposer = proposer_cfg(ctx)
        self.tree_width = tree_width(proposer)
        self.tree = self.tree_width > 1
        self.tree_size = TreeSize(scored_nodes(proposer) if self.tree else 0, cfg.ewma)
        # its drafting rounds run as trees or as chains (node price 1): what each achieves is
        # measured, and the better one is run (modes.py)
        self.mode = "tree" if self.tree else "chain"
        self.modes = ModeChooser(cfg.cost_memory)
        self.estimates = AcceptanceEstimates(cfg.k_max, cfg.ewma, cfg.prior_acceptance,
                                             cfg.optimism, MODES)
        self.price = 0.0                # this round's node price (trees): see specflow_node_price
        self.throughput = RecentThroughput(cfg.cost_memory)
        self.plain = PlainRounds(cfg.explore_every, self.padded)
        self.probes = IdleProbes(cfg.explore_every, self.padded)
        self.use_costs(MeasuredCosts())       # the priors, until timed passes

    def use_costs(self, timed: MeasuredCosts) -> None:
        """Start the cost fits from passes timed at build (costs.py), or from the priors where
        nothing was timed: a pass of 1 (fixed), a draft step prior_draft_cost of a pass."""
        cfg = self.cfg
        self.measured = timed
        self.target_prior = timed.target or (1.0, 0.0)
        self.target_fit = LineFit(cfg.cost_memory, *self.target_prior)   # a_t + b_t positions
        # a_d steps + b_d drafted tokens: timed like the target (when every row drafts the same
        # k, steps and tokens are collinear and the fit keeps the prior's split); else relative
        # to one plain pass
        self.draft_prior = timed.draft or (cfg.prior_draft_cost * sum(self.target_prior), 0.0)
        # + a fixed cost per round that drafts at all (the first step's shaping, a tree's
        # selection), per mode: a tree's steps feed its frontier and rank children, dearer than
        # a chain's, and one shared fit drew a tree proposer's chains shallower than a chain
        # proposer's
        self.draft_fits = {m: DraftCostFit(cfg.cost_memory, (0.0, *self.draft_prior))
                           for m in MODES}
        self.branch_cost = timed.branch if self.tree else 0.0   # one more frontier node, drafted
        self.catch_up = CatchUpCosts(cfg.cost_memory, timed.catch_up)

    def step_seconds(self, rows: int, positions: int) -> float | None:
        """One draft step's seconds as the proposer times it, or None (no proposer drafts with
        a model, or no pipeline)."""
        if self.hook is None:
            return None
        return self.hook.specflow_draft_step_seconds(rows=rows, positions=positions)

    def catch_up_tokens(self, batch) -> list[int] | None:
        """Per row, the tokens the proposer's model must be fed before it drafts, beyond those
        a step feeds for free; None when no proposer answers."""
        if self.hook is None:
            return None
        return self.hook.specflow_catch_up_tokens(batch=batch)

    # --- what the decision reads (the oracle overrides these) ---------------------------------

    def acceptance(self, batch) -> np.ndarray:
        """Per row and draft position, the estimated chance of acceptance: [B, K]."""
        return self.estimates.estimate(batch.request_ids, self.mode)

    @property
    def draft_fit(self) -> DraftCostFit:
        """The current mode's draft cost fit."""
        return self.draft_fits[self.mode]

    def costs(self) -> tuple[float, float, float, float]:
        """(a_t, b_t, a_d, b_d): the pass's fixed cost and per position, the draft's per step
        and per drafted token."""
        return (*self.target_fit.coef(), *self.draft_fit.coef()[1:])

    def draft_overhead(self) -> float:
        """Seconds a round spends on drafting at all, beyond its steps and tokens."""
        return self.draft_fit.coef()[0]

    def plain_seconds(self, batch_size: int) -> float | None:
        """Seconds of a round without drafts at this batch size as measured (a real target);
        None before any."""
        return self.plain.seconds(batch_size)

    def catch_up_costs(self, batch, acceptance: np.ndarray, owed: list[int] | None = None
                       ) -> np.ndarray:
        """Per row, seconds of the draft's catch-up charged to a round in which it drafts: the
        tokens its draft owes (`owed`, else the proposer is asked) at the per-token cost, spread
        over the drafting rounds the row has left. [B]"""
        if self.catch_up.per_token <= 0:
            return np.zeros(batch.size)
        if owed is None:
            owed = self.catch_up_tokens(batch)
        if owed is None:
            return np.zeros(batch.size)
        left = [cap - batch.num_generated(b) for b, cap in enumerate(batch.max_new_tokens)]
        return self.catch_up.seconds(owed, left, expected_tokens(acceptance)[:, -1])

    @property
    def positions(self) -> np.ndarray | None:
        """Positions a row scores per depth k = 0..k_max: k + 1 for a chain (None), 1 + k x
        the tree's learned width for a tree, at most its node budget + 1."""
        if self.mode != "tree":
            return None
        return self.tree_size.positions(self.cfg.k_max)

    def choose_mode(self) -> str:
        """Trees or chains for this round's drafts (a tree proposer), on what each achieved
        against plain decoding at its batch (measured, else the cost fit's a + b B)."""
        a, b = self.target_fit.coef()
        return self.modes.choose(lambda B: self.plain_seconds(B) or a + b * B)

    # --- hooks ------------------------------------------------------------------------------------

    @hookimpl
    def specflow_pipeline_built(self, pipeline):
        # every stage is registered: time the target's passes and ask the proposer for its
        # draft step's (a real target only: a simulated clock is the truth)
        from specflow.backends import choice_cache

        with choice_cache.recording() as self.choices:
            self.use_costs(measure(self.target, self.slots, self.cfg.k_max + 1,
                                   self.step_seconds, self.tree_width,
                                   key=self._cost_key(pipeline)))

    def describe(self) -> dict:
        """metrics.json `backends.policy`: where the costs timed at build came from ("cache":
        read back from an earlier run's, "timed": measured now; backends/choice_cache.py)."""
        choices = getattr(self, "choices", None)
        return {"choices": dict(choices)} if choices else {}

    def _cost_key(self, pipeline) -> dict | None:
        """What the timed drafting depends on, for the seconds kept on disk
        (backends/choice_cache.py): the proposer's settings, the draft model's key (once built)
        and a head's description; None (keep nothing) without a pipeline or a target key."""
        from omegaconf import OmegaConf

        if pipeline is None or self.target is None or self.target.choice_key() is None:
            return None
        draft = pipeline.ctx._draft
        proposer = pipeline.cfg.get("proposer")
        return {"proposer": None if proposer is None else OmegaConf.to_container(proposer,
                                                                                 resolve=True),
                "draft": None if draft is None else draft.choice_key(),
                "head": pipeline.backends.get("proposer")}

    @hookimpl
    def specflow_draft_length(self, batch):
        if self.tree and batch.size:     # first: the mode's own acceptance sets k
            self.mode = self.choose_mode()
        acceptance = self.acceptance(batch)                                      # [B, K]
        a_t, b_t, a_d, b_d = self.costs()
        # a depth-k tree drafts about w k nodes: b_d per drafted node
        b_node = b_d * (self.tree_size.width if self.mode == "tree" else 1.0)
        owed: list[list[int] | None] = []         # the proposer's answer, asked at most once

        def catch_up_tokens():
            if not owed:
                owed.append(self.catch_up_tokens(batch))
            return owed[0]

        if self.padded:
            k = self.plain.check(choose_k_padded(
                acceptance, a_t, b_t, a_d, b_node, positions=self.positions,
                first=self.draft_overhead(), plain=self.plain_seconds(batch.size),
                row_first=lambda: self.catch_up_costs(batch, acceptance, catch_up_tokens())))
        else:
            k = choose_k(acceptance, a_t, b_t, a_d, b_node, positions=self.positions,
                         first=self.draft_overhead())
        if self.mode == "chain":
            self.price = 1.0           # no branch is worth a position: the draft's own chain
        elif batch.size:
            # a node is worth scoring when its chance of acceptance beats the tokens it
            # displaces (Dinkelbach: maximise tokens - rate x seconds); until a round is
            # measured, plain decoding's rate at this batch
            rate = self.throughput.rate
            if rate is None:
                rate = batch.size / max(a_t + b_t * batch.size, 1e-12)
            self.price = node_price(rate, b_t, batch.size, self.padded, self.branch_cost)
            if self.price >= 1.0:       # no branch can pay: drafted (and counted) as a chain
                self.mode = "chain"
        k = self.probes.probe(k, acceptance)
        # the rows that draft: what their drafts catch up on (observe learns its seconds)
        self.catch_up.drafting(batch.request_ids, catch_up_tokens() if any(k) else None, k)
        return torch.tensor(k, dtype=torch.long)

    @hookimpl
    def specflow_node_price(self, batch, k):
        if not self.tree:
            return None
        return torch.full((batch.size,), self.price, dtype=torch.float64)

    @hookimpl
    def specflow_observe(self, result):
        self.estimates.observe(result, self.mode)
        times = result.sim_time or result.seconds
        # the throughput a tree node must beat (specflow_node_price): what rounds achieve
        spent = sum(times.values())
        if spent > 0:
            self.throughput.add(sum(len(c) for c in result.committed), spent)
        # the pass and what follows it per scored position (shaping, verification, commits, cache
        # sync: measured together, so a position is priced at all it costs); a simulated clock
        # charges the pass alone
        target = times.get("target", 0.0) + (0.0 if result.sim_time else sum(
            times.get(stage, 0.0) for stage in ("verify", "trim", "sync")))
        draft = times.get("draft", times.get("propose", 0.0))
        longest = max(result.num_drafts, default=0)
        # the positions the pass computed (a tree's nodes): every row padded to the longest, or
        # each its own
        positions = (longest + 1) * len(result.num_drafts) if self.padded \
            else sum(k + 1 for k in result.num_drafts)
        if target > 0:
            self.target_fit.add(positions, target)
        levels = result.draft_lengths()             # draft steps: a tree's depth
        if longest and draft > 0:                   # steps, and tokens drafted (a tree's nodes)
            self.draft_fit.add(max(levels), sum(result.num_drafts), draft)
        self.catch_up.observe(result, times.get("prefill", 0.0))
        # the round's own work: a new prompt's catch-up is not the mode's, the policy's time
        # is every round's
        work = spent - times.get("prefill", 0.0) - times.get("policy", 0.0)
        size = len(result.num_drafts)
        self.plain.record(size, bool(longest), work)
        if longest and work > 0:                    # what this round's mode achieved, by batch
            self.modes.record(self.mode, size, sum(len(c) for c in result.committed), work)
        if self.mode == "tree":                     # nodes per level of the trees just scored
            self.tree_size.observe(sum(result.num_drafts), sum(levels))

    @hookimpl
    def specflow_run_start(self, pipeline, requests):
        # a new run's throughput is its own (a batch of 16 before must not price a batch of 1)
        self.throughput.reset()

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.estimates.forget(request.request_id)     # a fresh request never inherits state

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.estimates.forget(request.request_id)
