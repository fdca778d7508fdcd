"""proposer=self: the target drafts for itself, its own layers held in int4 (or int8).

A decoding pass on a CPU costs the bytes of weights it reads; the same model in 4 bits reads
about a quarter of them and agrees with its float self on most tokens. So the draft is the
target's own checkpoint, loaded a second time with `dtype=int4` (backends/lean/quantized.py):
no second model file, no training, the target's tokenizer and vocabulary by construction, its
own KV cache. A target read from a GGUF file of Q4_0 / Q4_1 layers drafts with the file's own
blocks as they are (`proposer.dtype=auto`, the default; int4 quantized from the float weights
elsewhere), which
agree with the float target far more often than the same weights quantized again (SmolLM2's
Q4_1 file: acceptance 0.99 against 0.92). It drafts like any draft model (chains, or EAGLE-2
trees with topk > 1), and the verifier keeps the output exactly the target's.

The draft's cache of a prompt is the target's (`proposer.prefill=target`, the default): the
target has just computed the keys and values of every prompt position with the same layers, so
the draft copies them instead of running its own prefill (a prefill is compute-bound, so
narrow weights barely shorten it: on SmolLM2's 121-token prompts the Q4_1 draft's took 0.09 s,
40% of the float32 target's, a tenth of the whole request). Tokens committed while the policy
kept a row at k = 0 are taken the same way. The draft then attends over its float self's context
and its own drafts; any draft leaves the output exact, since each draft is sampled from the very
q the verifier is given. `proposer.prefill=own` runs the draft's own prefill instead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from omegaconf import OmegaConf

from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.stages.proposers.draft import DraftModelProposer, DraftProposerConfig

WEIGHTS = ("auto", "int4", "int8")
PREFILLS = ("target", "own")
AUTO_VOCAB_FROM = 32768        # draft_vocab=auto cuts vocabularies from this size to their half


def draft_rows(setting, vocab: int) -> int | None:
    """proposer.draft_vocab as the count of first token ids the draft proposes among, or None
    for every token: auto halves a vocabulary of AUTO_VOCAB_FROM or more (there the LM head is
    a large share of a small draft's bytes; SmolLM2's 49,152-row head is 34 MB of the ~100
    its Q4_1 draft reads a step), keeps a smaller one whole."""
    if setting is None:
        return None
    if setting == "auto":
        return -(-vocab // 32) * 16 if vocab >= AUTO_VOCAB_FROM else None
    return setting if setting < vocab else None


@dataclass
class SelfProposerConfig(DraftProposerConfig):
    name: str = "self"
    dtype: str = "auto"            # the draft's weights: auto (a Q4 GGUF file's own blocks,
                                   # else int4) | int4 | int8
    group_size: int = 32           # int4: weights sharing one scale and zero
    activations: str = "auto"      # auto | bfloat16 | float32 (what the draft's products read;
                                   # auto: float32 on specflow's native block product)
    prefill: str = "target"        # the draft's cache of a prompt: target (the target's keys
                                   # and values, copied) | own (the draft's own prefill)
    draft_vocab: str | int | None = "auto"   # the draft proposes among the vocabulary's first
                                   # this many token ids (its LM head reads those rows): auto
                                   # (half a vocabulary of 32768 or more) | null (every token)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in WEIGHTS:
            raise ConfigError(f"proposer.dtype={self.dtype!r}; use auto (a GGUF target's own "
                              f"blocks, int4 otherwise), int4 or int8 (the target's own weights, "
                              f"narrower)")
        if self.prefill not in PREFILLS:
            raise ConfigError(f"proposer.prefill={self.prefill!r}; use target (copy the "
                              f"target's cached prompt) or own (the draft's own prefill)")
        if self.draft_vocab != "auto" and self.draft_vocab is not None and (
                isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int)
                or self.draft_vocab < 1):
            raise ConfigError(f"proposer.draft_vocab={self.draft_vocab!r}; use auto, null (every "
                              f"token) or a count (>= 1) of the vocabulary's first token ids")


def holds_q4(target) -> bool:
    """Whether the target was read from a GGUF file whose layers are all Q4_0 / Q4_1 blocks,
    which dtype=auto holds as they are (backends/lean/gguf_blocks.py); a file of other types
    would leave the draft in float, so auto takes int4 there."""
    from specflow.backends.lean.gguf_blocks import INT4_TYPES, file_types, other_layer_types

    file = target.gguf_file()
    try:
        return file is not None and not other_layer_types(file_types(file), INT4_TYPES)
    except (OSError, ValueError):
        return False


class SelfProposer(DraftModelProposer):
    def __init__(self, cfg: SelfProposerConfig, ctx):
        from specflow.backends.hf.backend import HFBackend
        from specflow.build import build_draft

        node = ctx.cfg.get("model")
        if not isinstance(ctx.target, HFBackend) or node is None or node.get("name") != "hf":
            raise ConfigError("proposer=self drafts with the target's own weights in int4 or "
                              "int8 and needs a transformers target (model=hf, model=demo or "
                              "model=smollm2); for model=synthetic use proposer=draft")
        # the target's own model node, narrower: built as any draft=hf is
        dtype = cfg.dtype if cfg.dtype != "auto" else "auto" if holds_q4(ctx.target) else "int4"
        own = OmegaConf.create({**OmegaConf.to_container(node, resolve=True),
                                "dtype": dtype, "group_size": cfg.group_size,
                                "activations": cfg.activations, "graphs": False})
        ctx._draft, ctx.build_draft = None, lambda: build_draft(own, ctx)   # not cfg.draft's
        super().__init__(cfg, ctx)
        self.target = ctx.target
        self._cut_head(cfg.draft_vocab)
        # the same checkpoint: its cache takes the target's unless a setting made them differ
        # (the target's max_model_len or slots); then it prefills on its own, as prefill=own
        self.adopts = cfg.prefill == "target" and self.model.can_adopt_cache(ctx.target) is None

    def _cut_head(self, setting) -> None:
        """The draft's LM head cut to the vocabulary's first token ids (draft_vocab): a draft
        step reads those rows only. Byte-level BPE vocabularies list their tokens in merge
        order, the most frequent pieces first, so the first half holds nearly every token text
        needs (SmolLM2, 24,576 of 49,152: acceptance 0.978 -> 0.955, a draft step 17% fewer
        bytes). A draft can never propose a token past them; the verifier decides as always,
        so the output is unchanged (each draft is sampled from the q it is scored by: zero past
        the first ids)."""
        V = self.target.vocab_size
        n = draft_rows(setting, V)
        if n is None:
            return
        lean = getattr(self.model, "lean", None)
        if lean is None or not lean.first_tokens(n):
            if setting == "auto":
                return
            raise ConfigError(f"proposer.draft_vocab={setting}: the draft's LM head is held in a "
                              f"layout it cannot be cut from (ATen's packed int4, oneDNN's packed "
                              f"rows, or no lean forward); use proposer.draft_vocab=null")
        if self.model.weights is not None:
            self.model.weights += (f"; drafting among the first {lean.lm_head.shape[0]} of "
                                   f"{V} tokens (proposer.draft_vocab)")

    @hookimpl
    def specflow_propose(self, batch, k):
        start = time.perf_counter()
        if self.adopts:      # rows about to draft whose cache lags: the target's entries
            lagging = [(s, self.target.cache_length(s))
                       for s, ids, kb in zip(batch.slots.tolist(), batch.token_ids, self._room(batch, k))
                       if kb > 0 and len(ids) - self.model.cache_length(s) > self.CATCH_UP]
            if lagging:
                self.model.adopt_cache(self.target, [s for s, _ in lagging],
                                       [n for _, n in lagging])
        adopted = time.perf_counter() - start
        proposal = super().specflow_propose(batch, k)
        proposal.catch_up_seconds += adopted
        return proposal
