"""specflow's own components, registered through `specflow_register` exactly as a plugin's would be."""
from __future__ import annotations

from dataclasses import dataclass

from specflow.constraints.grammar import (ChoiceConfig, GrammarConstraint, JsonSchemaConfig,
                                          RegexConfig)
from specflow.experiments.workloads import (DemoWorkload, DemoWorkloadConfig, FileWorkload,
                                            FileWorkloadConfig)
from specflow.experiments.stdlib_corpus import StdlibWorkload, StdlibWorkloadConfig
from specflow.backends.hf.backend import HFModelConfig
from specflow.backends.synthetic import SyntheticBackend, SyntheticDraftConfig, SyntheticModelConfig
from specflow.plugins import hookimpl
from specflow.policies.adaptive import AdaptivePolicy, AdaptivePolicyConfig
from specflow.policies.goodput import (GoodputPolicy, GoodputPolicyConfig, OraclePolicy,
                                       OraclePolicyConfig)
from specflow.policies.heuristic import HeuristicPolicy, HeuristicPolicyConfig
from specflow.policies.schedule import SchedulePolicy, SchedulePolicyConfig
from specflow.policies.static import StaticPolicy, StaticPolicyConfig
from specflow.stages import logits, penalties
from specflow.stages.hf_processor import HFLogitsProcessor, HFProcessorConfig
from specflow.stages.proposers.draft import DraftModelProposer, DraftProposerConfig
from specflow.stages.proposers.self_draft import SelfProposer, SelfProposerConfig
from specflow.stages.proposers.eagle import EagleProposer, EagleProposerConfig
from specflow.stages.proposers.ngram import NgramProposer, NgramProposerConfig
from specflow.stages.proposers.none import NoneProposer, NoneProposerConfig
from specflow.stages.stop import StopConfig, StopTrimmer
from specflow.stages.verifier import StandardVerifier, StandardVerifierConfig


@dataclass
class NamedOnly:
    """Schema of options that have nothing to set (constraint=none, draft=none)."""

    name: str


def nothing(cfg, ctx):
    return None


def synthetic_target(cfg: SyntheticModelConfig, ctx):
    return SyntheticBackend(cfg, noise=0.0, clock=ctx.clock, source="target", slots=ctx.slots)


def synthetic_draft(cfg: SyntheticDraftConfig, ctx):
    if ctx.target is not None and not isinstance(ctx.target, SyntheticBackend):
        from specflow.errors import ConfigError
        raise ConfigError("draft=synthetic only pairs with model=synthetic; pick a draft model "
                          "for this target (draft=<option>)")
    return SyntheticBackend(cfg, noise=cfg.noise, clock=ctx.clock, source="draft", slots=ctx.slots,
                            mismatch=cfg.mismatch)


def hf_target(cfg, ctx):
    from specflow.backends.hf.backend import HFBackend
    return HFBackend(cfg, ctx.device, ctx.slots, role="model")


def hf_draft(cfg, ctx):
    from specflow.backends.hf.backend import HFBackend, check_same_tokenizer
    from specflow.errors import ConfigError
    if not isinstance(ctx.target, HFBackend):
        raise ConfigError("draft=hf/demo pairs with a transformers target (model=hf or "
                          "model=demo); for model=synthetic use draft=synthetic")
    draft = HFBackend(cfg, ctx.device, ctx.slots, role="draft")
    check_same_tokenizer(ctx.target, draft)
    return draft


def check_draft_preflight(cfg, prompts=None):
    from specflow.backends.hf.preflight import check_draft
    check_draft(cfg)


def check_eagle(cfg):
    from specflow.backends.heads.eagle import check_config
    check_config(cfg)


def check_train_layers(cfg):
    from specflow.backends.heads.eagle import check_train_layers
    check_train_layers(cfg)


def check_target_preflight(cfg, prompts=None):
    from specflow.backends.hf.preflight import check_prompts
    check_prompts(cfg, prompts)


@hookimpl
def specflow_register(registry):
    add = registry.add
    add("model", "synthetic", synthetic_target, SyntheticModelConfig)
    add("model", "hf", hf_target, HFModelConfig, preflight=check_target_preflight,
        check=check_train_layers)
    add("draft", "hf", hf_draft, HFModelConfig, preflight=check_draft_preflight)
    add("draft", "synthetic", synthetic_draft, SyntheticDraftConfig)
    add("draft", "none", nothing, NamedOnly)
    add("proposer", "none", NoneProposer, NoneProposerConfig)
    add("proposer", "draft", DraftModelProposer, DraftProposerConfig)
    add("proposer", "self", SelfProposer, SelfProposerConfig)
    add("proposer", "ngram", NgramProposer, NgramProposerConfig)
    add("proposer", "eagle", EagleProposer, EagleProposerConfig, check=check_eagle)
    add("logits", "temperature", logits.Temperature, logits.TemperatureConfig)
    add("logits", "top_k", logits.TopK, logits.TopKConfig)
    add("logits", "top_p", logits.TopP, logits.TopPConfig)
    add("logits", "min_p", logits.MinP, logits.MinPConfig)
    add("logits", "repetition_penalty", penalties.RepetitionPenalty, penalties.RepetitionPenaltyConfig)
    add("logits", "frequency_penalty", penalties.FrequencyPenalty, penalties.FrequencyPenaltyConfig)
    add("logits", "presence_penalty", penalties.PresencePenalty, penalties.PresencePenaltyConfig)
    add("logits", "min_new_tokens", penalties.MinNewTokens, penalties.MinNewTokensConfig)
    add("logits", "no_repeat_ngram", penalties.NoRepeatNgram, penalties.NoRepeatNgramConfig)
    add("logits", "bad_words", penalties.BadWords, penalties.BadWordsConfig)
    add("logits", "logit_bias", penalties.LogitBias, penalties.LogitBiasConfig)
    add("logits", "hf", HFLogitsProcessor, HFProcessorConfig)
    add("constraint", "none", nothing, NamedOnly)
    add("constraint", "json_schema", GrammarConstraint, JsonSchemaConfig)
    add("constraint", "regex", GrammarConstraint, RegexConfig)
    add("constraint", "choice", GrammarConstraint, ChoiceConfig)
    add("verifier", "standard", StandardVerifier, StandardVerifierConfig)
    add("stop", "default", StopTrimmer, StopConfig)
    add("policy", "static", StaticPolicy, StaticPolicyConfig)
    add("policy", "adaptive", AdaptivePolicy, AdaptivePolicyConfig)
    add("policy", "heuristic", HeuristicPolicy, HeuristicPolicyConfig)
    add("policy", "schedule", SchedulePolicy, SchedulePolicyConfig)
    add("policy", "goodput", GoodputPolicy, GoodputPolicyConfig)
    add("policy", "oracle", OraclePolicy, OraclePolicyConfig)
    add("workload", "demo", DemoWorkload, DemoWorkloadConfig)
    add("workload", "file", FileWorkload, FileWorkloadConfig)
    add("workload", "stdlib", StdlibWorkload, StdlibWorkloadConfig)
