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
@dataclass
class SelfProposerConfig(DraftProposerConfig):
    name: str = "self"
    k: int = 6                     # it agrees ~95% of the time: longer chains pay (k = 8
                                   # verifies 9 positions: two walks of a tiled weight, 8 rows each)
    dtype: str = "auto"            # the draft's weights: auto (a Q4 GGUF file's own blocks,
                                   # else int4) | int4 | int8
    group_size: int = 32           # int4: weights sharing one scale and zero
    activations: str = "auto"      # auto | bfloat16 | float32 (what the draft's products read;
                                   # auto: float32 on specflow's native block product)
    prefill: str = "target"        # the draft's cache of a prompt: target (the target's keys
                                   # and values, copied) | own (the draft's own prefill)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in WEIGHTS:
            raise ConfigError(f"proposer.dtype={self.dtype!r}; use auto (a GGUF target's own "
                              f"blocks, int4 otherwise), int4 or int8 (the target's own weights, "
                              f"narrower)")
        if self.prefill not in PREFILLS:
            raise ConfigError(f"proposer.prefill={self.prefill!r}; use target (copy the "
                              f"target's cached prompt) or own (the draft's own prefill)")


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
        # the same checkpoint: its cache takes the target's unless a setting made them differ
        # (the target's max_model_len or slots); then it prefills on its own, as prefill=own
        self.adopts = cfg.prefill == "target" and self.model.can_adopt_cache(ctx.target) is None

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
