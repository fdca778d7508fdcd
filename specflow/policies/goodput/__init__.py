"""`policy=goodput` (and `policy=oracle`): per sequence, per round, the k that maximises
committed tokens per second, from acceptance and costs learned online.

The policy is its parts, one module each:

- acceptance.py: per sequence and draft position, the chance a draft is accepted;
- fits.py: the forgetting least-squares fits its costs are learned with;
- costs.py: the passes timed once the pipeline is built (the fits' priors);
- choose.py: the k per row that turns out the most expected tokens per second;
- explore.py: the rounds forced to keep plain decoding and drafting measured;
- catch_up.py: a draft model's catch-up, charged to the rows that draft;
- pricing.py: what a token tree costs, and the price a node must beat;
- modes.py: trees or chains, on what each achieved;
- policy.py: GoodputPolicy, wiring them; oracle.py: OraclePolicy (the synthetic pair's truth).
"""
from specflow.policies.goodput.acceptance import AcceptanceEstimates
from specflow.policies.goodput.catch_up import CatchUpCosts
from specflow.policies.goodput.choose import choose_k, choose_k_padded, expected_tokens
from specflow.policies.goodput.costs import MeasuredCosts
from specflow.policies.goodput.explore import IdleProbes, PlainRounds
from specflow.policies.goodput.fits import DraftCostFit, LineFit, TwoTermFit
from specflow.policies.goodput.modes import MODES, ModeChooser
from specflow.policies.goodput.oracle import OraclePolicy, OraclePolicyConfig
from specflow.policies.goodput.policy import GoodputPolicy, GoodputPolicyConfig
from specflow.policies.goodput.pricing import RecentThroughput, TreeSize, node_price

__all__ = ["AcceptanceEstimates", "CatchUpCosts", "DraftCostFit", "GoodputPolicy",
           "GoodputPolicyConfig", "IdleProbes", "LineFit", "MODES", "MeasuredCosts",
           "ModeChooser", "OraclePolicy", "OraclePolicyConfig", "PlainRounds", "RecentThroughput",
           "TreeSize", "TwoTermFit", "choose_k", "choose_k_padded", "expected_tokens",
           "node_price"]
