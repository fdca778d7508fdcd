"""EAGLE-3 heads in the `speculators` format (vLLM's format for speculator checkpoints).

specflow writes heads in the published EAGLE-3 layout (a Llama config.json with `eagle_config`,
weights `midlayer.*`), which vLLM's `eagle3` method loads as is. The `speculators` package
(https://github.com/vllm-project/speculators) keeps the same weights under another config:
`speculators_model_type: eagle3`, the Llama fields nested in `transformer_layer_config`, the
aux layer ids at the top, the verifier named in `speculators_config`, and the decoder layer as
`layers.0.*`. vLLM loads both. This module converts between them with the standard library and
safetensors only (no `speculators` import): `flatten` reads a speculators config as the
published one; `write_speculators` writes a head folder in the speculators format.
"""
from __future__ import annotations

import json
import pathlib

SPECULATORS_VERSION = "0.9.0"     # the release whose format this writes (and is tested against)
LLAMA_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
              "max_position_embeddings", "vocab_size", "attention_bias", "mlp_bias")


def is_speculators(config: dict) -> bool:
    return "speculators_model_type" in config


def flatten(config: dict) -> dict:
    """A speculators-format EAGLE-3 config.json as the published layout's keys."""
    layer = dict(config.get("transformer_layer_config") or {})
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    out = {k: layer[k] for k in LLAMA_KEYS if k in layer}
    out["rope_theta"] = float(layer.get("rope_theta", rope.get("rope_theta", 10000.0)))
    out["architectures"] = ["LlamaForCausalLMEagle3"]
    out["model_type"] = "llama"
    for key in ("draft_vocab_size", "target_hidden_size"):
        if config.get(key) is not None:
            out[key] = config[key]
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids),
                               "use_aux_hidden_state": True}
    if "specflow" in config:
        out["specflow"] = config["specflow"]
    return out


def to_speculators(config: dict, verifier: str, architectures: list[str] | None = None,
                   speculative_tokens: int = 3) -> dict:
    """The published layout's config.json in the speculators format (verifier: the target's
    folder or hub id, as speculators records it)."""
    layer = {k: config[k] for k in LLAMA_KEYS if k in config}
    layer.update({"model_type": "llama", "tie_word_embeddings": False, "use_cache": True,
                  "rope_parameters": {"rope_theta": float(config.get("rope_theta", 10000.0)),
                                      "rope_type": "default"}})
    if config.get("torch_dtype"):
        layer["dtype"] = config["torch_dtype"]
    eagle = config.get("eagle_config") or {}
    out = {
        "architectures": ["Eagle3Speculator"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": config.get("draft_vocab_size", config.get("vocab_size")),
        "target_hidden_size": config.get("target_hidden_size", config.get("hidden_size")),
        "eagle_aux_hidden_state_layer_ids": eagle.get("eagle_aux_hidden_state_layer_ids"),
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
        "norm_output": False, "embed_requires_grad": False, "tie_word_embeddings": False,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens":
                                  int(speculative_tokens), "accept_tolerance": 0.0,
                                  "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier,
                         "architectures": architectures or ["LlamaForCausalLM"]},
        },
    }
    if config.get("torch_dtype"):
        out["dtype"] = config["torch_dtype"]
    if "specflow" in config:
        out["specflow"] = config["specflow"]
    return out


def write_speculators(head: str | pathlib.Path, out: str | pathlib.Path, verifier: str) -> None:
    """Write the head folder `head` (published layout) into `out` in the speculators format:
    config.json converted, weights renamed midlayer.* -> layers.0.* (values unchanged)."""
    from safetensors import safe_open
    from safetensors.torch import save

    head, out = pathlib.Path(head), pathlib.Path(out)
    config = json.loads((head / "config.json").read_text(encoding="utf-8"))
    if is_speculators(config):
        config = flatten(config)
    try:
        arch = json.loads((pathlib.Path(verifier) / "config.json").read_text(
            encoding="utf-8")).get("architectures")
    except (OSError, ValueError):
        arch = None
    tensors = {}
    for file in sorted(head.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                tensors[key.replace("midlayer.", "layers.0.", 1)] = fh.get_tensor(key)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    tmp.write_bytes(save({k: v.contiguous() for k, v in tensors.items()},
                         metadata={"format": "pt"}))
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(to_speculators(config, verifier, arch), indent=2)
                                     + "\n", encoding="utf-8")
