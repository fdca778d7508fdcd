"""specflow's proposer and policy, built from overrides, without a target model.

Inside vLLM only the stages that draft from token history can run: vLLM owns the target, its
cache and its verifier. `HistoryStages.build` composes specflow's config from the overrides,
builds the proposer and the policy as the pipeline would (every plugin's options included), and
refuses, in one line each, what needs more than the token history: a draft model, the target's
hidden states, a token tree, a policy that times specflow's own passes.
"""
from __future__ import annotations

import shlex
from typing import Sequence

import torch

from specflow.errors import ConfigError

OVERRIDES_ENV = "SPECFLOW_VLLM_OVERRIDES"
# what vLLM runs instead of the specflow stages that need more than the token history
INSTEAD = {
    "draft": "vLLM's own draft-model speculation: speculative_config={'method': 'draft_model', "
             "'model': <draft folder>}",
    "hidden": "vLLM's own EAGLE-3: speculative_config={'method': 'eagle3', 'model': <head "
              "folder>} (specflow train-head writes a head it loads)",
}


def read_overrides(text: str | None) -> list[str]:
    """SPECFLOW_VLLM_OVERRIDES's value split as a shell would; proposer=ngram unless it names one."""
    try:
        overrides = shlex.split(text or "")
    except ValueError as exc:
        raise ConfigError(f"{OVERRIDES_ENV}={text!r} cannot be split into overrides ({exc}); "
                          f"quote values as on the command line, e.g. "
                          f"{OVERRIDES_ENV}='proposer=ngram policy=adaptive'") from None
    if not any(o.lstrip("+").startswith("proposer=") for o in overrides):
        overrides = ["proposer=ngram", *overrides]
    return overrides


class NeedsDraftModel(ConfigError):
    """A proposer asked for the draft model, which only specflow's pipeline builds."""


class HistoryStages:
    """A proposer and a policy registered on their own plugin manager."""

    def __init__(self, cfg, pm, k_max: int):
        self.cfg, self.pm, self.hook, self.k_max = cfg, pm, pm.hook, k_max

    @classmethod
    def build(cls, overrides: Sequence[str], k_max: int, slots: int) -> "HistoryStages":
        from specflow.config import compose
        from specflow.backends.contract import SimClock
        from specflow.build import BuildContext, build_component
        from specflow.plugins import check_hooks, new_plugin_manager

        overrides = [*overrides, f"max_batch_size={slots}"]
        cfg = compose(overrides)
        proposer = cfg.proposer.name
        if proposer == "none":
            raise ConfigError(f"proposer=none drafts nothing; in {OVERRIDES_ENV} name a proposer "
                              f"that drafts from the token history (proposer=ngram, or a "
                              f"plugin's)")
        if not any(o.lstrip("+").startswith("proposer.k=") for o in overrides):
            cfg = compose([*overrides, f"proposer.k={k_max}"])    # vLLM's num_speculative_tokens
        shaping = [f"logits=[{','.join(cfg.logits)}]"] if cfg.get("logits") else []
        if cfg.get("constraint") is not None and cfg.constraint.name != "none":
            shaping.append(f"constraint={cfg.constraint.name}")
        if shaping:
            raise ConfigError(f"{' '.join(shaping)}: inside vLLM the target's sampling and "
                              f"structured output are vLLM's (SamplingParams, guided decoding), "
                              f"and a drafter drafts from the tokens; drop them from "
                              f"{OVERRIDES_ENV}")
        if int(cfg.proposer.get("topk", 1) or 1) > 1:
            raise ConfigError(f"proposer.topk={cfg.proposer.topk}: vLLM verifies chains, not token "
                              f"trees; use proposer.topk=1 inside vLLM")
        pm = new_plugin_manager()
        ctx = BuildContext(cfg=cfg, slots=slots, clock=SimClock(), device=torch.device("cpu"),
                           hook=pm.hook)

        def no_draft_model():
            raise NeedsDraftModel(f"proposer={proposer} needs a draft model, which specflow cannot "
                                  f"run inside vLLM; use {INSTEAD['draft']}")

        ctx.build_draft = no_draft_model
        for kind in ("proposer", "policy"):
            node = cfg[kind]
            try:
                stage = build_component(kind, node, ctx)
            except NeedsDraftModel:
                raise
            except ConfigError as exc:       # a factory that wanted the target (ctx.target)
                raise ConfigError(f"{kind}={node.name} cannot be built without specflow's own "
                                  f"target model ({exc}); inside vLLM specflow runs stages that "
                                  f"work from the token history; for a draft model or a head use "
                                  f"vLLM's own methods (draft_model, eagle3)") from None
            pm.register(stage, name=f"{kind}.{node.name}")
        check_hooks(pm)
        if any(pm.hook.specflow_hidden_layers()):
            raise ConfigError(f"proposer={proposer} reads the target's hidden states, which vLLM "
                              f"does not hand to a custom proposer; use {INSTEAD['hidden']}")
        timed = [impl.plugin_name for impl in pm.hook.specflow_pipeline_built.get_hookimpls()]
        if timed:
            raise ConfigError(f"{timed[0]} needs specflow's own pipeline (it times the target's "
                              f"passes), which vLLM runs instead; inside vLLM use policy=static, "
                              f"adaptive, heuristic or schedule")
        return cls(cfg, pm, k_max)
