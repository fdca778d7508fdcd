"""EAGLE-3's training-time test: the head is trained on its own predictions over several steps.

Row t of a window stays the chain rooted at pair t throughout (as in SafeAILab's EAGLE-3 trainer):
step j feeds row t the head's own state from step j - 1 with the token at t + 1 + j, at RoPE
position t + j, and predicts the token at t + 2 + j. Its attention sees the step-0 keys of pairs
0..t (they rest on the target's states, causal) and the keys of steps 1..j at row t only (its
own chain) — exactly the cache a draft step sees at inference after j - 1 accepted drafts.

Loss per step: soft cross-entropy against the target's distribution restricted to the draft
vocabulary and renormalised, over positions whose target argmax the draft vocabulary holds;
step j weighs 0.8^j (EAGLE-3's weights).
"""
from __future__ import annotations

import math

import torch

STEP_WEIGHT = 0.8


def chain_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                    gqa: int) -> torch.Tensor:
    """q [B, H, T, D]; keys/values [B, Hkv, T, D] per step so far (step 0 causal, later steps
    diagonal) -> [B, H, T, D]."""
    if gqa > 1:
        keys = [k.repeat_interleave(gqa, 1) for k in keys]
        values = [v.repeat_interleave(gqa, 1) for v in values]
    T, D = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(D)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = (q @ keys[0].transpose(-1, -2)) * scale                                 # [B, H, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]             # [B, H, T, 1]
    w = torch.cat([s0, *diag], -1).softmax(-1)                                   # [B, H, T, T+j]
    out = w[..., :T] @ values[0]
    for i, v in enumerate(values[1:]):
        out = out + w[..., T + i:T + i + 1] * v
    return out


def chain_states(head, states: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor,
                 steps: int):
    """The head's pre-norm state [B, T, E] at each of `steps` chain steps over a window:
    states [B, T, nE] (target, positions o..o+T-1), tokens [B, >= T + steps] (tokens at o..,
    -1 where none)."""
    T = states.shape[1]
    gqa = head.shape.num_attention_heads // head.shape.num_key_value_heads
    positions = offsets[:, None] + torch.arange(T, device=states.device)[None]     # [B, T]
    h = head.layer_input(states)                                                   # [B, T, E]
    keys, values = [], []
    for j in range(steps):
        inp = tokens[:, 1 + j:1 + j + T].clamp(min=0)                              # [B, T]
        q, k, v = head.qkv(h, inp, positions + j)
        keys.append(k)
        values.append(v)
        h = head.finish(h, chain_attention(q, keys, values, gqa))                  # [B, T, E]
        yield h


def ttt_loss(head, states: torch.Tensor, tokens: torch.Tensor, target_logits, steps: int,
             offsets: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """One window batch: states [B, T, nE] (target, at positions o..o+T-1), tokens [B, T + 1 +
    steps] (tokens at o..), valid [B, T + 1 + steps] bool (real tokens), target_logits(j) ->
    the target's draft-vocabulary logits [B, T, Vd] predicting the tokens at o + t + 2 + j.
    Returns (loss, per-step top-1 accuracy over the positions scored)."""
    T = states.shape[1]
    loss = states.new_zeros(())
    accuracy = []
    t2d = head.t2d
    for j, h in enumerate(chain_states(head, states, tokens, offsets, steps)):
        logp = head.logits(h).float().log_softmax(-1)                              # [B, T, Vd]
        with torch.no_grad():
            tl = target_logits(j)                                                  # [B, T, Vd]
            p = tl.softmax(-1)
            truth = tokens[:, 2 + j:2 + j + T]                                     # [B, T]
            mask = valid[:, 2 + j:2 + j + T] & t2d[truth.clamp(min=0)]
            mask = mask.float()
        step = -(p * logp).sum(-1)                                                 # [B, T]
        n = mask.sum().clamp(min=1)
        loss = loss + STEP_WEIGHT ** j * (step * mask).sum() / n
        with torch.no_grad():
            hit = (head.draft_ids[logp.argmax(-1)] == truth).float()
            accuracy.append(float((hit * mask).sum() / n))
    return loss, accuracy


def chain_acceptance(accepted_runs: torch.Tensor, k: int) -> dict:
    """From per-position run lengths of consecutive correct greedy drafts (capped at the steps
    trained), the greedy acceptance figures at draft length k: α per step and τ = 1 + E[min(run, k)]
    (tokens per target pass)."""
    runs = accepted_runs.float()
    per_step = [float((runs > j).float().mean()) for j in range(k)]
    return {"tau": 1.0 + float(runs.clamp(max=k).mean()), "acceptance_by_step": per_step}
