"""`policy=goodput`: per sequence, per round, the k that maximises committed tokens per second.

Two things are learned online, nothing is hand-set:
- acceptance: for each sequence and draft position j, the chance that draft j is accepted once
  drafts 1..j-1 were: discounted counts (accepted / examined at j) shrunk towards the sequence's
  own rate over all positions, which is shrunk towards the running global rate — so positions a
  sequence has not tried yet are estimated from what it has, and a new sequence starts from
  everyone's average;
- cost: the target pass time as a linear function of the tokens it scores (sum over rows of
  k+1) and the draft time per step as a linear function of the rows drafting, fitted by
  exponentially weighted least squares on the measured stage times (the synthetic backend's
  simulated clock when there is one). A real target's fit starts from two passes timed when the
  policy is built (one position in one row; k_max+1 in every slot): steady rounds alone cannot
  tell the fixed cost of a pass from its cost per position.

Each round, each sequence takes the k that maximises its own expected tokens per unit of its own
cost: E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j over a_t/B + b_t (k+1) + k (b_d + a_d/B), where the
round's fixed costs (a_t for the target pass, a_d per draft step) are shared by the B running
sequences. With a full queue this minimises the total cost of the work (each slot should turn
tokens out as cheaply as it can); under load b_t (k+1) dominates and k falls towards 0 on its own.
`policy=oracle` is the same rule fed the synthetic pair's true acceptance and costs (the yardstick
of the policy experiment).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl


@dataclass
class GoodputPolicyConfig:
    name: str = "goodput"
    k_max: int = 8
    ewma: float = 0.1              # weight of the newest round in each acceptance estimate
    cost_memory: float = 0.05      # weight of the newest round in the cost fits
    prior_acceptance: float = 0.7  # before anything is measured
    prior_draft_cost: float = 0.1  # draft step / target pass before anything is measured
    explore_every: int = 50        # rounds; when every row is at k = 0, let one row probe k = 1
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
        self.memory, self.prior = memory, torch.tensor([a, b], dtype=torch.float64)
        self.xx = torch.zeros(2, 2, dtype=torch.float64)
        self.xy = torch.zeros(2, dtype=torch.float64)
        self.n = 0.0

    def add(self, x1: float, x2: float, y: float) -> None:
        x = torch.tensor([x1, x2], dtype=torch.float64)
        d = 1 - self.memory
        self.xx, self.xy, self.n = d * self.xx + torch.outer(x, x), d * self.xy + x * y, d * self.n + 1

    def coef(self) -> tuple[float, float]:
        if self.n == 0:
            return tuple(self.prior.tolist())
        lam = self.RIDGE * self.xx.diagonal() + 1e-12               # per coefficient: scale-free
        sol = torch.linalg.solve(self.xx + torch.diag(lam), self.xy + lam * self.prior)
        a, b = sol.clamp(min=0).tolist()
        return a, b


def expected_tokens(acceptance: torch.Tensor) -> torch.Tensor:
    """acceptance [B, K] (per position) -> E(k) [B, K+1] for k = 0..K."""
    gain = acceptance.clamp(0, 1).cumprod(1)                                     # [B, K]
    return torch.cat([torch.ones(len(gain), 1, dtype=gain.dtype), 1 + gain.cumsum(1)], 1)


def choose_k(acceptance: torch.Tensor, a_t: float, b_t: float, a_d: float, b_d: float,
             rounds: int = 3) -> list[int]:
    """acceptance [B, K] -> per row, the k in 0..K maximising E(k) / its cost share.

    A row's share of a round: a_t / B of the target pass's fixed cost, b_t per position it adds,
    b_d per draft step it takes, and a_d / n_i for its i-th draft step, which the n_i rows
    drafting at least i tokens share. n depends on everyone's k: a few fixed-point passes.
    """
    B, K = acceptance.shape
    if B == 0:
        return []
    E = expected_tokens(acceptance)                                              # [B, K+1]
    k = torch.arange(K + 1, dtype=E.dtype)                                       # [K+1]
    choice = torch.full((B,), K)
    for _ in range(rounds):
        sharing = (choice[:, None] >= torch.arange(1, K + 1)[None, :]).sum(0)   # [K] n_i
        step_share = a_d / sharing.clamp(min=1).to(E.dtype)                     # [K]
        cost = a_t / B + b_t * (k + 1) + b_d * k + torch.cat(
            [torch.zeros(1, dtype=E.dtype), step_share.cumsum(0)])               # [K+1]
        new = (E / cost.clamp_min(1e-12)).argmax(1)                              # [B]
        if torch.equal(new, choice):
            break
        choice = new
    return choice.tolist()


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


def measured_draft_cost(ctx) -> tuple[float, float] | None:
    """(a_d, b_d) seconds per draft step and per drafting row, from one-position passes of the
    draft model (or steps of a draft head) in one row and in every slot; None for proposers
    without either (n-gram)."""
    from specflow.models.threads import pass_seconds

    proposer = ctx.cfg.get("proposer") if getattr(ctx, "cfg", None) is not None else None
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


class GoodputPolicy:
    def __init__(self, cfg: GoodputPolicyConfig, ctx=None):
        self.cfg = cfg
        self.global_rate = cfg.prior_acceptance
        # per sequence: discounted accepted / examined counts, per position [K] and in all
        self.counts: dict[int, list[torch.Tensor]] = {}
        target = getattr(ctx, "target", None)
        prior = measured_target_cost(target, cfg.k_max + 1, int(getattr(ctx, "slots", 1))) \
            if target is not None else None
        self.target_prior = prior or (1.0, 0.0)
        self.target_fit = LinearFit(cfg.cost_memory, *self.target_prior)   # a_t + b_t tokens
        # a_d steps + b_d row-steps: timed on a draft model like the target (when every row
        # drafts the same k, steps and row-steps are collinear and the fit keeps the prior's
        # split); else relative to one plain pass
        draft = measured_draft_cost(ctx) if prior is not None else None
        self.draft_prior = draft or (cfg.prior_draft_cost * sum(self.target_prior), 0.0)
        self.draft_fit = LinearFit2(cfg.cost_memory, *self.draft_prior)
        self.rounds = 0

    # --- what the decision reads (the oracle overrides these) ---------------------------------

    PRIOR = 2.0        # pseudo-observations behind each shrinkage

    def acceptance(self, batch) -> torch.Tensor:
        K, out = self.cfg.k_max, []
        for rid in batch.request_ids:
            c = self.counts.get(rid)
            if c is None:
                out.append(torch.full((K,), self.global_rate))
                continue
            acc, seen = c
            rate = (acc.sum() + self.PRIOR * self.global_rate) / (seen.sum() + self.PRIOR)
            mean = (acc + self.PRIOR * rate) / (seen + self.PRIOR)                  # [K]
            # optimism where little is known, so a sequence that could draft deeper finds out
            bonus = self.cfg.optimism * (mean * (1 - mean) / (seen + self.PRIOR)).sqrt()
            out.append((mean + bonus).clamp(max=1.0))
        return torch.stack(out) if out else torch.zeros(0, K)                  # [B, K]

    def costs(self) -> tuple[float, float, float, float]:
        return (*self.target_fit.coef(), *self.draft_fit.coef())

    # --- hooks ------------------------------------------------------------------------------------

    @hookimpl
    def specflow_draft_length(self, batch):
        k = choose_k(self.acceptance(batch), *self.costs())
        self.rounds += 1
        if batch.size and not any(k) and self.rounds % self.cfg.explore_every == 0:
            best = int(self.acceptance(batch)[:, 0].argmax())
            k[best] = 1                               # keep measuring what drafting costs
        return torch.tensor(k, dtype=torch.long)

    @hookimpl
    def specflow_observe(self, result):
        K, keep = self.cfg.k_max, 1 - self.cfg.ewma
        g = self.cfg.ewma / 10                          # the global rate moves slower
        for rid, k, acc in zip(result.request_ids, result.num_drafts, result.num_accepted):
            if k == 0:
                # what a sequence not drafting knows fades, so it is probed again later rather
                # than written off after one unlucky stretch
                if rid in self.counts:
                    for c in self.counts[rid]:
                        c.mul_(keep)
                continue
            examined = min(acc + 1, k)
            self.global_rate = (1 - g) * self.global_rate + g * acc / examined
            counts = self.counts.setdefault(rid, [torch.zeros(K), torch.zeros(K)])
            counts[0].mul_(keep)
            counts[1].mul_(keep)
            n = min(examined, K)
            counts[0][:min(acc, n)] += 1.0               # accepted at positions 1..acc
            counts[1][:n] += 1.0                          # examined at positions 1..n
        times = result.sim_time or result.seconds
        target = times.get("target", 0.0)
        draft = times.get("draft", times.get("propose", 0.0))
        tokens = sum(k + 1 for k in result.num_drafts)
        if target > 0:
            self.target_fit.add(tokens, target)
        steps = max(result.num_drafts, default=0)
        if steps and draft > 0:
            self.draft_fit.add(steps, sum(result.num_drafts), draft)

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.counts.pop(request.request_id, None)      # a fresh request never inherits state

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.counts.pop(request.request_id, None)


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

    def acceptance(self, batch) -> torch.Tensor:
        values = [self._acc(self.draft.noise_of(s)) for s in batch.slots.tolist()]
        return torch.tensor(values)[:, None].expand(len(values), self.cfg.k_max).clone()

    def costs(self):
        return self.true_costs
