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
"""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from specflow.errors import ConfigError
from specflow.stages.proposers.draft import DraftModelProposer, DraftProposerConfig

WEIGHTS = ("auto", "int4", "int8")


@dataclass
class SelfProposerConfig(DraftProposerConfig):
    name: str = "self"
    dtype: str = "auto"            # the draft's weights: auto (a Q4 GGUF file's own blocks,
                                   # else int4) | int4 | int8
    group_size: int = 32           # int4: weights sharing one scale and zero
    activations: str = "auto"      # auto | bfloat16 | float32 (what the draft's products read;
                                   # auto: float32 on specflow's native block product)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in WEIGHTS:
            raise ConfigError(f"proposer.dtype={self.dtype!r}; use auto (a GGUF target's own "
                              f"blocks, int4 otherwise), int4 or int8 (the target's own weights, "
                              f"narrower)")


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
