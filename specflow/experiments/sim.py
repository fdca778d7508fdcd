"""`specflow sim`: the formula tables of articles A and B (docs/design.md §6), measured through the real pipeline.

Every arm runs Pipeline on the synthetic pair (sampling at temperature 1, static k), so the
verifier, the draft proposer and the metrics are the ones users run. Three studies:

- K sweep and noise sweep (article B, docs/design.md §6): acceptance_rate (accepted / proposed, the article's figure)
  and alpha (accepted / examined) beside the formula (1 - a^(k+1)) / (1 - a). With alpha the measured
  tau matches at every k; with the article's figure it falls apart at large k (the article's
  "measured beats theory at K=16" is this counting artefact, not clustering of acceptances).
- best k per alpha at c = 0.1 (article A, docs/design.md §6): measured speedup in simulated time against speedup(a,k,c).
- tokens-per-round histograms at three noise levels (article B, Figure 2).

"Within sampling error" = |z| < 3 with z = (measured - formula) / standard error of the measured mean.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from specflow.config import compose
from specflow.metrics import expected_tokens, predicted_speedup
from specflow.backends.synthetic import base_distribution, noise_for_acceptance
from specflow.pipeline import Pipeline


def formula_tokens(a: float, k: int) -> float:
    """Expected tokens per target pass: (1 - a^(k+1)) / (1 - a) (specflow.metrics)."""
    return expected_tokens(a, k)


@dataclass
class Arm:
    k: int
    noise: float
    rows: int
    tokens: int
    seed: int
    c: float = 0.1


MODEL_KEYS = ("vocab_size", "contexts", "concentration", "seed")
# the articles' formulas are for rejection sampling (acceptance 1 - TV(p, q)); the default coupled
# rule accepts a sampled draft less often (docs/decisions.md)
ARTICLES_RULE = ("verifier.rule=rejection",)


def run_arm(arm: Arm, model: dict | None = None) -> dict:
    """One static-k sampling run over `rows` sequences of `tokens` tokens; returns the figures."""
    model_overrides = [f"model.{key}={model[key]}" for key in MODEL_KEYS if key in (model or {})]
    overrides = ["model=synthetic", "draft=synthetic", "proposer=draft", "policy=static",
                 "logits=[temperature]", *ARTICLES_RULE, f"draft.noise={arm.noise}", f"draft.step_cost={arm.c}",
                 f"proposer.k={arm.k}", f"max_batch_size={arm.rows}",
                 f"max_new_tokens={arm.tokens}", f"seed={arm.seed}", *model_overrides]
    pipe = Pipeline(compose(overrides))
    prompts = [pipe.tokenizer.chars[1 + (i % (pipe.target.vocab_size - 1))] for i in range(arm.rows)]
    results = pipe.generate(prompts)
    s = pipe.last_stats
    passes, accepted = s["num_target_passes"], s["num_accepted_tokens"]
    # tokens per pass before the length cap trims the last round: what the formula predicts
    tau = (accepted + passes) / passes
    hist = {int(n): c for n, c in s["tokens_per_step_histogram"].items()}
    mean = sum(n * c for n, c in hist.items()) / passes
    var = sum(c * (n - mean) ** 2 for n, c in hist.items()) / max(passes - 1, 1)
    tokens = sum(len(r.token_ids) for r in results)
    row_time = sum(r.stats["sim_time"].get("target", 0) + r.stats["sim_time"].get("draft", 0)
                   for r in results)
    return {
        "k": arm.k, "noise": arm.noise, "c": arm.c, "rows": arm.rows, "tokens": tokens,
        "passes": passes, "acceptance_rate": s["acceptance_rate"], "alpha": s["alpha"],
        "tau": tau, "tau_se": math.sqrt(var / passes),
        "tokens_per_step_histogram": hist,
        # speedup over plain decoding (1 token per unit of simulated time per sequence)
        "speedup": tokens / row_time if row_time else 0.0,
        "speedup_se": math.sqrt(var / passes) / (1 + arm.k * arm.c),
        "acceptance_per_position": s["acceptance_per_position"],
    }


def _z(measured: float, expected: float, se: float) -> float:
    return (measured - expected) / se if se > 0 else (0.0 if measured == expected else math.inf)


def k_sweep(noise: float, ks: list[int], rows: int, tokens: int, seed: int, model: dict | None = None,
            progress: Callable[[], None] = lambda: None) -> list[dict]:
    out = []
    for k in ks:
        r = run_arm(Arm(k, noise, rows, tokens, seed), model)
        r["formula_alpha"] = formula_tokens(r["alpha"], k)
        r["formula_acceptance_rate"] = formula_tokens(r["acceptance_rate"], k)
        r["z"] = _z(r["tau"], r["formula_alpha"], r["tau_se"])
        out.append(r)
        progress()
    return out


def noise_sweep(k: int, noises: list[float], rows: int, tokens: int, seed: int,
                model: dict | None = None, progress: Callable[[], None] = lambda: None) -> list[dict]:
    return [k_sweep(n, [k], rows, tokens, seed, model, progress)[0] for n in noises]


def best_k_sweep(alphas: list[float], ks: list[int], c: float, rows: int, tokens: int, seed: int,
                 model: dict, progress: Callable[[], None] = lambda: None) -> list[dict]:
    """For each target acceptance a: the draft noise that yields it, then speedup at every k."""
    base = base_distribution(model["vocab_size"], model["concentration"], model["seed"])
    out = []
    for a in alphas:
        noise = noise_for_acceptance(base, a)
        arms = []
        for k in ks:
            r = run_arm(Arm(k, noise, rows, tokens, seed, c), model)
            r["formula_speedup"] = predicted_speedup(a, k, c)
            r["z"] = _z(r["speedup"], r["formula_speedup"], r["speedup_se"])
            arms.append(r)
            progress()
        f_best = max(arms, key=lambda r: r["formula_speedup"])
        m_best = max(arms, key=lambda r: r["speedup"])
        out.append({"alpha": a, "noise": noise, "c": c, "arms": arms,
                    "formula_best_k": f_best["k"], "formula_best_speedup": f_best["formula_speedup"],
                    "measured_best_k": m_best["k"], "measured_best_speedup": m_best["speedup"],
                    "measured_at_formula_best": f_best["speedup"], "z": f_best["z"]})
    return out


def histograms(k: int, noises: list[float], rows: int, tokens: int, seed: int,
               model: dict | None = None, progress: Callable[[], None] = lambda: None) -> list[dict]:
    out = []
    for n in noises:
        r = run_arm(Arm(k, n, rows, tokens, seed), model)
        out.append({"noise": n, "k": k, "alpha": r["alpha"],
                    "tokens_per_step_histogram": r["tokens_per_step_histogram"]})
        progress()
    return out


# --- policies on a traffic mix ------------------------------------------------------------------

def policy_mix(arms: dict[str, list[str]], mix: dict[str, float], requests: int, tokens: int,
               rows: int, seed: int, model: dict, costs: dict,
               progress: Callable[[], None] = lambda: None) -> list[dict]:
    """Every arm decodes the same interleaved requests (one per traffic class in turn) with
    continuous batching; throughput = committed tokens per unit of simulated time."""
    classes = list(mix)
    prompts = [f"{classes[i % len(classes)]} {i}" for i in range(requests)]
    noise = ", ".join(f"{name}: {n}" for name, n in mix.items())
    base = ["model=synthetic", "draft=synthetic", "proposer=draft", "logits=[temperature]", *ARTICLES_RULE,
            f"draft.noise_by_prefix={{{noise}}}", f"max_batch_size={rows}", f"seed={seed}",
            f"model.token_cost={costs['target_token']}", f"draft.step_cost={costs['draft_step']}",
            f"draft.token_cost={costs['draft_token']}",
            *[f"model.{key}={model[key]}" for key in MODEL_KEYS if key in model]]
    out = []
    for name, overrides in arms.items():
        pipe = Pipeline(compose([*base, *overrides]))
        results = pipe.generate(prompts, max_new_tokens=tokens)
        s = pipe.last_stats
        row = {"arm": name, "throughput": s["num_committed_tokens"] / pipe.clock.time,
               "alpha": s["alpha"], "mean_acceptance_length": s["mean_acceptance_length"]}
        for cls in classes:
            mine = [r for r in results if r.prompt.startswith(cls)]
            drafts = sum(r.stats["num_draft_tokens"] for r in mine)
            rounds = sum(r.stats["num_rounds"] for r in mine)
            row[f"k_{cls}"] = drafts / rounds if rounds else 0.0
        out.append(row)
        progress()
    static = [r for r in out if r["arm"].startswith("static")]
    best = max(static, key=lambda r: r["throughput"]) if static else None
    oracle = next((r for r in out if r["arm"] == "oracle"), None)
    for r in out:
        r["vs_best_static"] = r["throughput"] / best["throughput"] if best else None
        r["vs_oracle"] = r["throughput"] / oracle["throughput"] if oracle else None
    return out


def count_arms(c: dict) -> int:
    """How many pipeline runs the selected studies make (for a progress bar)."""
    studies = set(c["studies"])
    return (len(c["k_sweep"]["ks"]) * ("k_sweep" in studies)
            + len(c["noise_sweep"]["noises"]) * ("noise_sweep" in studies)
            + len(c["best_k"]["alphas"]) * len(c["best_k"]["ks"]) * ("best_k" in studies)
            + len(c["histogram"]["noises"]) * ("histogram" in studies)
            + (len(c["policy_mix"]["static_ks"]) + len(c["policy_mix"]["arms"]))
            * len(c["policy_mix"]["regimes"]) * ("policy_mix" in studies))


def run_studies(c: dict, step: Callable[[], None] = lambda: None) -> dict:
    """Every study `c["studies"]` names, from the resolved sim config `c`; `step` after each arm.

    Returns the report: {"config": c, <study>: rows, ...} (what sim.json holds).
    """
    model = c["model"]
    studies = set(c["studies"])
    rows, tokens, seed = c["rows"], c["tokens"], c["seed"]
    report: dict = {"config": c}
    if "k_sweep" in studies:
        ks = c["k_sweep"]
        report["k_sweep"] = k_sweep(ks["noise"], ks["ks"], rows, tokens, seed, model, step)
    if "noise_sweep" in studies:
        ns = c["noise_sweep"]
        report["noise_sweep"] = noise_sweep(ns["k"], ns["noises"], rows, tokens, seed, model, step)
    if "best_k" in studies:
        bk = c["best_k"]
        report["best_k"] = best_k_sweep(bk["alphas"], bk["ks"], bk["c"], rows, tokens, seed,
                                        {**model, "concentration": bk["concentration"]}, step)
    if "histogram" in studies:
        h = c["histogram"]
        report["histogram"] = histograms(h["k"], h["noises"], rows, tokens, seed, model, step)
    if "policy_mix" in studies:
        pm = c["policy_mix"]
        arms = {f"static k={k}": ["policy=static", f"policy.k={k}"] for k in pm["static_ks"]}
        arms.update({name: list(o) for name, o in pm["arms"].items()})
        report["policy_mix"] = {
            regime: policy_mix(arms, pm["mix"], pm["requests"], pm["tokens"], pm["rows"], seed,
                               model, costs, step)
            for regime, costs in pm["regimes"].items()}
    return report
