"""A lean forward pass over a Llama-family checkpoint (Llama, Mistral, Qwen2), in gpt-fast's style.

transformers' module stack costs a fixed ~0.5 ms per call on a CPU, which is most of a tiny draft
model's step. This is the same computation, from the same weights, as a plain sequence of tensor
ops (q/k/v and gate/up projections fused), writing keys and values into the same SlotKVCache.
Results match transformers' forward up to float rounding. specflow uses it for draft models by
default (`forward: auto`), where rounding can only move acceptance, never the output; a target
keeps transformers' forward unless `model.forward=lean` is asked for.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED = {"llama", "mistral", "qwen2"}


def unsupported_reason(config) -> str | None:
    """None when the lean forward computes exactly what transformers' does for this config."""
    if config.model_type not in SUPPORTED:
        return f"model_type={config.model_type} (lean forward: {', '.join(sorted(SUPPORTED))})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act}"
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if kind not in ("default", None):
        return f"rope_scaling={kind}"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias"
    return None


class LeanLlama:
    def __init__(self, model):
        cfg = model.config
        inner = model.model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.eps = cfg.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq                                   # [D/2]
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                att, mlp = layer.self_attn, layer.mlp
                biases = [att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]
                self.layers.append((
                    layer.input_layernorm.weight,
                    torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]),
                    torch.cat(biases) if biases[0] is not None else None,
                    att.o_proj.weight,
                    att.o_proj.bias,                  # Llama with attention_bias=True has one
                    layer.post_attention_layernorm.weight,
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                    mlp.down_proj.weight,
                ))
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * x32.to(x.dtype)

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq                         # [B, T, D/2]
        emb = torch.cat([freqs, freqs], -1)                                           # [B, T, D]
        return ((emb.cos() * self.rope_scale).to(dtype)[:, None],
                (emb.sin() * self.rope_scale).to(dtype)[:, None])                    # [B, 1, T, D]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 cache, logits_to_keep: int = 0) -> torch.Tensor:
        B, T = input_ids.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(input_ids, self.embed)                                        # [B, T, E]
        cos, sin = self._rope(positions, x.dtype)
        for i, (ln1, wqkv, bqkv, wo, bo, ln2, wgu, wdown) in enumerate(self.layers):
            qkv = F.linear(self._rms(x, ln1), wqkv, bqkv)                             # [B, T, (H+2Hkv)D]
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], -1)
            q = self._rotate(q.view(B, T, H, D).transpose(1, 2), cos, sin)            # [B, H, T, D]
            k = self._rotate(k.view(B, T, Hkv, D).transpose(1, 2), cos, sin)          # [B, Hkv, T, D]
            v = v.view(B, T, Hkv, D).transpose(1, 2)
            k_all, v_all = cache.update(k, v, i)                                      # [B, Hkv, L, D]
            if Hkv != H:
                k_all = k_all.repeat_interleave(H // Hkv, 1)
                v_all = v_all.repeat_interleave(H // Hkv, 1)
            a = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)       # [B, H, T, D]
            x = x + F.linear(a.transpose(1, 2).reshape(B, T, H * D), wo, bo)
            gate, up = F.linear(self._rms(x, ln2), wgu).chunk(2, -1)                  # [B, T, I] x2
            x = x + F.linear(F.silu(gate) * up, wdown)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return F.linear(self._rms(x, self.norm), self.lm_head)                       # [B, T, V]
